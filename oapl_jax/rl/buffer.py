"""Answer rows and the replay buffer of the lagged loop: whole groups, each stamped.

Rows are answers; groups of `group_size` consecutive rows share a prompt. Every row carries
`version` (how many engine refreshes preceded it) and `snapshot_step` (the trainer step at
which the engine's weights were copied), so the realised lag of a row used at trainer step
`s` is `s - snapshot_step`. In sync mode the loop empties the buffer at every refresh, so all
groups in it come from one pi_old; in async mode nothing is emptied: left-over groups and a
rollout in flight at the refresh are used after it (each group still comes from one pi_old,
and carries its stamps), unless `rl.max_lag` drops them (`drop_older_than`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Rows:
  """Answers laid out for the trainer (host numpy arrays; N rows, T = prompt + answer length).

  A row is `prompt + answer + padding` from position 0 (the positions the engine used);
  targets are `tokens[:, 1:]`.
  """

  tokens: np.ndarray  # [N, T] int32
  mask: np.ndarray  # [N, T-1] float32: 1 on answer targets that count in the loss
  sampler_logprobs: np.ndarray  # [N, T-1] float32: the engine's log-probs of those targets, 0 elsewhere
  rewards: np.ndarray  # [N] float32
  answer_lengths: np.ndarray  # [N] answer tokens (EOS included)
  version: np.ndarray  # [N] int32: policy version of the weights that sampled the row
  snapshot_step: np.ndarray  # [N] int32: trainer step at which those weights were copied

  def __len__(self) -> int:
    return len(self.rewards)

  def select(self, index) -> "Rows":
    """The rows at `index` (a slice or a boolean / integer array)."""
    return Rows(**{k: v[index] for k, v in self.as_dict().items()})

  def as_dict(self) -> dict[str, np.ndarray]:
    """Field name -> array (the layout checkpoints store)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_dict(cls, arrays: dict) -> "Rows":
    return cls(**{f.name: np.asarray(arrays[f.name]) for f in dataclasses.fields(cls)})

  @classmethod
  def concat(cls, parts: list["Rows"]) -> "Rows":
    return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                  for f in dataclasses.fields(cls)})


def stamp(rows: Rows, *, version: int, snapshot_step: int) -> Rows:
  """`rows` with every row stamped: the policy version and snapshot step of the weights that
  sampled it."""
  n = len(rows)
  return dataclasses.replace(rows, version=np.full((n,), version, np.int32),
                             snapshot_step=np.full((n,), snapshot_step, np.int32))


class GroupBuffer:
  """FIFO of answer groups; `extend` appends stamped rows, `take` pops the oldest groups."""

  def __init__(self, group_size: int):
    self.group_size = group_size
    self._rows: Rows | None = None

  def __len__(self) -> int:
    """Number of groups held."""
    return 0 if self._rows is None else len(self._rows) // self.group_size

  def extend(self, stamped: Rows) -> None:
    """Appends rows that already carry their stamps (from `stamp`)."""
    if len(stamped) % self.group_size:
      raise ValueError(f"{len(stamped)} rows is not a whole number of groups of {self.group_size}")
    self._rows = stamped if self._rows is None else Rows.concat([self._rows, stamped])

  def take(self, num_groups: int) -> Rows:
    """Pops the oldest `num_groups` groups."""
    if num_groups > len(self):
      raise ValueError(f"asked for {num_groups} groups, buffer holds {len(self)}")
    n = num_groups * self.group_size
    out, rest = self._rows.select(slice(None, n)), self._rows.select(slice(n, None))
    self._rows = rest if len(rest) else None
    return out

  def drop_older_than(self, min_snapshot_step: int) -> int:
    """Drops the groups sampled by a snapshot older than `min_snapshot_step`; returns how many."""
    if self._rows is None:
      return 0
    keep = self._rows.snapshot_step[::self.group_size] >= min_snapshot_step  # [groups]
    dropped = int((~keep).sum())
    if dropped:
      self._rows = self._rows.select(np.repeat(keep, self.group_size)) if keep.any() else None
    return dropped

  def clear(self) -> int:
    """Empties the buffer; returns the number of groups dropped."""
    dropped = len(self)
    self._rows = None
    return dropped

  def state(self) -> dict[str, np.ndarray]:
    """Contents as arrays (for checkpoints); empty dict when empty."""
    return {} if self._rows is None else self._rows.as_dict()

  def load(self, arrays: dict[str, np.ndarray]) -> None:
    self._rows = Rows.from_dict(arrays) if arrays else None
