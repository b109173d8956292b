"""Write an offline file: G answers to each of `rl.offline.problems` training problems.

  python -m oapl_jax.generate --config=configs/tiny.py --out=/tmp/round1.npz \\
      --config.warmup.cache_dir=/tmp/oapl_warmup
  python -m oapl_jax.generate --config=configs/tiny.py --out=/tmp/step200.npz \\
      --workdir=/tmp/oapl_tiny --policy=theta

The answers are sampled by the engines, with their log-probs, finish reasons, rewards and
version stamps, exactly as a run with `rl.mode=offline` and no `rl.offline.path` samples its
round 1 (same problems, same keys; `oapl_jax/rl/offline.py` has the format). The policy:

* without --workdir, the config's base: the weights a run of this config starts RL from
  (`model.path`, or a random init, after the supervised warm-up of the addition task; with
  `warmup.cache_dir` set the warm-up is read from, or written to, the cache the run uses);
* with --workdir, the newest good checkpoint there: its pi_theta (--policy=theta) or its
  engines' snapshot pi_old (--policy=snapshot); under model.lora, the frozen base merged with
  those adapters, and the header's `policy.adapters` says which (settings, sha256, the base's
  path and sha256).

A run trains on the file (`--config.rl.mode=offline --config.rl.offline.path=FILE`) only if its
pi_old is the policy that wrote it (checked by rescoring rows): in practice, a file of the base,
for a run of the same config. A refused setting or a workdir without a checkpoint is one line
on stderr and exit code 2 (`--verbose` for the traceback).
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors, placement  # noqa: E402
from oapl_jax.run_config import check_cache_dir, checked  # noqa: E402
from oapl_jax.workdir import check_output_file  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_OUT = flags.DEFINE_string("out", None, "The file to write (.npz).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Sample with this run's newest checkpoint; "
                               "unset: the config's base model.")
_POLICY = flags.DEFINE_enum("policy", "theta", ["theta", "snapshot"], "With --workdir: the "
                            "checkpoint's pi_theta or its engines' snapshot pi_old.")
flags.mark_flags_as_required(["config", "out"])


def base_policy(config):
  """(params, graphdef, model_cfg, task, tokenizer, policy record) of the config's base: under
  model.lora the frozen base as the run makes it (`policies.frozen_base`; model.base_quant's
  int8 read back as model.dtype), which is the run's pi_old before its adapters move."""
  from oapl_jax import warmup  # noqa: PLC0415 (after validation: TensorFlow logs)
  from oapl_jax.models import build  # noqa: PLC0415
  from oapl_jax.models.build import init_model  # noqa: PLC0415
  from oapl_jax.placement import seq_len  # noqa: PLC0415
  from oapl_jax.tasks import make_task  # noqa: PLC0415
  task, tokenizer = make_task(config)
  source = f"base ({config.model.path or 'random init, seed %d' % config.seed})"
  if config.warmup.steps:
    source = f"base (warm-up of {config.warmup.steps} steps, seed {config.seed})"
  if config.model.lora.get("rank"):  # a LoRA run's first pi_old: its frozen base as the run makes it
    from oapl_jax.models import quant  # noqa: PLC0415
    from oapl_jax.policies import frozen_base  # noqa: PLC0415
    graphdef, base = frozen_base(config)
    model_cfg = build.ModelConfig.from_config(config.model)
    quantized = config.model.get("base_quant", "none")
    if quantized != "none":
      source = source[:-1] + f", {quantized})"
    return (quant.dequantized(base, config.model.dtype), graphdef, model_cfg, task, tokenizer,
            {"version": 0, "snapshot_step": 0, "source": source})
  model_cfg, graphdef, params = init_model(config)
  if config.warmup.steps:
    params, _ = warmup.base_model(config, graphdef, params, task, tokenizer, seq_len=seq_len(config))
  return params, graphdef, model_cfg, task, tokenizer, {"version": 0, "snapshot_step": 0, "source": source}


def checkpoint_policy(config, workdir: str, policy: str):
  """The same of the newest good checkpoint in `workdir` (`policy`: "theta" or "snapshot").
  Under model.lora the weights are the frozen base merged with the checkpoint's adapters, and
  the record names them: {"adapters": {rank, alpha, targets, param_dtype, "sha256" of the
  adapters as the checkpoint holds them (`checkpoint.tree_digest`), "base": {path, sha256}}}."""
  from oapl_jax import checkpoint  # noqa: PLC0415
  from oapl_jax.models import build, lora as lora_lib  # noqa: PLC0415
  from oapl_jax.policies import restore_adapters, restore_policy  # noqa: PLC0415
  from oapl_jax.tasks import make_task  # noqa: PLC0415
  task, tokenizer = make_task(config)
  lora = build.lora_of(config)
  if lora is None:
    step, params, meta, model_cfg, graphdef = restore_policy(config, workdir, policy)
  else:
    step, adapters, base, meta, model_cfg, graphdef = restore_adapters(config, workdir, policy)
    params = lora_lib.merged(base, adapters, lora.scale)  # what the run's engines sample
  c = meta["counters"]
  # pi_theta at step S is the snapshot a refresh at S would take (version + 1 unless just refreshed).
  version, snap_step = ((c["version"], c["snapshot_step"]) if policy == "snapshot" or c["snapshot_step"] == step
                        else (c["version"] + 1, step))
  what = "pi_theta" if policy == "theta" else "pi_old"
  record = {"version": version, "snapshot_step": snap_step, "source": f"{what} of {workdir} at step {step}"}
  if lora is not None:
    record["adapters"] = {**lora.record(), "sha256": checkpoint.tree_digest(adapters),
                          "base": checkpoint.base_record(config, base)}
    record["source"] = f"{what} (adapters, rank {lora.rank}) of {workdir} at step {step}"
  return params, graphdef, model_cfg, task, tokenizer, record


def generate(config, out: str, workdir: str | None = None, policy: str = "theta") -> dict:
  """Writes the file `out`; returns what it holds (groups, answers, reward mean, seconds)."""
  import jax  # noqa: PLC0415
  from oapl_jax.rl import offline  # noqa: PLC0415
  from oapl_jax.sampling import SamplingParams  # noqa: PLC0415
  from oapl_jax.sampling.sampler import Sampler, make_replicas  # noqa: PLC0415
  placement.request_host_devices(placement.engine_device_count(config))
  params, graphdef, model_cfg, task, tokenizer, record = (
      checkpoint_policy(config, workdir, policy) if workdir else base_policy(config))
  replicas = make_replicas(config, model_cfg, graphdef, SamplingParams.from_config(config.sampling))
  sampler = Sampler(replicas, task, tokenizer, max_new_tokens=config.sampling.max_new_tokens)
  weights = sampler.load(jax.tree.map(lambda x: x.astype(config.model.dtype), params), record["version"])
  t0 = time.perf_counter()
  header, arrays, tokens = offline.sample_round(
      config, sampler, weights, offline.round_one_problems(config, task), round_index=0,
      policy=record, model_meta=model_cfg.architecture())
  offline.write(out, header, arrays)
  return {"out": out, "policy": record["source"], "groups": len(header["problems"]),
          "answers": int(len(arrays["rewards"])), "answer_tokens": tokens,
          "reward_mean": round(float(arrays["rewards"].mean()), 4),
          "seconds": round(time.perf_counter() - t0, 1)}


def main(argv):
  del argv
  config = config_lib.command_config(_CONFIG)
  config = checked(config, _WORKDIR.value) if _WORKDIR.value else config
  check_output_file("out", _OUT.value)  # before the engines sample (minutes)
  check_cache_dir(config)
  print(json.dumps(generate(config, _OUT.value, _WORKDIR.value, _POLICY.value), indent=2))


if __name__ == "__main__":
  errors.run_command(main)
