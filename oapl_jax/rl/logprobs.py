"""The trainer's sequence log-prob kernel, and `make_batch`, which lays a rollout out for it.

A batch row is `prompt + answer + padding` starting at position 0 (the same positions the
engine used). Targets are `tokens[:, 1:]`; `mask[:, t]` is 1 where target t is an answer
token that counts in the loss (`buffer.Rows`).

Memory: the kernel never builds `[B, T, V]` logits. It takes the final hidden states
`[B, T-1, E]` and the LM head `[E, V]`, and scans over tiles of `tile` positions of every row:
each step computes the `[B, tile, V]` float32 logits of one tile (the head matmul inside the
tile), processes them exactly as the engine does (`processing.process_logits`: temperature,
top-k and top-p by bisection thresholds, the scored token always kept) and reduces them to
the target's log-prob and the entropy. The tile is a `jax.checkpoint`: the backward pass
recomputes each tile's logits from its hidden states, so forward and backward hold one
`[B, tile, V]` block (and its few same-sized temporaries) at a time, plus `[E, V]` head
gradients. Tiles run along T within each row, so a batch sharded by rows stays sharded
(each device scores its own rows' tiles); a per-device block is `[B/shards, tile, V]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.rl.buffer import Rows
from oapl_jax.sampling.processing import SamplingParams, entropy, process_logits
from oapl_jax.sampling.rollout import FINISH_LENGTH, Rollout


def token_logprobs(model: nnx.Module, tokens: jax.Array, sampling: SamplingParams, *,
                   tile: int = 512, **model_kwargs):
  """Log-probs of each next token under the engine's processed distribution.

  tokens: `[B, T]` int. Returns (logprobs `[B, T-1]`, entropy `[B, T-1]`), float32:
  logprobs[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) after temperature / top-k /
  top-p processing (the scored token always kept; see `processing.py`). Gradients flow into
  the model's parameters through the hidden states and the LM head; the truncation mask is
  stop-gradient. Entropy is of the processed distribution and should be read as a metric only.
  tile: positions per row per scan step (`min(tile, T-1)`; see the module docstring).
  model_kwargs go to `model.hidden_states`.
  """
  hidden = model.hidden_states(tokens[:, :-1], **model_kwargs)  # [B, T-1, E] compute dtype
  return tiled_logprobs(hidden, model.head_matrix(), tokens[:, 1:], sampling, tile=tile)


def tiled_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                   sampling: SamplingParams, *, tile: int = 512):
  """(logprobs, entropy) `[B, T]` float32 of targets `[B, T]` int, logits = hidden @ head.

  hidden: `[B, T, E]` (compute dtype); head: `[E, V]`.

  Equal to `logits_logprobs(hidden @ head, targets, sampling)` without its `[B, T, V]`
  tensors: a scan over `ceil(T / tile)` rematerialised tiles of `min(tile, T)` positions; the
  last tile is padded with zero hidden states (finite, uniform logits) whose results are
  dropped. The head is cast to the hidden states' dtype inside the tile, so its gradient is
  summed over tiles in the head's own dtype (float32 master weights).
  """
  if tile < 1:
    raise ValueError(f"tile must be >= 1, got {tile}")
  b, t, e = hidden.shape
  tile = min(tile, t)
  n = -(-t // tile)  # tiles per row
  pad = n * tile - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  h = h.reshape(b, n, tile, e).swapaxes(0, 1)  # [n, B, tile, E]
  y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, tile).swapaxes(0, 1)  # [n, B, tile]

  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan: no CSE across steps
  def one_tile(h_tile, y_tile):  # [B, tile, E], [B, tile] -> ([B, tile], [B, tile])
    w = head.astype(h_tile.dtype)  # [E, V]
    logits = jnp.dot(h_tile, w, preferred_element_type=jnp.float32)  # [B, tile, V]
    return logits_logprobs(logits, y_tile, sampling)

  _, (logp, ent) = jax.lax.scan(lambda c, xs: (c, one_tile(*xs)), None, (h, y))  # [n, B, tile] each
  unstack = lambda x: x.swapaxes(0, 1).reshape(b, n * tile)[:, :t]  # [B, T]
  return unstack(logp), unstack(ent)


def logits_logprobs(logits: jax.Array, targets: jax.Array, sampling: SamplingParams):
  """(logprobs, entropy) `[...]` float32 of targets `[...]` int under logits `[..., V]` float32.

  The processing of `token_logprobs` on given logits: one tile of it inside the kernel, and,
  on a whole batch's `[B, T, V]` logits, the plain (memory-unbounded) computation that the
  tests and `benchmarks/logprob_memory.py` compare the kernel with.
  """
  processed = process_logits(logits, sampling, always_keep=targets)  # [..., V]
  logp_all = jax.nn.log_softmax(processed, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]  # [...]
  return logp, entropy(processed)


def make_batch(rollout: Rollout, rewards: np.ndarray, *, seq_len: int, pad_id: int,
               count_truncated: bool = True) -> Rows:
  """Lays a rollout out for the trainer: `Rows` of `[N, seq_len]` tokens (see `Rows`).

  The rows carry the engine's version stamps and `snapshot_step` -1 until `buffer.stamp`.
  With `count_truncated=False`, answers cut at the length limit get mask 0 (they are in their
  group's V_hat but out of the loss).
  """
  n, g = rollout.num_samples, rollout.group_size
  tokens = np.full((n, seq_len), pad_id, np.int32)
  mask = np.zeros((n, seq_len - 1), np.float32)
  old = np.zeros((n, seq_len - 1), np.float32)
  for row in range(n):
    prompt = rollout.prompts[row // g]
    p, a = len(prompt), int(rollout.lengths[row])
    if p + a > seq_len:
      raise ValueError(f"prompt {p} + answer {a} tokens > seq_len={seq_len}")
    tokens[row, :p] = prompt
    tokens[row, p:p + a] = rollout.answers[row, :a]
    if count_truncated or rollout.finish[row] != FINISH_LENGTH:
      mask[row, p - 1:p - 1 + a] = 1.0
    old[row, p - 1:p - 1 + a] = rollout.logprobs[row, :a]
  return Rows(tokens=tokens, mask=mask, sampler_logprobs=old,
              rewards=np.asarray(rewards, np.float32), answer_lengths=rollout.lengths.copy(),
              version=np.asarray(rollout.versions, np.int32), snapshot_step=np.full((n,), -1, np.int32))
