"""The decode step: one token per row against a KV cache, over the engine's weight layout.

This is the model's only decode step (the sampling engine's, and what the tests check against
the full forward pass: prefill + decode logits == `Transformer.__call__`'s, tests/test_model.py).
It multiplies by the engine's fused matrices (`layout.py`): per layer q, k, v as one
`[E, T, (N + 2K) / T * D]` matrix and gate, up as one `[E, T, 2F / T]` (one matmul each),
and the LM head `[E, V]`. Slice t of axis 1 holds tensor shard t's query, key and value heads
(gate and up columns), so the "tensor" mesh axis splits them by whole heads and each device
computes its own heads' attention; the o_proj and down_proj matmuls then sum over devices
(Megatron), and XLA inserts the all-reduces from the weights' shardings. (A plain
`[E, (N + 2K) * D]` matrix, all query heads then all keys then all values, split over T
devices would give device 0 the query heads and device 1 the keys.) With T = 1 the reshapes
to and from `[.., 1, X]` are free.

The embedding of a tied model is read from the head `[E, V]` (the engine holds one copy).
Everything else is the model's own code: RMSNorms, RoPE (`Transformer.rope_table`,
`apply_rope`), `decode_attend` (chunked attention up to `live_len`; on TPU a Pallas kernel,
`ModelConfig.attention_kernel`), `Attention.output`, the
final norm and LM head (`Transformer._logits`); the cache layout is `init_cache`'s. The
forward pass computes the same arithmetic (q scaled in the compute dtype, `_online_update`):
see the bfloat16 parity notes in `models/attention.py` and `models/transformer.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oapl_jax.models.attention import decode_attend
from oapl_jax.models.transformer import Transformer, apply_rope


def _embed(model: Transformer, head: jax.Array, tokens: jax.Array) -> jax.Array:
  """tokens `[B]` -> `[B, 1, E]` in the compute dtype (tied: columns of the head `[E, V]`)."""
  if not model.cfg.tie_embeddings:
    return model._embed(tokens[:, None])
  return jnp.take(head, tokens, axis=1).T[:, None].astype(model.cfg.dtype)  # [B, 1, E]


def _project_qkv(attn, x: jax.Array, rope_cs, qkv: jax.Array):
  """`Attention.project_qkv` with fused `qkv` `[E, T, (N + 2K) / T * D]`.

  x `[B, 1, E]` -> q `[B, 1, N, D]`, k, v `[B, 1, K, D]` (RoPE applied).
  """
  cfg, dt = attn.cfg, x.dtype
  b, t, e = x.shape
  shards = qkv.shape[1]
  n, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  nq, nk = n // shards * d, kv // shards * d
  y = (x @ qkv.reshape(e, -1).astype(dt)).reshape(b, t, shards, -1)  # [B, 1, T, (N+2K)/T*D]
  q = y[..., :nq].reshape(b, t, n, d)
  k = y[..., nq:nq + nk].reshape(b, t, kv, d)
  v = y[..., nq + nk:].reshape(b, t, kv, d)
  if cfg.qkv_bias:
    q, k, v = q + attn.q_bias[...].astype(dt), k + attn.k_bias[...].astype(dt), v + attn.v_bias[...].astype(dt)
  if cfg.qk_norm:
    q, k = attn.q_norm(q), attn.k_norm(k)
  return apply_rope(q, *rope_cs), apply_rope(k, *rope_cs), v


def _mlp(mlp, x: jax.Array, gate_up: jax.Array) -> jax.Array:
  """`MLP.__call__` with fused `gate_up` `[E, T, 2F / T]`. x `[B, 1, E]` -> `[B, 1, E]`."""
  dt = x.dtype
  b, t, e = x.shape
  shards = gate_up.shape[1]
  gu = (x @ gate_up.reshape(e, -1).astype(dt)).reshape(b, t, shards, -1)  # [B, 1, T, 2F/T]
  f = gu.shape[-1] // 2
  h = (jax.nn.silu(gu[..., :f]) * gu[..., f:]).reshape(b, t, -1)  # [B, 1, F]
  return h @ mlp.down_proj[...].astype(dt)


# The cache writes keep the cache in its own layout on TPU. XLA:TPU tiles the two minor axes of
# an array (keys: D x positions, values: positions x D). A scatter or update of one key column
# (one position in the minor axis), or of a value window [K, D] that spans a major axis (K),
# makes its layout assignment move the whole buffer to a layout where the window is contiguous:
# inside the decode loop it then keeps the loop's cache in that layout, copying the whole cache
# in and out of the loop (a second cache in temp memory) and, each step, every layer back to the
# layout the attention kernel reads. The writes below are in place in the default layout:
# values by (row, head) with a window of D; keys as a read-modify-write of the aligned block of
# `tile` positions holding each row's position, row by row. tests/test_aot.py holds the decode
# loop's temp bytes below the cache's (compiled for v5p-8).


def write_keys(k_cache: jax.Array, k: jax.Array, positions: jax.Array, tile: int = 128) -> jax.Array:
  """k_cache `[B, K, D, S]` with row b's key k[b] `[K, D]` at position positions[b] (`< S`)."""
  size = k_cache.shape[-1]
  tile = min(tile, size)

  def row(b, cache):
    start = jnp.minimum(positions[b] // tile * tile, size - tile)  # the block holding the position
    block = jax.lax.dynamic_slice(cache, (b, 0, 0, start), (1, *cache.shape[1:3], tile))
    block = jnp.where(start + jnp.arange(tile) == positions[b], k[b][None, :, :, None], block)
    return jax.lax.dynamic_update_slice(cache, block, (b, 0, 0, start))

  return jax.lax.fori_loop(0, k_cache.shape[0], row, k_cache)


def write_values(v_cache: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
  """v_cache `[B, K, S, D]` with row b's value v[b] `[K, D]` at position positions[b]."""
  b, heads = v.shape[:2]
  return v_cache.at[jnp.arange(b)[:, None], jnp.arange(heads)[None, :], positions[:, None]].set(v)


def _block(layer, x, positions, rope_cs, k_cache, v_cache, live_len, chunk: int, fused: dict,
           tpu: bool):
  """One layer, one token per row, over fused weights {"qkv", "gate_up"}. x `[B, 1, E]`,
  positions `[B]`, caches `[B, K, D, S]`, `[B, K, S, D]`. Writes this token's key/value at
  `positions` (tpu: `write_keys` / `write_values`, else one scatter each, 20% faster on CPU)
  and attends to cache indices `<= positions`. Returns (x, k_cache, v_cache)."""
  b = x.shape[0]
  q, k, v = _project_qkv(layer.attn, layer.input_norm(x), rope_cs, fused["qkv"])  # [B, 1, N|K, D]
  if tpu:
    k_cache = write_keys(k_cache, k[:, 0].astype(k_cache.dtype), positions)
    v_cache = write_values(v_cache, v[:, 0].astype(v_cache.dtype), positions)
  else:
    rows = jnp.arange(b)
    k_cache = k_cache.at[rows, :, :, positions].set(k[:, 0].astype(k_cache.dtype))  # [b, :, :, pos_b]
    v_cache = v_cache.at[rows, :, positions].set(v[:, 0].astype(v_cache.dtype))  # [b, :, pos_b, :]
  n, d = q.shape[2], q.shape[3]
  kv_heads = k.shape[2]
  q = q[:, 0].reshape(b, kv_heads, n // kv_heads, d) * d**-0.5  # [B, K, G, D]
  out = decode_attend(q, k_cache, v_cache, positions, live_len, chunk,
                      kernel=layer.attn.cfg.attention_kernel)  # [B, K, G, D]
  x = x + layer.attn.output(out.reshape(b, 1, n, d).astype(x.dtype))
  x = x + _mlp(layer.mlp, layer.post_attn_norm(x), fused["gate_up"])
  return x, k_cache, v_cache


def decode(model: Transformer, weights: dict, tokens: jax.Array, positions: jax.Array,
           cache: dict, *, live_len: jax.Array, chunk: int, rope_table,
           tpu: bool = False) -> tuple[jax.Array, dict]:
  """One decode step of every row against a KV cache (layout: `init_cache`).

  model: the engine's model (`EngineParams.params` merged: the fused weights' Params are None;
  a full model works too, its q/k/v, gate/up and tied embedding are not read);
  weights: `EngineParams.decode` (`EngineLayout.relayout`); tokens `[B]` int, the token at
  `positions` `[B]` of each row (`< S`). Row b holds valid keys at indices `< positions[b]`;
  this step writes its keys at `positions[b]` and attends to indices `<= positions[b]`,
  reading the cache (`{"k": L x [B, K, D, S], "v": L x [B, K, S, D]}`) in chunks of `chunk`
  positions up to `live_len` (int `[]`, `> max(positions)`); rope_table: `model.rope_table(S)`,
  computed once outside a decode loop; tpu: the program is compiled for TPU (the cache writes
  that keep XLA:TPU from copying the cache, `write_keys`; the engine passes its devices').
  Returns (logits `[B, V]` float32, updated cache).
  """
  rope_cs = tuple(t[positions][:, None, None, :] for t in rope_table)  # [B, 1, 1, D/2]
  x = _embed(model, weights["head"], tokens)  # [B, 1, E]
  new_k, new_v = [], []
  for layer, k_cache, v_cache, w in zip(model.layers, cache["k"], cache["v"], weights["layers"]):
    x, k_cache, v_cache = _block(layer, x, positions, rope_cs, k_cache, v_cache, live_len, chunk, w,
                                 tpu)
    new_k.append(k_cache)
    new_v.append(v_cache)
  return model._logits(x, weights["head"])[:, 0], {"k": new_k, "v": new_v}
