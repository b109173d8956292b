"""Where a run's training rollouts come from, chosen once from `rl.mode` (`SOURCES`).

A source hands the loop its next rollout (`next`), given `make_job`: a function that fixes the
next rollout's index, weights and stamps at the moment it is called (so the loop decides what
is sampled and when) and returns the job that samples it. Sources differ in when jobs run:

* `SyncSource` ("sync"): the job runs here and now, while the trainer waits.
* `AsyncSource` ("async"): the job for the next rollout is launched the moment the previous
  one is taken, and samples in a background thread while the trainer trains; a checkpoint
  holds it (`pending`, `resume`).

An `offline` source (stored answers) would be a third class here, not a branch in the loop.
"""

from __future__ import annotations

import dataclasses
from concurrent import futures
from typing import Callable

from oapl_jax.rl.buffer import Rows


@dataclasses.dataclass
class Drawn:
  """One rollout's training rows, stamped with the weights that sampled them (`buffer.stamp`)."""

  rows: Rows
  answer_tokens: int  # answer tokens generated


Job = Callable[[], Drawn]


class SyncSource:
  """Samples when the loop asks, while the trainer waits."""

  overlaps_training = False  # the trainer waits for sampling: a sampling rate can be measured
  empties_buffer_at_refresh = True  # Algorithm 1: each window trains on its own pi_old's groups

  def next(self, make_job: Callable[[], Job]) -> Drawn:
    return make_job()()

  def pending(self) -> Drawn | None:
    """The rollout in flight (waited for), for checkpoints; sync mode has none."""
    return None

  def resume(self, drawn: Drawn | None) -> None:
    if drawn is not None:
      raise ValueError("a sync run has no rollout in flight to resume")

  def wait(self) -> None:
    """Waits for the rollout in flight, if any (before the engines sample anything else)."""

  def close(self) -> None:
    pass


class AsyncSource:
  """Samples the next rollout in a background thread while the trainer trains."""

  overlaps_training = True  # the trainer's wait is only the part of sampling not overlapped
  empties_buffer_at_refresh = False  # stale groups are used (oapl.md), unless rl.max_lag drops them

  def __init__(self):
    self._pool = futures.ThreadPoolExecutor(1, "rollout")
    self._inflight: futures.Future | None = None  # launched and not yet taken

  def next(self, make_job: Callable[[], Job]) -> Drawn:
    # The next rollout starts now, with the weights of this moment (a fixed point of the step
    # sequence, so runs stay reproducible); it lands at a later step, maybe after a refresh,
    # and is used then with its own stamps.
    drawn = (self._inflight or self._pool.submit(make_job())).result()
    self._inflight = self._pool.submit(make_job())
    return drawn

  def pending(self) -> Drawn | None:
    return None if self._inflight is None else self._inflight.result()

  def resume(self, drawn: Drawn | None) -> None:
    self._inflight = None
    if drawn is not None:
      self._inflight = futures.Future()
      self._inflight.set_result(drawn)

  def wait(self) -> None:
    if self._inflight is not None:
      self._inflight.result()

  def close(self) -> None:
    """Waits for the rollout in flight and stops the thread."""
    self.wait()
    self._pool.shutdown()


SOURCES = {"sync": SyncSource, "async": AsyncSource}  # rl.mode -> source class
