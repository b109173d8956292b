"""Packed rows: a step's answers back to back in rows of a fixed token budget (`train.packing`).

A padded row (`buffer.Rows`) is one prompt + answer from position 0, padded to `seq_len`
whatever the answer's length. A packed row holds several of them (each with its prompt) back
to back: `segment_ids` number them 1, 2, ... along the row (the padding after the last: one more),
`positions` restart at 0 in each segment (the positions the engine used), and attention never
crosses a segment (`models.attention.causal_attention(segment_ids=...)`). Only what the
trainer computes on changes; what the loss reads stays in the padded layout:

* the trainer's (and the snapshot's, the reference's) per-token log-probs are computed on the
  packed rows, then gathered back into the step's padded `[B, T-1]` layout (`unpack`), where
  the mask, the sampler's log-probs and the rewards already are. The loss functions
  (`rl/losses.py`) therefore run unchanged: `ell_i` sums answer i's tokens, and V_hat, the
  advantages and N are the step's (the rewards of all B answers are in every micro-batch;
  an answer counts only in the micro-batch that holds it, `member`).
* Rows are filled by first-fit decreasing (`pack`): answers sorted by length (longest first,
  ties by index: deterministic), each put in the first row with room. A group's answers may
  land in different rows and micro-batches.
* Compiled shapes stay fixed: a step is `max_micro_batches(...)` micro-batches of `rows`
  packed rows of `budget` tokens, enough for the worst case (every answer at full length);
  the micro-batches a step's answers do not fill are marked inactive and skipped inside the
  compiled step (`lax.cond`), so no step recompiles, however long its answers.

An answer with no counted token (cut at the length limit under `rl.count_truncated=False`)
enters no loss term and no metric but its group's V_hat (through its reward, in the padded
layout): it is not packed at all.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from oapl_jax.rl.buffer import Rows


@dataclasses.dataclass
class Packed:
  """One step's packed micro-batches (host NumPy). K micro-batches of R rows of S tokens; B
  answers; T the padded row length (`seq_len`)."""

  tokens: np.ndarray  # [K, R, S] int32: segments back to back, then pad_id
  positions: np.ndarray  # [K, R, S] int32: 0.. within each segment, 0 on padding
  segment_ids: np.ndarray  # [K, R, S] int32: 1.. per segment along a row, the padding after them one more
  answer_row: np.ndarray  # [K, B] int32: the row of micro-batch k holding answer i (0 if not there)
  answer_start: np.ndarray  # [K, B] int32: where answer i's segment starts in that row
  member: np.ndarray  # [K, B] float32: 1 where micro-batch k holds answer i
  active: np.ndarray  # [K] bool: micro-batches holding at least one answer
  rows_filled: int  # packed rows holding at least one answer
  real_tokens: int  # prompt + answer tokens packed


def used_lengths(rows: Rows) -> np.ndarray:
  """`[N]` tokens of each padded row the trainer needs: prompt + answer (the last counted
  target's position + 2), 0 for a row with no counted target (it enters no loss term)."""
  counted = rows.mask > 0  # [N, T-1]
  last = counted.shape[1] - 1 - np.argmax(counted[:, ::-1], axis=1)  # [N] last counted target
  return np.where(counted.any(axis=1), last + 2, 0).astype(np.int64)


def max_micro_batches(num_answers: int, seq_len: int, *, rows: int, budget: int) -> int:
  """The most micro-batches of `rows` rows x `budget` tokens a step of `num_answers` answers of
  at most `seq_len` tokens can fill under first-fit: a new row opens only when no open row has
  room for an answer (<= seq_len tokens), so every row but the last holds at least
  floor(budget / seq_len) answers."""
  if budget < seq_len:
    raise ValueError(f"budget={budget} < seq_len={seq_len}: the longest answer would not fit a row")
  per_row = budget // seq_len
  return math.ceil(math.ceil(num_answers / per_row) / rows)


def first_fit_decreasing(lengths: np.ndarray, budget: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """(row [N], start [N]) of each length in rows of `budget` tokens, first-fit decreasing:
  longest first (ties by index), each into the first row with room; -1 for length 0 (not
  placed). Raises ValueError if `num_rows` rows do not hold them all."""
  order = np.argsort(-lengths, kind="stable")  # [N]
  fill = np.zeros(num_rows, np.int64)  # [num_rows] tokens used per row
  row = np.full(lengths.shape, -1, np.int64)
  start = np.zeros(lengths.shape, np.int64)
  for i in order:
    n = lengths[i]
    if n == 0:
      continue
    fits = np.flatnonzero(fill + n <= budget)
    if not fits.size:
      raise ValueError(f"{int((lengths > 0).sum())} answers do not fit {num_rows} rows of {budget} tokens")
    r = fits[0]
    row[i], start[i] = r, fill[r]
    fill[r] += n
  return row, start


def pack(rows: Rows, *, rows_per_micro: int, budget: int, micro_batches: int, pad_id: int = 0) -> Packed:
  """The step's answers (`rows`, the padded layout) packed into `micro_batches` micro-batches
  of `rows_per_micro` rows of `budget` tokens (first-fit decreasing; see the module docstring)."""
  n = len(rows)
  lengths = used_lengths(rows)  # [N]
  k, r, s = micro_batches, rows_per_micro, budget
  row, start = first_fit_decreasing(lengths, s, k * r)  # global row over k * r rows
  tokens = np.full((k * r, s), pad_id, np.int32)
  positions = np.zeros((k * r, s), np.int32)
  segment_ids = np.zeros((k * r, s), np.int32)
  segments = np.zeros(k * r, np.int32)  # segments placed per row so far
  answer_row = np.zeros((k, n), np.int32)
  answer_start = np.zeros((k, n), np.int32)
  member = np.zeros((k, n), np.float32)
  for i in np.argsort(row * s + start, kind="stable"):  # each row's segments in order along it
    if row[i] < 0:
      continue
    g, a, length = row[i], start[i], lengths[i]
    segments[g] += 1
    tokens[g, a:a + length] = rows.tokens[i, :length]
    positions[g, a:a + length] = np.arange(length)
    segment_ids[g, a:a + length] = segments[g]
    mb = g // r
    answer_row[mb, i], answer_start[mb, i], member[mb, i] = g % r, a, 1.0
  # the padding after a row's last segment: a segment of its own, numbered past the last, so
  # that ids never decrease along a row (the attention kernel skips key blocks by them)
  segment_ids = np.where(segment_ids == 0, segments[:, None] + 1, segment_ids).astype(np.int32)
  filled = segments > 0  # [k * r]
  active = filled.reshape(k, r).any(axis=1)
  active[0] = True  # a step runs at least one micro-batch (all-empty: loss 0, as padded)
  return Packed(tokens=tokens.reshape(k, r, s), positions=positions.reshape(k, r, s),
                segment_ids=segment_ids.reshape(k, r, s), answer_row=answer_row,
                answer_start=answer_start, member=member,
                active=active, rows_filled=int(filled.sum()),
                real_tokens=int(lengths.sum()))
