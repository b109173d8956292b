"""Writes the newest checkpoint's policy as a Hugging Face model (and, under model.lora, as a
PEFT adapter).

  python -m oapl_jax.export --config=configs/gsm8k.py:lora --workdir=/tmp/oapl_gsm8k_lora \
      --out=/tmp/oapl_gsm8k_lora_hf [--policy=snapshot] [--config.model.path=...]

`<out>/` is a checkpoint folder transformers loads (`AutoModelForCausalLM.from_pretrained`):
config.json, safetensors and, when config.model.path has them, its tokenizer files. A full run
writes its weights as saved (pi_theta: model.param_dtype); a LoRA run writes the base merged
with the adapters in model.dtype (what its engines sample) and `<out>/adapter/` in PEFT's format
(`peft.PeftModel.from_pretrained(base_model, "<out>/adapter")`, adapters in float32), whose
`base_model_name_or_path` is config.model.path, or, for a base the run made (a random init, a
warm-up), `<out>/base/`: that base as a Hugging Face model, written there. A run on a quantised
base (model.base_quant) writes the adapters the same way, its base named and not merged into a
quantised copy: `<out>/base/` is the dequantised base the run trained on (model.dtype), and
`<out>` the merged weights in model.dtype; over config.model.path the adapter names the
full-precision checkpoint, which differs from the run's base by the quantisation. The config
must be the run's (the same validation as `oapl_jax.main`); a LoRA run's base is rebuilt and
checked against the checkpoint's sha256. A refused setting or a workdir without a checkpoint is
one line on stderr and exit code 2.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors  # noqa: E402
from oapl_jax.run_config import checked  # noqa: E402
from oapl_jax.workdir import check_output_folder  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file of the run.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding checkpoints/.")
_OUT = flags.DEFINE_string("out", None, "Folder to write the Hugging Face model (and adapter/) into.")
_POLICY = flags.DEFINE_enum("policy", "theta", ["theta", "snapshot"],
                            "Export pi_theta (the trained weights) or the engine's snapshot pi_old.")
flags.mark_flags_as_required(["config", "workdir", "out"])


def export_checkpoint(config, workdir: str, out: str, policy: str = "theta") -> dict:
  """Writes `policy` of the newest good checkpoint to `out` (see the module docstring); returns
  what was written: {"step", "policy", "hf", "adapter" (LoRA only), "base" (LoRA on a base the
  run made)}."""
  from flax import nnx  # noqa: PLC0415
  from oapl_jax.policies import restore_adapters, restore_policy  # noqa: PLC0415
  from oapl_jax.models import build, lora, quant  # noqa: PLC0415
  from oapl_jax.models.hf import to_hf  # noqa: PLC0415

  lora_cfg = build.lora_of(config)
  written = {"policy": policy, "hf": out}
  if lora_cfg is None:
    step, weights, _, _, graphdef = restore_policy(config, workdir, policy)
  else:
    step, adapters, base, _, _, graphdef = restore_adapters(config, workdir, policy)
    written["adapter"] = os.path.join(out, "adapter")
    base_model = config.model.path
    if base_model is None:  # a base made in the run (random init, warm-up): exported beside, for PEFT
      written["base"] = base_model = os.path.abspath(os.path.join(out, "base"))
      to_hf(nnx.merge(graphdef, quant.dequantized(base, config.model.dtype)), base_model)  # model.base_quant: as the run read it
    lora.to_peft(adapters, lora_cfg, written["adapter"], base_model=base_model)
    weights = lora.merged(base, adapters, lora_cfg.scale)  # what the run's engines sample
  to_hf(nnx.merge(graphdef, weights), out, source_dir=config.model.path)
  return {"step": step, **written}


def main(argv):
  del argv
  config = config_lib.command_config(_CONFIG)  # before the workdir is touched
  config = checked(config, _WORKDIR.value)
  check_output_folder("out", _OUT.value)  # before the checkpoint is read (and a base warmed up)
  print(json.dumps(export_checkpoint(config, _WORKDIR.value, _OUT.value, _POLICY.value), indent=2))


if __name__ == "__main__":
  errors.run_command(main)
