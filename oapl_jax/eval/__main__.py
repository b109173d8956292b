"""pass@k of the latest checkpoint in a workdir.

  python -m oapl_jax.eval --config=configs/tiny.py --workdir=/tmp/oapl_tiny \
      [--config.eval.samples_per_problem=64] [--policy=snapshot]

Writes `<workdir>/eval_step<N>.json` and prints it. A refused setting (the same validation as
`oapl_jax.main`) or a workdir without a checkpoint is one line on stderr and exit code 2;
`--verbose` prints the traceback instead.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file of the run.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding checkpoints/.")
_POLICY = flags.DEFINE_enum("policy", "theta", ["theta", "snapshot"],
                            "Evaluate pi_theta (the trained weights) or the engine's snapshot pi_old.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = config_lib.from_flag(_CONFIG)
  config_lib.validate(config)  # before the workdir is touched
  from oapl_jax import train  # noqa: PLC0415 (after validation: its TensorFlow import logs on stderr)
  r = train.Run(config, _WORKDIR.value)
  if not r.restore_latest():
    raise errors.UserError(f"no checkpoint under {r.ckpt.directory}")
  params = r.params if _POLICY.value == "theta" else r.snapshot
  out = {"step": r.counters.step, "policy": _POLICY.value,
         **r.evaluate(params, f"step {r.counters.step}")}
  path = os.path.join(_WORKDIR.value, f"eval_step{r.counters.step}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=2)
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  errors.run_command(main)
