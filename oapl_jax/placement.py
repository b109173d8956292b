"""Where a run's work happens: the facts the run and the memory planner both read.

JAX-free (a config and device counts in; counts and device indices out), so that the run
(`rl/loop.py`, `sampling/sampler.py`) and `--dry_run` (`plan.py`) cannot describe two
different runs:

* rows: a row is a prompt and its answer, `seq_len` tokens (the KV cache's and the trainer's
  length).
* engines: `sampling.engines` engine replicas over ALL processes, each on `sampling.tensor`
  devices of one process; a process runs `engines / processes` of them (`local_engines`), and
  each engine decodes `sampling.max_slots / sampling.engines` answers at once (`engine_slots`).
* devices (`split_devices`, one process's local devices): when sampling takes turns with
  training (rl.mode "sync", "offline") the trainer uses every device and the engines the
  first local ones; when it overlaps training ("async", one process only) the engines take the
  last local devices and the trainer the others, or, with no device left over, they share
  device 0 with the trainer.

On a CPU host the engines want a host device each: `request_host_devices(devices_wanted(c))`
asks JAX for them before its backends start.
"""

from __future__ import annotations

import dataclasses
import os

from oapl_jax.errors import ConfigError

OVERLAPPING_MODES = ("async",)  # rl.mode values whose sampling overlaps training


def seq_len(config) -> int:
  """Tokens of the longest row: prompt + answer (the KV cache's and the trainer's length)."""
  return config.sampling.max_prompt_len + config.sampling.max_new_tokens


def overlaps_training(config) -> bool:
  """Whether the engines sample while the trainer trains (on devices of their own)."""
  return config.rl.mode in OVERLAPPING_MODES


def local_engines(config, processes: int) -> int:
  """Engine replicas each of `processes` processes runs: sampling.engines / processes."""
  engines = config.sampling.engines
  if engines % processes:
    raise ConfigError(f"config.sampling.engines={engines}: the engine replicas over all processes "
                      f"must be a multiple of the {processes} processes (each runs as many)")
  return engines // processes


def engine_slots(config) -> int:
  """Answers one engine replica decodes at once: sampling.max_slots / sampling.engines."""
  return config.sampling.max_slots // config.sampling.engines


def engine_device_count(config, processes: int = 1) -> int:
  """Local devices one process's engines hold: its replicas x sampling.tensor."""
  return local_engines(config, processes) * config.sampling.tensor


def devices_wanted(config, processes: int = 1) -> int:
  """Local devices a process asks for: its engines', plus one for the trainer when sampling
  overlaps training."""
  return engine_device_count(config, processes) + overlaps_training(config)


@dataclasses.dataclass(frozen=True)
class Split:
  """One process's local devices, by index: the trainer's and the engines' (replica after
  replica, sampling.tensor consecutive devices each). shared: some device does both."""

  trainer: tuple[int, ...]
  engines: tuple[int, ...]
  shared: bool


def split_devices(config, devices: int, processes: int = 1) -> Split:
  """Which of a process's `devices` local devices train and which sample (module docstring).
  More engine devices than `devices` are not refused here: the engines' indices then run past
  the last device, and the caller says so (`parallel.Replicas`, `plan.make_plan`)."""
  n = engine_device_count(config, processes)
  if overlaps_training(config) and devices > n:
    return Split(tuple(range(devices - n)), tuple(range(devices - n, devices)), False)
  trainer = tuple(range(devices)) if not overlaps_training(config) else (0,)
  return Split(trainer, tuple(range(n)), True)


def request_host_devices(n: int) -> None:
  """Asks JAX for at least `n` CPU devices, if its backends have not started yet (else a no-op:
  `parallel.Replicas` then says how many devices there are). Leaves an explicit device count
  alone: `--xla_force_host_platform_device_count` in XLA_FLAGS, or JAX_NUM_CPU_DEVICES (as
  launch/local_multihost.sh gives each process)."""
  if (n <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
      or os.environ.get("JAX_NUM_CPU_DEVICES")):
    return
  import jax  # noqa: PLC0415 (this module is read without JAX: the planner's facts)
  if jax.config.jax_num_cpu_devices < n:
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already started
      pass
