"""Where a trainer step's time goes: its parts in seconds, the engines' slot use, throughput per
device and MFU (issue 42). `train.py` and `rl/loop.py` time the parts; this module holds the
arithmetic and the devices' peak FLOP/s.

A step, as logged (`metrics.jsonl`, TensorBoard), is the wall time from the previous step's
metrics to this one's (`step_seconds`), and its parts, which do not overlap:

    seconds_waiting     taking rollouts into the buffer: in sync mode the engines sampling and
                        the rewards being scored while the trainer waits; with overlapped
                        sampling (async) only the wait for the rollout in flight
    seconds_training    the jitted train step, to its metrics on the host
    seconds_refreshing  pi_old <- pi_theta (and the engines' copy) at a refresh
    seconds_evaluating  a held-out evaluation during the run
    seconds_saving      the blocking part of the checkpoint written after the previous step
                        (the files are written in the background)
    seconds_profiling   starting and stopping a `log.profile_steps` trace (0 at other steps)

Their sum is within a few milliseconds of `step_seconds` (bookkeeping and the metrics line).
Of the rollouts taken at the step: `seconds_sampling` (the engines' decode and prefill) and
`seconds_rewards` (scoring the answers), inside the wait in sync mode, in the background with
async sampling; `slot_utilisation` (answer tokens produced / decode slot-steps computed);
`answer_tokens_per_s_per_device` (over the engines' devices and `seconds_sampling`).
Of the train step: `train_tokens_per_s_per_device` (the batch's positions, rows x (seq_len - 1),
padding included, over the trainer's devices and `seconds_training`), `flops_per_s_per_device`
(the useful FLOPs of `aot.model_flops`, what the step computes, over `seconds_training` x
devices: achieved, on any device) and `mfu` (that over the device's peak).

The peak: the published dense bf16 figure of a known TPU or GPU (`topology.CHIPS`, by JAX's
`device_kind`), or `log.peak_flops` when given; none for a CPU or an accelerator not in the
table, which then log no `mfu` (a CPU has no published figure, and a matmul timed on a shared
machine is no peak: runs logged MFU above 1 against one).
"""

from __future__ import annotations

import time

PARTS = ("seconds_waiting", "seconds_training", "seconds_refreshing", "seconds_evaluating",
         "seconds_saving", "seconds_profiling")  # a step's disjoint parts (their sum ~ step_seconds)
# Every metric that measures wall time (the rest of a run's metrics repeat exactly when it does).
TIMED = PARTS + ("step_seconds", "train_seconds", "sample_wait_seconds", "sample_tokens_per_s",
                 "seconds_sampling", "seconds_rewards", "answer_tokens_per_s_per_device",
                 "train_tokens_per_s_per_device", "flops_per_s_per_device", "mfu")


def device_peak(device, override: float | None = None) -> tuple[float | None, str]:
  """(peak FLOP/s of one `device`, where the figure comes from): `override` (log.peak_flops),
  else the published dense bf16 figure of its chip (`topology.chip_of`); (None, why) for a CPU
  or an accelerator with no published figure here (the run then logs no MFU, only its achieved
  FLOP/s per device)."""
  from oapl_jax.topology import chip_of  # noqa: PLC0415
  if override is not None:
    return float(override), "log.peak_flops"
  chip = chip_of(device.device_kind)
  if chip is not None:
    return chip[1], f"{chip[0]}, published dense bf16"
  if device.platform == "cpu":
    return None, "CPU: no published peak, so no MFU (flops_per_s_per_device is logged)"
  return None, f"no published peak for {device.device_kind!r} here: no MFU logged; give log.peak_flops"


def rollout_rates(*, answer_tokens: int, seconds_sampling: float, engine_devices: int,
                  live_slot_steps: int, slot_steps: int) -> dict[str, float]:
  """The rollouts' throughput per engine device and slot utilisation ({} without a rollout)."""
  if slot_steps <= 0:
    return {}
  return {"slot_utilisation": live_slot_steps / slot_steps,
          "answer_tokens_per_s_per_device": answer_tokens / max(seconds_sampling, 1e-9) / engine_devices}


def train_rates(*, positions: int, seconds_training: float, devices: int, useful_flops: float,
                peak_flops: float | None) -> dict[str, float]:
  """The train step's tokens and achieved useful FLOPs per second per device, and its MFU
  (left out without a peak); no FLOP rate without a FLOP count."""
  seconds = max(seconds_training, 1e-9)
  out = {"train_tokens_per_s_per_device": positions / seconds / devices}
  if useful_flops:
    out["flops_per_s_per_device"] = useful_flops / seconds / devices
    if peak_flops:
      out["mfu"] = out["flops_per_s_per_device"] / peak_flops
  return out


class Profiler:
  """A `jax.profiler` trace of trainer steps a..b (`log.profile_steps` "a:b", 1-based, inclusive)
  into `<workdir>/profile`: TensorBoard's profile plugin (`tensorboard --logdir <workdir>`), XProf
  and Perfetto read it. Each process writes its own host's file (`plugins/profile/<run>/<host>.*`;
  with several processes under `profile/process_<i>/`).
  A bucket workdir: traced into a local folder, then uploaded there at the end of step b.
  `steps` None: does nothing."""

  def __init__(self, steps: tuple[int, int] | None, workdir: str):
    self.steps, self.workdir, self._local, self.written = steps, workdir, None, []

  def before_step(self, step: int) -> float:
    """Called before trainer step `step` (1-based) runs: starts the trace at step a; returns the
    seconds that took (0 at other steps)."""
    if self.steps is None or step != self.steps[0]:
      return 0.0
    t0 = time.perf_counter()
    import tempfile  # noqa: PLC0415
    import jax  # noqa: PLC0415
    from oapl_jax import storage  # noqa: PLC0415
    target = self._target()
    self._local = tempfile.mkdtemp(prefix="oapl_profile_") if storage.is_remote(target) else target
    jax.profiler.start_trace(self._local)
    return time.perf_counter() - t0

  def after_step(self, step: int) -> list[str]:
    """Called after trainer step `step`: stops the trace at step b; returns the files written."""
    if self._local is None or step != self.steps[1]:
      return []
    import os  # noqa: PLC0415
    import jax  # noqa: PLC0415
    from oapl_jax import storage  # noqa: PLC0415
    jax.profiler.stop_trace()
    local, self._local = self._local, None
    target = self._target()
    for root, _, files in os.walk(local):
      for name in files:
        path = os.path.join(root, name)
        rel = os.path.relpath(path, local).replace(os.sep, "/")
        if storage.is_remote(target):
          storage.upload(path, storage.join(target, *rel.split("/")))
        self.written.append(storage.join(target, *rel.split("/")))
    return self.written

  def _target(self) -> str:
    """<workdir>/profile; with several processes <workdir>/profile/process_<i> (processes on
    one machine share a host name, which names the trace files)."""
    import jax  # noqa: PLC0415
    from oapl_jax import storage  # noqa: PLC0415
    target = storage.join(self.workdir, "profile")
    return target if jax.process_count() == 1 else storage.join(target, f"process_{jax.process_index()}")

  def close(self) -> None:
    """Stops a trace still running (the run ended or stopped inside the range), keeping it."""
    if self._local is not None:
      self.after_step(self.steps[1])
