"""pass@k of the latest checkpoint in a workdir.

  python -m oapl_jax.evaluate --config=configs/tiny.py --workdir=/tmp/oapl_tiny \
      [--config.eval.samples_per_problem=64] [--policy=snapshot]

Loads the checkpoint's policy and engines, nothing else (no optimizer state, no trainer).
Writes `<workdir>/eval_step<N>.json` and prints it. A refused setting (the same validation as
`oapl_jax.main`) or a workdir without a checkpoint is one line on stderr and exit code 2;
`--verbose` prints the traceback instead.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors, placement  # noqa: E402
from oapl_jax.run_config import checked  # noqa: E402
from oapl_jax.workdir import Layout, check_writable  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file of the run.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding checkpoints/.")
_POLICY = flags.DEFINE_enum("policy", "theta", ["theta", "snapshot"],
                            "Evaluate pi_theta (the trained weights) or the engine's snapshot pi_old.")
flags.mark_flags_as_required(["config", "workdir"])


def evaluate_checkpoint(config, workdir: str, policy: str = "theta") -> dict:
  """pass@k of the newest good checkpoint's `policy` ("theta": pi_theta, "snapshot": pi_old).

  Reads only that policy's weights (not the optimizer or the buffer) into engines built from
  the config; the draws are the run's own evaluation draws (`evaluate.eval_key(seed)`).
  """
  import jax  # noqa: PLC0415
  from oapl_jax.policies import restore_policy  # noqa: PLC0415 (after validation: TensorFlow logs)
  from oapl_jax.eval.evaluate import eval_key, evaluate  # noqa: PLC0415
  from oapl_jax.sampling import SamplingParams  # noqa: PLC0415
  from oapl_jax.sampling.sampler import make_replicas, make_sampler  # noqa: PLC0415
  from oapl_jax.tasks import make_task  # noqa: PLC0415
  placement.request_host_devices(placement.engine_device_count(config))
  task, tokenizer = make_task(config)
  step, params, _, model_cfg, graphdef = restore_policy(config, workdir, policy)
  replicas = make_replicas(config, model_cfg, graphdef, SamplingParams.from_config(config.sampling))
  sampler = make_sampler(config, replicas, task, tokenizer)
  weights = jax.tree.map(lambda x: x.astype(config.model.dtype), params)  # as the engines compute
  out = evaluate(sampler, weights, samples_per_problem=config.eval.samples_per_problem,
                 key=eval_key(config.seed))
  return {"step": step, "policy": policy, **out}


def main(argv):
  del argv
  config = config_lib.command_config(_CONFIG)  # before the workdir is touched
  config = checked(config, _WORKDIR.value)  # another task or model than the run's: one line
  if os.path.isdir(_WORKDIR.value):
    check_writable(_WORKDIR.value)  # eval_step<N>.json goes there: checked before the evaluation
  out = evaluate_checkpoint(config, _WORKDIR.value, _POLICY.value)
  from oapl_jax.metrics import write_json  # noqa: PLC0415
  write_json(Layout(_WORKDIR.value).eval_step(out['step']), out)
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  errors.run_command(main)
