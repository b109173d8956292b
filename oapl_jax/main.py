"""Entry point: `python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/oapl_tiny`.

Any setting can be overridden: `--config.rl.lag=10 --config.seed=3`. A refused setting (or any
other error a user can cause, `oapl_jax.errors.UserError`) stops the command before any work
with one line on stderr and exit code 2; `--verbose` prints the traceback instead.

`--dry_run` prints the run's memory plan per device (oapl_jax/plan.py, docs/memory.md) and
exits: 0 if it fits the devices' memory, 2 with one line naming the setting to change if not.
It reads no weights or data files and needs no --workdir:

  python -m oapl_jax.main --config=configs/math.py --config.mesh.topology=v5p-64 --dry_run

`--dry_run=compile` also compiles every program of the run for that topology with the real
compiler (a TPU slice: libtpu, in a venv of its own; oapl_jax/aot.py) and prints XLA's bytes
per device beside the plan's, the compiled peak against the device, and a roofline; it exits
2 if the compiled run does not fit.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet TensorFlow where a TFDS source or JetStream loads it

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import distributed, errors, placement  # noqa: E402
from oapl_jax.dry_run_flag import define as define_dry_run  # noqa: E402
from oapl_jax.topology import LOCAL  # noqa: E402
from oapl_jax.workdir import Layout  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and summary.json go "
                                "(required unless --dry_run).")
_DRY_RUN = define_dry_run(
    "Print the memory plan per device (config.mesh.topology, else this machine's devices) and "
    "exit: 0 if it fits. --dry_run=compile: compile every program of the run for that topology "
    "(a TPU slice: needs libtpu) and print XLA's bytes per device beside the plan's.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = config_lib.command_config(_CONFIG, dry_run=bool(_DRY_RUN.value))  # once
  if _DRY_RUN.value:
    return dry_run(config)
  distributed.initialize(config.distributed)  # multi-host: before anything touches JAX
  # Imported once the config is valid: `train` imports JAX, Flax and orbax (seconds), and a
  # refused setting should not wait for them.
  from oapl_jax import train  # noqa: PLC0415
  try:
    summary = train.run_validated(config, _WORKDIR.value)
  except Exception as e:  # another process of a multi-host run went away: one line, out now
    lost = distributed.lost_process(e)
    if lost is None:
      raise
    print(f"error: {lost}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(distributed.LOST_PROCESS_EXIT)  # not JAX's shutdown barrier, which would wait for it
  if not distributed.is_writer():
    return
  keys = [k for k in summary["eval_after"] if k.startswith("pass@")]
  print(json.dumps({"pass@k before": {k: round(summary["eval_before"][k], 4) for k in keys},
                    "pass@k after": {k: round(summary["eval_after"][k], 4) for k in keys},
                    **({"tool_call_rate before, after": [round(summary[e]["tool_call_rate"], 4) for e in
                        ("eval_before", "eval_after")]} if "tool_call_rate" in summary["eval_after"] else {}),
                    "train_seconds": round(summary["train_seconds"], 1),
                    "samples_generated": summary["samples_generated"],
                    "trainer_steps": summary["trainer_steps"],
                    "steps_skipped": summary["steps_skipped"],  # non-finite loss or gradient: no update
                    "groups_dropped_stale": summary["groups_dropped_stale"],  # older than rl.max_lag
                    "summary": Layout(_WORKDIR.value).summary}, indent=2))


def dry_run(config) -> None:
  """Prints the plan (and the compiled programs); PlanError (one line, exit 2) if they do not fit."""
  from oapl_jax import aot  # noqa: PLC0415 (no TensorFlow, no weights)
  if config.mesh.topology in (None, LOCAL):  # this machine's devices, as many as the run would ask for
    placement.request_host_devices(placement.devices_wanted(
        config, distributed.processes_asked(config.distributed)))
  aot.dry_run(config, _DRY_RUN.value)


if __name__ == "__main__":
  errors.run_command(main)
