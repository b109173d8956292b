"""Pallas TPU kernels for the two attentions of `attention.py` (chosen there, `attention_impl`).

* `splash_causal_attention(q, k, v)`: the full pass's causal grouped-query attention through
  JAX's splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`, MaxText's
  choice on TPU), values and gradients (its own Pallas backward kernels). The kernel's query
  and key blocks must divide the sequence: T is padded at the end up to a multiple of 128 and
  the padded queries' outputs dropped. No segment ids are needed for that padding: under the
  causal mask every real query (position < T) sees only keys at positions <= its own, never
  the padding behind it (nor the right-padding of a shorter row, which the blockwise path
  does not mask either: the same numbers). Packed rows (`segment_ids`) go to the kernel as its
  `SegmentIds(q=..., kv=...)` (it ands them with the causal mask); the kernel's padding gets
  the segment id -1, which no real position has (ids are >= 0), so the padded queries attend
  only to padding (each to itself at least: no empty softmax, no NaN in their rows, whose
  gradients are zero). The kernel skips blocks by its static (causal) mask only; segment ids
  mask inside the blocks it visits. GQA: the splash MHA kernel maps query head n to
  key/value head n // (N / K), the order of `causal_attention`'s heads.
* `decode_attention(q, k_cache, v_cache, positions, chunk)`: the engine's attention of one
  query per row over the KV cache, a small Pallas kernel of this project's own. JAX's
  `paged_attention` and `ragged_paged_attention` kernels need the cache as pages
  (`[K, pages, page, D]`, or keys and values interleaved in `[pages, page, 2K, D]`), while
  this cache is keys `[B, K, D, S]` (positions minor) and values `[B, K, S, D]`
  (`kv_cache.init_cache`): feeding them would copy (transpose) the whole cache every step, or
  need a new cache layout for the engine, its prefill writes and its sharding. The kernel
  here reads the cache where it lies: the grid runs over (row, chunk of `C` positions); a row
  skips the chunks past its own position (ragged: each row reads only its live prefix; the
  skipped steps' block index repeats, so no DMA is issued), all K heads of a row in one block,
  the scores `q [G, D] @ k [D, C]` need no transpose, and the arithmetic is `decode_attend`'s
  (float32 scores, float32 online softmax, probabilities cast to the value dtype).

Both take `interpret=True` to run in Pallas interpret mode on any backend (the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

LANES = 128  # TPU vector lanes: the splash kernel's blocks, and decode chunks, are multiples of it
SPLASH_BLOCKS = (512, 256, 128)  # query / key block lengths tried, largest first (MaxText: 512)


# --- Causal attention of the full pass: splash ---------------------------------------------


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def splash_block(t: int) -> tuple[int, int]:
  """(padded length, block) for a sequence of t positions: t rounded up to a multiple of the
  largest of `SPLASH_BLOCKS` that pads it by at most t / 8 (else of `LANES`), and the largest
  of `SPLASH_BLOCKS` dividing that (2048 -> blocks of 512; 2080 -> 2304, blocks of 256 rather
  than 2560 or blocks of 128; a guess at the balance, not timed on a TPU)."""
  tp = next((_round_up(t, c) for c in SPLASH_BLOCKS if _round_up(t, c) - t <= t // 8),
            _round_up(t, LANES))
  return tp, next(c for c in SPLASH_BLOCKS if tp % c == 0)


def splash_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                            segment_ids: jax.Array | None = None, *,
                            interpret: bool = False) -> jax.Array:
  """`attention.causal_attention` through the splash kernel.

  q: `[B, T, N, D]` already scaled by 1/sqrt(D); k, v: `[B, T, K, D]`, N a multiple of K;
  segment_ids: None, or `[B, T]` int >= 0 (packed rows: attention within a segment only).
  Returns `[B, T, N, D]` in q's dtype; differentiable (the kernel's own backward).
  """
  b, t, n, d = q.shape
  tp, c = splash_block(t)
  blocks = splash.BlockSizes(block_q=c, block_kv=c, block_kv_compute=c, block_q_dkv=c,
                             block_kv_dkv=c, block_kv_dkv_compute=c, block_q_dq=c, block_kv_dq=c)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((tp, tp))] * n)
  kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)

  def heads_major(x):  # [B, T, H, D] -> [B, H, Tp, D], zeros after position T
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

  q, k, v = heads_major(q), heads_major(k), heads_major(v)  # [B, H, Tp, D]
  if segment_ids is None:
    out = jax.vmap(kernel)(q, k, v)  # [B, N, Tp, D]
  else:
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)  # [B, Tp]
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(
        q, k, v, seg)  # [B, N, Tp, D]
  return out.transpose(0, 2, 1, 3)[:, :t]


# --- Attention of one query per row over the KV cache: the decode step --------------------


def decode_chunk(size: int, chunk: int, interpret: bool = False) -> int:
  """Positions per block of the decode kernel over a cache of `size` positions: the largest
  divisor of `size` that is <= `chunk` and a multiple of `LANES` (the TPU's rule for the keys'
  minor axis), else the whole cache. In interpret mode any divisor <= chunk (small tests)."""
  step = 1 if interpret else LANES
  for c in range(min(chunk, size) // step * step, 0, -step):
    if size % c == 0:
      return c
  return size


def _decode_kernel(pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, c: int,
                   num_chunks: int):
  """One (row, chunk) step. pos_ref `[B]` (scalar prefetch); blocks: q `[K, G, D]`,
  k `[K, D, C]`, v `[K, C, D]`, out `[K, G, D]` float32; scratch m, l `[K, G, 1]`,
  acc `[K, G, D]` float32 (the online softmax, `attention._online_update`)."""
  row, j = pl.program_id(0), pl.program_id(1)
  pos = pos_ref[row]

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(j * c <= pos)  # chunks past the row's position are skipped (their block repeats)
  def _():
    for h in range(q_ref.shape[0]):  # the K heads, unrolled: plain 2-D matmuls
      q, k, v = q_ref[h], k_ref[h], v_ref[h]  # [G, D], [D, C], [C, D]
      s = jnp.dot(q, k, preferred_element_type=jnp.float32)  # [G, C]
      idx = j * c + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(idx <= pos, s, -jnp.inf)
      m_prev = m_ref[h]  # [G, 1]
      m_new = jnp.maximum(m_prev, s.max(-1, keepdims=True))  # finite: index 0 is always seen
      corr = jnp.exp(m_prev - m_new)
      p = jnp.exp(s - m_new)  # [G, C]
      l_ref[h] = l_ref[h] * corr + p.sum(-1, keepdims=True)
      acc_ref[h] = acc_ref[h] * corr + jnp.dot(p.astype(v.dtype), v,
                                               preferred_element_type=jnp.float32)
      m_ref[h] = m_new

  @pl.when(j == num_chunks - 1)
  def _():
    o_ref[...] = acc_ref[...] / l_ref[...]


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                     chunk: int, *, interpret: bool = False) -> jax.Array:
  """`attention.decode_attend` as a Pallas kernel (no `live_len`: each row stops at its own
  position).

  q: `[B, K, G, D]` (already scaled by 1/sqrt(D)); k_cache `[B, K, D, S]`, v_cache
  `[B, K, S, D]`; positions `[B]`: row b attends to cache indices `<= positions[b]`.
  chunk: positions per block (`decode_chunk`). Returns `[B, K, G, D]` float32.
  """
  b, kv, g, d = q.shape
  size = k_cache.shape[-1]
  c = decode_chunk(size, chunk, interpret)
  num_chunks = size // c

  def live(row, j, pos_ref):  # the chunk a step reads: past the row's position, its last one
    return jnp.minimum(j, jax.lax.div(pos_ref[row], c))  # lax.div: positions are >= 0

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, num_chunks),
      in_specs=[
          pl.BlockSpec((None, kv, g, d), lambda row, j, pos: (row, 0, 0, 0)),
          pl.BlockSpec((None, kv, d, c), lambda row, j, pos: (row, 0, 0, live(row, j, pos))),
          pl.BlockSpec((None, kv, c, d), lambda row, j, pos: (row, 0, live(row, j, pos), 0)),
      ],
      out_specs=pl.BlockSpec((None, kv, g, d), lambda row, j, pos: (row, 0, 0, 0)),
      scratch_shapes=[pltpu.VMEM((kv, g, 1), jnp.float32), pltpu.VMEM((kv, g, 1), jnp.float32),
                      pltpu.VMEM((kv, g, d), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_decode_kernel, c=c, num_chunks=num_chunks),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, kv, g, d), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
  )(positions.astype(jnp.int32), q, k_cache, v_cache)
