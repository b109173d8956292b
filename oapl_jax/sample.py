"""A sampler job beside a remote-mode trainer (`rl.mode="remote"`; docs/remote.md).

  python -m oapl_jax.main   --config=configs/tiny.py --config.rl.mode=remote --workdir=/tmp/oapl_remote &
  python -m oapl_jax.sample --config=configs/tiny.py --config.rl.mode=remote --workdir=/tmp/oapl_remote

Give it the trainer's config (every override too) and --workdir (a local or shared folder, or
a bucket URL). It runs on this machine's devices (`sampling.engines` x `sampling.tensor`), any
number of such jobs at once, each free to start and stop: it samples the rollouts the trainer
will take next with the pi_old the trainer published (oapl_jax/rl/remote.py), and stops when
the trainer's run is done. A refused setting, or settings that cannot serve the trainer of the
workdir (its status names the ones that must agree), is one line on stderr and exit code 2, as is
a workdir where no trainer starts within --wait_for_trainer_s; SIGTERM or Ctrl-C gives the rollout
being sampled back (its claim released) and exits 128 + the signal number.

`--dry_run` prints the job's memory plan on its own topology (its engines only) and exits, 0
if it fits; `--dry_run=compile` compiles its prefill and decode programs too (a TPU slice:
libtpu, as for the trainer's):

  python -m oapl_jax.sample --config=configs/math.py --config.rl.mode=remote \
      --config.rl.window_rollouts=1 --config.mesh.topology=v6e-8 --config.sampling.tensor=4 \
      --config.sampling.engines=2 --dry_run
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors, placement  # noqa: E402
from oapl_jax.dry_run_flag import define as define_dry_run  # noqa: E402
from oapl_jax.topology import LOCAL  # noqa: E402
from oapl_jax.workdir import StopSignals  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The trainer's --workdir.")
_MAX_ROLLOUTS = flags.DEFINE_integer("max_rollouts", None, "Stop after writing this many rollouts.")
_MAX_IDLE_S = flags.DEFINE_float("max_idle_s", 3600.0, "Stop after this long with nothing to sample.")
_WAIT_FOR_TRAINER_S = flags.DEFINE_float(
    "wait_for_trainer_s", 600.0, "On a workdir where no trainer has started (no run.lock, "
    "remote/trainer.json or snapshot; said at once), exit with an error after this long (docs/remote.md).")
_DRY_RUN = define_dry_run(
    "Print the sampler job's memory plan per device (its engines only; config.mesh.topology, "
    "e.g. v6e-8, else this machine's devices) and exit: 0 if it fits. --dry_run=compile: "
    "compile its prefill and decode programs for that topology and print XLA's bytes.")
flags.mark_flags_as_required(["config"])


def dry_run(config) -> None:
  """Prints the sampler job's plan (and compiled programs); PlanError (one line) if they do not fit."""
  from oapl_jax import aot  # noqa: PLC0415
  if config.mesh.topology in (None, LOCAL):
    placement.request_host_devices(placement.engine_device_count(config))
  aot.dry_run(config, _DRY_RUN.value, sampler_job=True)


def main(argv):
  del argv
  config = config_lib.command_config(_CONFIG, dry_run=bool(_DRY_RUN.value))
  if config.rl.mode != "remote":
    raise errors.ConfigError(f"config.rl.mode={config.rl.mode!r}: a sampler job serves a trainer "
                             "with rl.mode='remote' (give it the trainer's settings)")
  if _DRY_RUN.value:
    return dry_run(config)
  if not _WORKDIR.value:
    raise errors.UserError("--workdir: give the trainer's --workdir (a sampler job reads its snapshots and "
                           "writes rollouts there)")
  placement.request_host_devices(placement.engine_device_count(config))
  from oapl_jax.rl.sampler_job import SamplerJob  # noqa: PLC0415 (after validation: JAX starts here)
  # SIGTERM / Ctrl-C raise (`Interrupted`: one line, exit 128 + the signal number), so the claim
  # of the rollout being sampled is released on the way out (remote.holding) instead of waiting
  # for another sampler to find its process gone
  with StopSignals():
    job = SamplerJob(config, _WORKDIR.value)
    print(json.dumps(job.serve(max_rollouts=_MAX_ROLLOUTS.value, max_idle_s=_MAX_IDLE_S.value,
                               wait_for_trainer_s=_WAIT_FOR_TRAINER_S.value)))


if __name__ == "__main__":
  errors.run_command(main)
