"""The replay buffer of the lagged loop: whole groups, each stamped with its policy version.

Rows are answers; groups of `group_size` consecutive rows share a prompt. Every row carries
`version` (how many engine refreshes preceded it) and `snapshot_step` (the trainer step at
which the engine's weights were copied), so the realised lag of a row used at trainer step
`s` is `s - snapshot_step`. In sync mode the loop empties the buffer at every refresh, so all
groups in it come from one pi_old; in async mode nothing is emptied: left-over groups and a
rollout in flight at the refresh are used after it (each group still comes from one pi_old,
and carries its stamps), unless `rl.max_lag` drops them (`drop_older_than`).
"""

from __future__ import annotations

import numpy as np


def stamp(batch: dict[str, np.ndarray], *, version: int, snapshot_step: int) -> dict[str, np.ndarray]:
  """`batch` with every row stamped: the policy version and snapshot step of the weights that
  sampled it."""
  n = len(batch["rewards"])
  return {**batch, "version": np.full((n,), version, np.int32),
          "snapshot_step": np.full((n,), snapshot_step, np.int32)}


class GroupBuffer:
  """FIFO of answer groups; `extend` appends stamped rows (from `stamp`), `take` pops."""

  def __init__(self, group_size: int):
    self.group_size = group_size
    self._rows: dict[str, np.ndarray] | None = None

  def __len__(self) -> int:
    """Number of groups held."""
    return 0 if self._rows is None else len(self._rows["rewards"]) // self.group_size

  def extend(self, stamped: dict[str, np.ndarray]) -> None:
    """Appends rows that already carry their stamps (from `stamp`)."""
    n = len(stamped["rewards"])
    if n % self.group_size:
      raise ValueError(f"{n} rows is not a whole number of groups of {self.group_size}")
    if self._rows is None:
      self._rows = stamped
    else:
      self._rows = {k: np.concatenate([self._rows[k], v]) for k, v in stamped.items()}

  def take(self, num_groups: int) -> dict[str, np.ndarray]:
    """Pops the oldest `num_groups` groups."""
    if num_groups > len(self):
      raise ValueError(f"asked for {num_groups} groups, buffer holds {len(self)}")
    n = num_groups * self.group_size
    out = {k: v[:n] for k, v in self._rows.items()}
    rest = {k: v[n:] for k, v in self._rows.items()}
    self._rows = rest if len(rest["rewards"]) else None
    return out

  def drop_older_than(self, min_snapshot_step: int) -> int:
    """Drops the groups sampled by a snapshot older than `min_snapshot_step`; returns how many."""
    if self._rows is None:
      return 0
    keep = self._rows["snapshot_step"][::self.group_size] >= min_snapshot_step  # [groups]
    dropped = int((~keep).sum())
    if dropped:
      rows = np.repeat(keep, self.group_size)
      self._rows = {k: v[rows] for k, v in self._rows.items()} if keep.any() else None
    return dropped

  def clear(self) -> int:
    """Empties the buffer; returns the number of groups dropped."""
    dropped = len(self)
    self._rows = None
    return dropped

  def state(self) -> dict[str, np.ndarray]:
    """Contents as arrays (for checkpoints); empty dict when empty."""
    return {} if self._rows is None else dict(self._rows)

  def load(self, rows: dict[str, np.ndarray]) -> None:
    self._rows = {k: np.asarray(v) for k, v in rows.items()} if rows else None
