"""Segment-masked blockwise attention on packed rows vs the same sequences padded to the longest.

The sequences' lengths are spread evenly over 1..--max_len (seeded). Padded: one row per
sequence, `[S, max_len]`. Packed: the sequences placed first-fit decreasing into rows of
--row tokens, with segment ids (`causal_attention(..., segment_ids=)`), once with the key blocks
before a query block's segment skipped (the kernel as it runs) and once with the skip turned
off (every causal block pair computed, masked only: `_first_key_blocks` patched to 0), so the
two halves of the gain show. Forward + backward (`jax.grad` of a weighted sum by q, k, v),
float32, medians of --repeats timed calls after one warm-up, all in one run on this machine.

  python benchmarks/packed_attention.py [--seqs 16] [--max_len 1024] [--row 2048] [--block 256]

Informational (the train step's own packed-vs-padded figures belong to the trainer's benchmark).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from oapl_jax.models import attention

N, K, D = 4, 2, 64  # query heads, KV heads, head width


def first_fit_decreasing(lengths, row: int) -> list[list[int]]:
  """Indices of `lengths` per row: each, longest first, into the first row with room."""
  rows, room = [], []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    j = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
    if j is None:
      rows.append([])
      room.append(row)
      j = len(rows) - 1
    rows[j].append(i)
    room[j] -= lengths[i]
  return rows


def segment_ids(lengths, rows, width: int) -> np.ndarray:
  """`[R, width]` int32: ids 1, 2, ... of each row's sequences, trailing padding 0."""
  seg = np.zeros((len(rows), width), np.int32)
  for r, members in enumerate(rows):
    at = 0
    for s, i in enumerate(members):
      seg[r, at:at + lengths[i]] = s + 1
      at += lengths[i]
  return seg


def timed(fn, args, repeats: int) -> float:
  """Median seconds of fn(*args) (jitted, after a warm-up call)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def fwd_bwd(b: int, t: int, block: int, seg=None):
  """A jitted forward + backward of attention over `[b, t]` and its random arguments."""
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, N, D)) * D**-0.5
  k, v = jax.random.normal(keys[1], (b, t, K, D)), jax.random.normal(keys[2], (b, t, K, D))
  w = jax.random.normal(keys[3], (b, t, N, D))
  seg = None if seg is None else jnp.asarray(seg)
  loss = lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, block, segment_ids=seg) * w)  # noqa: E731
  return jax.jit(jax.grad(loss, (0, 1, 2))), (q, k, v)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seqs", type=int, default=16)
  parser.add_argument("--max_len", type=int, default=1024)
  parser.add_argument("--row", type=int, default=2048)
  parser.add_argument("--block", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  lengths = np.random.default_rng(args.seed).integers(1, args.max_len + 1, args.seqs).tolist()
  rows = first_fit_decreasing(lengths, args.row)
  seg = segment_ids(lengths, rows, args.row)
  real = sum(lengths)
  print(f"{args.seqs} sequences, lengths even over 1..{args.max_len} (mean {np.mean(lengths):.0f}), "
        f"{real} real tokens; {N} q / {K} kv heads x {D}, float32, block {args.block}, "
        f"{jax.default_backend()}, median of {args.repeats}")
  padded = timed(*fwd_bwd(args.seqs, args.max_len, args.block), args.repeats)
  packed = timed(*fwd_bwd(len(rows), args.row, args.block, seg), args.repeats)
  no_skip = lambda seg, c: jnp.zeros(-(-seg.shape[1] // c), jnp.int32)  # noqa: E731
  with mock.patch.object(attention, "_first_key_blocks", no_skip):
    masked = timed(*fwd_bwd(len(rows), args.row, args.block, seg), args.repeats)
  print(f"  padded  {args.seqs:>3} rows x {args.max_len:<6} {padded * 1e3:9.1f} ms  "
        f"{real / padded / 1e3:8.1f} k real tokens/s")
  print(f"  packed  {len(rows):>3} rows x {args.row:<6} {packed * 1e3:9.1f} ms  "
        f"{real / packed / 1e3:8.1f} k real tokens/s  ({padded / packed:.2f}x padded)")
  print(f"  packed, masked only (no block skip) {masked * 1e3:9.1f} ms  "
        f"({masked / packed:.2f}x the skipping kernel's time)")


if __name__ == "__main__":
  main()
