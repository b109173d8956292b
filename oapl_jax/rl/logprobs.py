"""The trainer's sequence log-prob kernel, and `make_batch`, which lays a rollout out for it.

A batch row is `prompt + answer + padding` starting at position 0 (the same positions the
engine used). Targets are `tokens[:, 1:]`; `mask[:, t]` is 1 where target t is an answer
token that counts in the loss (`buffer.Rows`).

Memory: the kernel never builds `[B, T, V]` logits. It takes the final hidden states
`[B, T-1, E]` and the LM head `[E, V]` and scans over tiles of `tile` positions of every row.
Each step computes one tile's `[B, tile, V]` float32 logits (the head matmul inside the tile),
finds the engine's truncation threshold (`processing.keep_threshold`: temperature, top-k and
top-p by bisection, the scored token always kept) and reduces the tile to the target's
log-prob and the entropy; it keeps only three numbers per position (threshold, max and sum
of the softmax). The backward pass is a second scan that recomputes each tile's logits and
turns them into the tile's logit gradient `(onehot(target) - p) * g / temperature`, then into
the hidden-state and head gradients. Forward and backward hold a few `[B, tile, V]` blocks at a
time plus the `[E, V]` head gradient; see `benchmarks/logprob_memory.py`.

Why a hand-written backward (a `custom_vjp`) rather than autodiff of a `jax.checkpoint`ed
tile: both recompute the logits, but XLA (CPU) turned the autodiff version into about 6 live
`[tile, V]` buffers (constants broadcast to `[tile, V]` hoisted out of the loop, a transposed
copy of the logit gradient, the bisection rerun); this one needs about 2 besides the per-tile
head gradient.

Tiles run along T within each row, so a batch sharded by rows stays sharded (each device
scores its own rows' tiles); a per-device block is `[B/shards, tile, V]`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.rl.buffer import Rows
from oapl_jax.sampling.processing import (NEG_INF, SamplingParams, entropy, keep_threshold,
                                          process_logits, truncates)

if TYPE_CHECKING:  # the engine's module imports JetStream (and TensorFlow): only make_batch needs it
  from oapl_jax.sampling.rollout import Rollout


def token_logprobs(model: nnx.Module, tokens: jax.Array, sampling: SamplingParams, *,
                   tile: int = 512, vocab_split=None, **model_kwargs):
  """Log-probs of each next token under the engine's processed distribution.

  tokens: `[B, T]` int. Returns (logprobs `[B, T-1]`, entropy `[B, T-1]`), float32:
  logprobs[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) after temperature / top-k /
  top-p processing (the scored token always kept; see `processing.py`). Gradients flow into
  the model's parameters through the hidden states and the LM head; the truncation is
  stop-gradient. Entropy is of the processed distribution, a metric: stop-gradient.
  tile: positions per row per scan step (`min(tile, T-1)`; see the module docstring).
  vocab_split: see `tiled_logprobs`. model_kwargs go to `model.hidden_states`.
  """
  hidden = model.hidden_states(tokens[:, :-1], **model_kwargs)  # [B, T-1, E] compute dtype
  return tiled_logprobs(hidden, model.head_matrix(), tokens[:, 1:], sampling, tile=tile,
                        vocab_split=vocab_split)


def tiled_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                   sampling: SamplingParams, *, tile: int = 512, vocab_split=None):
  """(logprobs, entropy) `[B, T]` float32 of targets `[B, T]` int, logits = hidden @ head.

  hidden: `[B, T, E]` (compute dtype); head: `[E, V]` (cast to the compute dtype for the
  matmul, whose output is float32). Equal to `reference_logprobs(hidden @ head, targets,
  sampling)` without its `[B, T, V]` tensors: `ceil(T / tile)` tiles of `min(tile, T)`
  positions per row; the last tile is padded with zero hidden states (finite, uniform logits)
  whose results are dropped (and get zero gradient). Gradients: w.r.t. hidden and head
  (the head's summed over tiles in float32, returned in the head's dtype); none through the
  threshold or the entropy.

  vocab_split: None, or `(head, logits)` NamedShardings of the head `[E, V]` and of a tile's
  logits `[B, tile, V]`, both split by V (the trainer's mesh: `rl.step`). Each scan step
  then computes its logits, and the backward its head gradient, vocab-parallel (the rows of
  a tile gathered, a few MB): left to itself inside the scans, XLA may gather the whole head
  on every device and all-reduce a whole float32 head gradient (`--dry_run=compile` shows it).
  The same values either way.
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
  logp, ent = _tiles(h, head, y, sampling, vocab_split)  # [n, B, tile] each
  unstack = lambda x: x.swapaxes(0, 1).reshape(b, n * tile)[:, :t]  # [B, T]
  return unstack(logp), unstack(ent)


def _scaled_logits(h: jax.Array, w: jax.Array, sampling: SamplingParams) -> jax.Array:
  """Temperature-scaled logits `[B, tile, V]` float32 of h `[B, tile, E]`, w `[E, V]`."""
  return jnp.dot(h, w, preferred_element_type=jnp.float32) / sampling.temperature


def _is_target(targets: jax.Array, vocab: int) -> jax.Array:
  """Boolean `[..., V]`, true at each row's target (an iota compare XLA fuses; no one-hot)."""
  return jnp.arange(vocab) == targets[..., None]


HEAD_GRAD_ROWS = 128  # The backward adds the head gradient [E, V] this many rows of E at a time.


def _split(x: jax.Array, sharding) -> jax.Array:
  """x pinned to `sharding` (None: left to XLA)."""
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiles(h, head, y, sampling, vocab_split):
  """(logprobs, entropy) `[n, B, tile]` of tiles h `[n, B, tile, E]`, targets y `[n, B, tile]`."""
  return _tiles_fwd(h, head, y, sampling, vocab_split)[0]


def _tiles_fwd(h, head, y, sampling, vocab_split):
  head_s, logits_s = vocab_split or (None, None)
  w = _split(head.astype(h.dtype), head_s)  # [E, V]
  vocab = w.shape[-1]

  def step(_, xs):
    h_tile, y_tile = xs  # [B, tile, E], [B, tile]
    scaled = _split(_scaled_logits(h_tile, w, sampling), logits_s)  # [B, tile, V]
    is_target = _is_target(y_tile, vocab)
    if truncates(sampling, vocab):
      threshold = keep_threshold(scaled, sampling)  # [B, tile]: kept iff scaled >= it
      kept = jnp.where((scaled >= threshold[..., None]) | is_target, scaled, NEG_INF)
    else:
      threshold, kept = jnp.full(scaled.shape[:-1], NEG_INF), scaled
    # log-softmax as `jax.nn.log_softmax` computes it (the same rounding as the plain kernel)
    top = jnp.max(kept, axis=-1)  # [B, tile]
    total = jnp.sum(jnp.exp(kept - top[..., None]), axis=-1)  # [B, tile]
    log_total = jnp.log(total)
    target = jnp.sum(jnp.where(is_target, scaled, 0.0), axis=-1)  # [B, tile] scaled[target]
    logp = (target - top) - log_total
    logp_all = (kept - top[..., None]) - log_total[..., None]  # [B, tile, V] (fused)
    p = jnp.exp(logp_all)
    ent = -jnp.sum(jnp.where(p > 0, p * logp_all, 0.0), axis=-1)
    return None, (logp, ent, threshold, top, total)

  _, (logp, ent, threshold, top, total) = jax.lax.scan(step, None, (h, y))
  return (logp, ent), (h, head, y, threshold, top, total)


def _tiles_bwd(sampling, vocab_split, residuals, cotangents):
  h, head, y, threshold, top, total = residuals  # [n, B, tile, E], [E, V], [n, B, tile] x 4
  g = cotangents[0]  # [n, B, tile]; the entropy's cotangent is ignored (stop-gradient)
  head_s, logits_s = vocab_split or (None, None)
  w = _split(head.astype(h.dtype), head_s)
  vocab = w.shape[-1]

  def step(dw, xs):
    h_tile, y_tile, threshold_tile, top_tile, total_tile, g_tile = xs  # [B, tile, E], [B, tile] x 5
    scaled = _split(_scaled_logits(h_tile, w, sampling), logits_s)  # [B, tile, V] recomputed
    is_target = _is_target(y_tile, vocab)
    kept = (scaled >= threshold_tile[..., None]) | is_target
    e = jnp.exp(scaled - top_tile[..., None])  # softmax numerators of the kept tokens
    # d logp / d logits = (onehot(target) - e / total) / temperature, in autodiff's op order
    d = jnp.where(is_target, g_tile[..., None], 0.0) + (-g_tile / total_tile)[..., None] * e
    dlogits = (jnp.where(kept, d, 0.0) / sampling.temperature).astype(h_tile.dtype)  # [B, tile, V]
    dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).astype(h_tile.dtype)
    # as one [E, B*tile] x [B*tile, V] matmul: XLA:CPU has no bf16 x bf16 -> f32 kernel for
    # a dot contracting two dimensions
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731  [B*tile, E|V]
    hf, dl = flat(h_tile), flat(dlogits)
    # added HEAD_GRAD_ROWS hidden rows at a time, in place: XLA:CPU does not fuse a dot into
    # the add that accumulates it, so `dw + dot` held three float32 [E, V] buffers at once
    for e0 in range(0, dw.shape[0], HEAD_GRAD_ROWS):
      rows = min(HEAD_GRAD_ROWS, dw.shape[0] - e0)
      part = jnp.dot(hf[:, e0:e0 + rows].T, dl, preferred_element_type=jnp.float32)  # [rows, V]
      dw = jax.lax.dynamic_update_slice_in_dim(
          dw, jax.lax.dynamic_slice_in_dim(dw, e0, rows) + part, e0, axis=0)
    return _split(dw, head_s), dh  # [E, V] float32, [B, tile, E]

  xs = (h, y, threshold, top, total, g)
  dw, dh = jax.lax.scan(step, _split(jnp.zeros(head.shape, jnp.float32), head_s), xs)
  return dh, dw.astype(head.dtype), None


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def reference_logprobs(logits: jax.Array, targets: jax.Array, sampling: SamplingParams):
  """(logprobs, entropy) `[...]` of targets `[...]` int under logits `[..., V]` float32.

  Reference only (tests, `benchmarks/logprob_memory.py`): the kernel before tiling, on a
  whole batch's `[B, T, V]` logits: `process_logits`, log-softmax, gather, `entropy`.
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
  group's V_hat but out of the loss). A multi-turn rollout's environment tokens (`Rollout.model`
  0) are context, not targets (`only_model_targets`).
  """
  from oapl_jax.sampling.engine import FINISH_LENGTH  # noqa: PLC0415 (see TYPE_CHECKING above)
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
  rows = Rows(tokens=tokens, mask=mask, sampler_logprobs=old,
              rewards=np.asarray(rewards, np.float32), answer_lengths=rollout.lengths.copy(),
              version=np.asarray(rollout.versions, np.int32), snapshot_step=np.full((n,), -1, np.int32))
  if rollout.model is None:
    return rows
  model = rollout.model * (np.arange(rollout.model.shape[1])[None] < rollout.lengths[:, None])
  return only_model_targets(rows, model, np.array([len(rollout.prompts[i // g]) for i in range(n)]))


def only_model_targets(rows: Rows, model: np.ndarray, prompt_lengths: np.ndarray) -> Rows:
  """`rows` (laid out by `make_batch`, every token after the prompt an answer token) with the
  environment's tokens taken out of the targets: mask and sampler log-probs 0 there, answer
  lengths the model tokens. model: `[N, A]` flags, 1 on answer token j of row i that the
  model wrote (0 past the answer); prompt_lengths: `[N]`. Rows with no 0 flag are unchanged."""
  n, a = model.shape
  t = rows.mask.shape[1]
  flags = np.ones((n, t), np.float32)  # [N, T-1]: 1 outside answers (their mask is 0 anyway)
  cols = np.asarray(prompt_lengths)[:, None] - 1 + np.arange(a)[None, :]  # [N, A] target of token j
  inside = cols < t
  flags[np.nonzero(inside)[0], cols[inside]] = model[inside]
  return dataclasses.replace(rows, mask=rows.mask * flags,
                             sampler_logprobs=rows.sampler_logprobs * flags,
                             answer_lengths=model.astype(np.int64).sum(axis=1).astype(rows.answer_lengths.dtype))
