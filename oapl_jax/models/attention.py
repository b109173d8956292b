"""Attention kernels of the transformer: the full forward pass's blockwise causal attention
and the decode step's attention of one query over a KV cache.

* `causal_attention(q, k, v, block)`: causal grouped-query attention over a whole sequence
  (training, log-probs, prefill), blockwise: an online softmax over blocks of `block`
  positions (`attn_block`), blocks above the causal diagonal skipped, no `[T, T]` tensor, and
  a hand-written blockwise gradient (`_flash`, a `jax.custom_vjp`: FlashAttention-2's
  backward). On a GPU with a 16-bit dtype, cuDNN's fused kernel instead.
  With `segment_ids` (packed rows: several sequences back to back in one row) a query attends
  only to keys of its own segment, and the blockwise code also skips the key blocks that lie
  wholly before the query block's segments (one row at a time, so each row skips its own).
* `decode_attend(q, k_cache, v_cache, positions, live_len, chunk)`: attention of one query
  per row over a KV cache (layout: `oapl_jax.models.kv_cache.init_cache`), reading the cache
  in chunks of `chunk` positions, only up to `live_len`, so a step costs what the live length
  needs, not the cache size (used by `oapl_jax.sampling.decode.decode`).

bfloat16 parity (issue 13): both compute the same arithmetic, so the trainer's log-probs match
the engine's: q arrives scaled by 1/sqrt(D) in the compute dtype, scores and PV with float32
accumulation, a float32 online softmax with unnormalised probabilities cast to the value
dtype, the same chunked arithmetic (`_online_update`). Key blocks of the forward pass
(`attn_block`) and decode chunks (`sampling.attn_chunk`) of different lengths round the
probabilities against different running maxima: equal lengths (or sequences shorter than
both) give the closest numbers.

Kernels by backend (`attention_impl`, the setting `config.model.attention_kernel`, carried in
`ModelConfig.attention_kernel`): on TPU ("auto" there, or "pallas") the causal pass runs JAX's
Pallas splash-attention kernel and the decode step a Pallas decode kernel of this project
(`pallas_attention.py`); on CPU and GPU ("auto" there, or "xla") the blockwise code below.
"pallas_interpret" runs the Pallas kernels in interpret mode on any backend (the CPU tests).
Segment ids reach every kernel: the blockwise code masks and skips by them (also on GPU: cuDNN's
kernel in `jax.nn.dot_product_attention` takes no segment ids, only a dense mask, so packed
rows run the blockwise code there), the splash kernel takes them natively (`SegmentIds`).
The Pallas kernels compute the same attention to float32 rounding but not bit for bit the
blockwise numbers (their own block order), so bfloat16 parity between the trainer and the
engine holds within a backend's choice, not across a mix of the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from oapl_jax.models.pallas_names import ATTENTION_KERNELS


# --- Which code runs: `config.model.attention_kernel` ---------------------------------------


def attention_impl(setting: str) -> str:
  """The attention code a `config.model.attention_kernel` value selects: "xla" (the blockwise
  code of this module), "pallas" (the Pallas TPU kernels) or "pallas_interpret" (those kernels
  in interpret mode). "auto" is "pallas" when the devices the model runs on (`jax.devices()`,
  read when the program is traced) are TPUs, else "xla": a program compiled for TPU ahead of
  time on a CPU host sees CPU devices, so such a caller sets "pallas" itself."""
  if setting not in ATTENTION_KERNELS:
    raise ValueError(f"attention kernel {setting!r} is not one of {ATTENTION_KERNELS}")
  if setting == "auto":
    return "pallas" if jax.devices()[0].platform == "tpu" else "xla"
  return setting


def _over_mesh(fn, specs: tuple, out_spec):
  """fn, under `jax.shard_map` over the mesh set by `jax.set_mesh` (if any, of more than one
  device) with these in / out PartitionSpecs: a Pallas (Mosaic) call is one opaque custom call
  that XLA cannot partition (sharded operands without shard_map are a compile error); under
  shard_map each device runs it on its own block. Specs that differ from the operands'
  shardings cost a reshard, never a wrong number. Without a mesh: fn itself (one device; a
  program sharded without a mesh set, as the engine's with sampling.tensor > 1, does not
  compile: docs/design.md)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn
  return jax.shard_map(fn, in_specs=specs, out_specs=out_spec, check_vma=False)


def _axes_dividing(names, dim: int):
  """The mesh axes among `names` (of the current mesh) whose sizes' product divides `dim`,
  as a PartitionSpec entry (None if there are none)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes, size = [], 1
  for name in names:
    if name in mesh.axis_names and dim % (size * mesh.shape[name]) == 0:
      axes.append(name)
      size *= mesh.shape[name]
  return tuple(axes) or None


# --- Blockwise causal attention (the full forward pass) ------------------------------------

DEFAULT_ATTN_BLOCK = 512  # `attn_block=None`: query/key block length (config.train.attn_block's default)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = DEFAULT_ATTN_BLOCK,
                     *, segment_ids: jax.Array | None = None, fused: bool = True,
                     kernel: str = "auto", batch_axes=None) -> jax.Array:
  """Causal grouped-query attention, blockwise (online softmax): no `[T, T]` tensor.

  q: `[B, T, N, D]` ALREADY SCALED by 1/sqrt(D) (in the compute dtype, as the decode path
  scales it); k, v: `[B, T, K, D]`, N a multiple of K. Returns `[B, T, N, D]` in q's dtype.

  Query and key blocks of `C = min(block, T)` positions (the last one shorter if C does not divide T):
  query block i visits key blocks 0..i only (blocks above the diagonal are skipped, not
  masked; a `[C, C]` causal mask only inside the diagonal block), with the engine's
  `decode_attend` arithmetic: scores `q k` with float32 accumulation, a float32 online
  softmax, unnormalised probabilities cast to v's dtype for the PV dot (float32
  accumulation), the float32 sum divided out at the end. Memory O(C^2) per head group per
  block, O(T) saved for the backward pass (a hand-written blockwise gradient, `_flash`).

  segment_ids: None (one sequence per row: the code above, nothing added), or `[B, T]` int,
  packed rows: query i attends key j iff j <= i and `segment_ids[b, i] == segment_ids[b, j]`.
  Each segment must be one contiguous run of positions (an id is not reused further along
  the row; the packer's rows: ids increasing, trailing padding as a segment of its own, id 0,
  which attends only to itself). Scores are masked by segment in every visited block, and
  key blocks that end before the start of the segment of a query block's first query are
  skipped, not masked (`_first_key_blocks`), forward and backward; the rows run one at a time
  (`lax.map`, so each row skips its own blocks; under a mesh each device maps over its own
  rows, `batch_axes`).

  fused: on a GPU backend with a 16-bit dtype and no segment_ids, use cuDNN's fused causal
  kernel (`jax.nn.dot_product_attention(implementation="cudnn")`: the same blockwise
  algorithm with its own block sizes; it takes no segment ids). Everywhere else (CPU, TPU,
  float32, packed rows) the pure-JAX path runs, unless:

  kernel: a `config.model.attention_kernel` value (`attention_impl`); "pallas" (TPU, and
  "auto" on TPU) or "pallas_interpret": the splash kernel instead
  (`pallas_attention.splash_causal_attention`, its own block sizes: `block` is not used).
  Under a mesh (`jax.set_mesh`) the kernel runs per device over `shard_map`: rows split over
  batch_axes (mesh axis names, e.g. the trainer's activation rows' ("data", "fsdp"); None =
  not split) and heads over "tensor" where it divides K.
  """
  b, t, n, d = q.shape
  kv = k.shape[2]
  impl = attention_impl(kernel)
  heads = _axes_dividing(("tensor",), kv)  # under a mesh: the kernels' heads over "tensor"
  if impl != "xla":
    from oapl_jax.models.pallas_attention import splash_causal_attention  # noqa: PLC0415
    spec = P(batch_axes, None, heads, None)
    fn = functools.partial(splash_causal_attention, interpret=impl == "pallas_interpret")
    if segment_ids is None:
      return _over_mesh(fn, (spec, spec, spec), spec)(q, k, v)
    return _over_mesh(fn, (spec, spec, spec, P(batch_axes, None)), spec)(q, k, v, segment_ids)
  if (fused and segment_ids is None and jax.default_backend() == "gpu"
      and q.dtype in (jnp.bfloat16, jnp.float16)):
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation="cudnn")
  c = min(block, t)
  # head-major once per layer (the blocks' products then need no transposes; below)
  q = q.reshape(b, t, kv, n // kv, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
  if segment_ids is None:
    out = _flash(q, k, v, None, c)  # [B, K, G, T, D]
  else:
    rows = functools.partial(_flash_by_row, c=c)
    q_spec, kv_spec = P(batch_axes, heads, None, None, None), P(batch_axes, heads, None, None)
    out = _over_mesh(rows, (q_spec, kv_spec, kv_spec, P(batch_axes, None)), q_spec)(
        q, k, v, segment_ids.astype(jnp.int32))  # [B, K, G, T, D]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)


def _online_update(carry, s: jax.Array, pv):
  """One key chunk of the online softmax (shared by the forward pass and `decode_attend`).

  carry: running max m `[..., Q]`, sum l `[..., Q]`, output acc `[..., Q, D]`, all float32;
  s: this chunk's scores `[..., Q, C]` float32 (-inf where masked; the running max must be
  finite after the update); pv(p): p `[..., Q, C]` float32 -> `[..., Q, D]` float32.
  """
  m, l, acc = carry
  m_new = jnp.maximum(m, s.max(-1))
  corr = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[..., None])
  return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv(p)


# The blockwise kernels work head-major: q `[B, K, G, T, D]`, k, v `[B, K, T, D]` (positions
# on the second-minor axis), so every block product is a plain batched matmul over (B, K) and
# a block is a contiguous slice. (Position-major blocks, `[B, C, K, G, D]`, made XLA:CPU
# transpose q, k, v and the probabilities inside every block pair: the whole train step at
# 8 x 2080 tokens was 1.5x slower, `benchmarks/train_step.py`.)


def _block(x: jax.Array, i, c: int) -> jax.Array:
  """Positions `[i*c, (i+1)*c)` of x along its position axis (second-minor)."""
  return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=x.ndim - 2)


def _scores(qi: jax.Array, kj: jax.Array, mask: jax.Array | None) -> jax.Array:
  """qi `[B, K, G, Cq, D]`, kj `[B, K, Ck, D]` -> `[B, K, G, Cq, Ck]` float32; -inf off `mask`
  (any shape broadcasting to the scores': `[Cq, Ck]`, or `[B, 1, 1, Cq, Ck]` by segment)."""
  s = jnp.einsum("bkgqd,bkcd->bkgqc", qi, kj, preferred_element_type=jnp.float32)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


# --- Packed rows: segment masks and the key blocks a query block can skip ------------------


def _same_segment(seg_q: jax.Array, seg_k: jax.Array) -> jax.Array:
  """seg_q `[B, Cq]`, seg_k `[B, Ck]` -> `[B, 1, 1, Cq, Ck]` bool: the query's and the key's
  segments are equal (the scores' mask, broadcast over heads)."""
  return (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]


def _and(mask: jax.Array | None, seg_mask: jax.Array | None) -> jax.Array | None:
  """Both masks (either may be None: no mask)."""
  if seg_mask is None:
    return mask
  return seg_mask if mask is None else mask & seg_mask


def _first_key_blocks(seg: jax.Array, c: int) -> jax.Array:
  """`[ceil(T / c)]` int32: for each query block of c positions, the first key block any of
  its queries may see: the block holding the start of the segment of its first query
  (segments are contiguous runs, so its later queries' segments start no earlier), the
  smallest over rows. Key blocks before it lie wholly in other segments of every row: skipped.

  seg `[B, T]` int (`causal_attention`'s segment_ids)."""
  b, t = seg.shape
  new_run = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)  # [B, T]
  start = jax.lax.cummax(jnp.where(new_run, jnp.arange(t), 0), axis=1)  # [B, T] its segment's first position
  return (start[:, ::c].min(0) // c).astype(jnp.int32)  # [ceil(T / c)]


# The running max's start of the online softmax: -inf without segments (every visited key block
# holds keys each query sees); with segments a query may meet a key block holding none of its own
# segment (all its scores -inf), and a finite start keeps exp(m - m_new) = exp(0) there, not NaN.
def _max_init(seg) -> float:
  return -jnp.inf if seg is None else float(jnp.finfo(jnp.float32).min)


def _flash_forward(q, k, v, seg, c: int):
  """q `[B, K, G, T, D]`, k, v `[B, K, T, D]`, seg None or segment ids `[B, T]` int32
  (`causal_attention`). Returns out `[B, K, G, T, D]` (q's dtype) and the float32
  log-sum-exp of each query's scores `[B, K, G, T]`.

  T = nb * c + r: nb whole blocks of c positions, then (r > 0) one short last block of r
  positions, whose queries see the nb whole key blocks and an r x r diagonal block (nothing
  padded: padding T up to a multiple of c cost up to twice the pairs, e.g. 2080 -> 2560).
  Query block i visits key blocks first..i-1 and its diagonal block: first = 0, or with
  segments `_first_key_blocks`."""
  b, kv, g, t, d = q.shape
  nb, r = divmod(t, c)
  first = None if seg is None else _first_key_blocks(seg, c)  # [nb + (r > 0)]
  seg_block = lambda lo, n: jax.lax.dynamic_slice_in_dim(seg, lo, n, axis=1)  # noqa: E731  [B, n]

  def attend(qi, i, kd, vd):
    """Queries qi `[B, K, G, Q, D]` (positions i*c..i*c+Q-1) against key blocks first..i-1
    (whole) and the Q diagonal keys kd, vd `[B, K, Q, D]` (causal mask).
    -> out `[B, K, G, Q, D]`, lse `[B, K, G, Q]`."""
    rows = qi.shape[3]
    seg_i = None if seg is None else seg_block(i * c, rows)  # [B, Q]

    def step(carry, kj, vj, mask=None):
      pv = lambda p: jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(vj.dtype), vj,
                                preferred_element_type=jnp.float32)
      return _online_update(carry, _scores(qi, kj, mask), pv)

    def off_diagonal(j, carry):
      seg_mask = None if seg is None else _same_segment(seg_i, seg_block(j * c, c))
      return step(carry, _block(k, j, c), _block(v, j, c), seg_mask)

    init = (jnp.full((b, kv, g, rows), _max_init(seg)), jnp.zeros((b, kv, g, rows)),
            jnp.zeros((b, kv, g, rows, d)))
    carry = jax.lax.fori_loop(0 if seg is None else first[i], i, off_diagonal, init)
    diagonal = jnp.tril(jnp.ones((rows, rows), bool))
    m, l, acc = step(carry, kd, vd, _and(diagonal, None if seg is None else _same_segment(seg_i, seg_i)))
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  outs, lses = [], []
  if nb:
    out, lse = jax.lax.map(lambda i: attend(_block(q, i, c), i, _block(k, i, c), _block(v, i, c)),
                           jnp.arange(nb))  # [nb, B, K, G, C, D], [nb, B, K, G, C]
    outs.append(jnp.moveaxis(out, 0, 3).reshape(b, kv, g, nb * c, d))
    lses.append(jnp.moveaxis(lse, 0, 3).reshape(b, kv, g, nb * c))
  if r:
    out, lse = attend(q[:, :, :, nb * c:], nb, k[:, :, nb * c:], v[:, :, nb * c:])
    outs.append(out)
    lses.append(lse)
  return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, c: int):
  """Blockwise causal attention `_flash_forward` (out only) with a blockwise gradient; seg:
  None, or segment ids `[B, T]` int32 (no gradient)."""
  return _flash_forward(q, k, v, seg, c)[0]


def _flash_fwd(q, k, v, seg, c: int):
  out, lse = _flash_forward(q, k, v, seg, c)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(c: int, res, d_out):
  """FlashAttention-2's backward: probabilities recomputed block by block from the saved
  log-sum-exp; dq per query block, dk / dv accumulated in float32 over query blocks (the
  forward pass's blocks: nb whole ones, then the short last one; with segments, the same key
  blocks skipped and the same masks).

  dk and dv are accumulated transposed, `[B, K, D, T]`: their block products then contract
  the probabilities `[B, K, G, Q, C]` over (G, Q) where they lie (`d_out^T p`), and XLA:CPU
  transposes the small `[G*Q, D]` operand instead of copying p and ds in every block pair;
  one transpose of dk, dv at the end (the train step 10-14% faster at 8 x 2080 tokens and
  about 10% at 8 x 544, unchanged within noise at 160; equal to float32 rounding)."""
  q, k, v, seg, out, lse = res
  t = q.shape[3]
  nb, r = divmod(t, c)
  first = None if seg is None else _first_key_blocks(seg, c)  # [nb + (r > 0)]
  delta = jnp.einsum("bkgtd,bkgtd->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))  # [B, K, G, T]

  def grads(lo, rows, i, dkt, dvt):
    """Queries [lo, lo + rows) against key blocks first..i-1 and their diagonal block: dq of
    those rows `[B, K, G, rows, D]` float32, dk and dv transposed `[B, K, D, T]` float32
    accumulated."""
    part = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, rows, axis=3)  # noqa: E731
    qi, doi = part(q), part(d_out)  # [B, K, G, rows, D]
    lse_i, delta_i = part(lse)[..., None], part(delta)[..., None]  # [B, K, G, rows, 1]
    seg_i = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, lo, rows, axis=1)  # [B, rows]

    def step(carry, k_lo, n, mask=None):  # keys [k_lo, k_lo + n)
      dqi, dkt, dvt = carry
      kj, vj = (jax.lax.dynamic_slice_in_dim(x, k_lo, n, axis=2) for x in (k, v))  # [B, K, n, D]
      if seg is not None:
        mask = _and(mask, _same_segment(seg_i, jax.lax.dynamic_slice_in_dim(seg, k_lo, n, axis=1)))
      p = jnp.exp(_scores(qi, kj, mask) - lse_i)  # [B, K, G, rows, n]
      dp = jnp.einsum("bkgqd,bkcd->bkgqc", doi, vj, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_i)).astype(q.dtype)
      dvt_j = jnp.einsum("bkgqd,bkgqc->bkdc", doi, p.astype(v.dtype), preferred_element_type=jnp.float32)
      dkt_j = jnp.einsum("bkgqd,bkgqc->bkdc", qi, ds, preferred_element_type=jnp.float32)
      dqi = dqi + jnp.einsum("bkgqc,bkcd->bkgqd", ds, kj, preferred_element_type=jnp.float32)
      add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
          acc, jax.lax.dynamic_slice_in_dim(acc, k_lo, n, axis=3) + x, k_lo, axis=3)
      return dqi, add(dkt, dkt_j), add(dvt, dvt_j)

    carry = jax.lax.fori_loop(0 if seg is None else first[i], i, lambda j, cr: step(cr, j * c, c),
                              (jnp.zeros(qi.shape, jnp.float32), dkt, dvt))
    return step(carry, lo, rows, jnp.tril(jnp.ones((rows, rows), bool)))

  def whole_block(i, acc):
    dq, dkt, dvt = acc
    dqi, dkt, dvt = grads(i * c, c, i, dkt, dvt)
    return jax.lax.dynamic_update_slice_in_dim(dq, dqi, i * c, axis=3), dkt, dvt

  transposed = lambda x: jnp.zeros((*x.shape[:2], x.shape[3], x.shape[2]), jnp.float32)  # noqa: E731
  dq, dkt, dvt = jax.lax.fori_loop(0, nb, whole_block,
                                   (jnp.zeros(q.shape, jnp.float32), transposed(k), transposed(v)))
  if r:
    dqi, dkt, dvt = grads(nb * c, r, nb, dkt, dvt)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, dqi, nb * c, axis=3)
  return (dq.astype(q.dtype), dkt.swapaxes(2, 3).astype(k.dtype), dvt.swapaxes(2, 3).astype(v.dtype),
          None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _flash_by_row(q, k, v, seg, c: int):
  """`_flash` with segment ids, one row at a time (`lax.map` over B): each row's loops start
  at its own first key blocks (a batched loop would start at the smallest over rows).
  q `[B, K, G, T, D]`, k, v `[B, K, T, D]`, seg `[B, T]` int32 -> `[B, K, G, T, D]`."""
  return jax.lax.map(lambda row: _flash(*(x[None] for x in row), c)[0], (q, k, v, seg))


# --- Attention of one query over a KV cache (the decode step) -----------------------------


def decode_attend(q, k_cache, v_cache, positions, live_len, chunk: int, *,
                  kernel: str = "auto") -> jax.Array:
  """Attention of one query per row over a KV cache, chunk by chunk up to `live_len`.

  q: `[B, K, G, D]` (already scaled by 1/sqrt(D)); k_cache `[B, K, D, S]`, v_cache
  `[B, K, S, D]`; positions `[B]`: row b attends to indices `<= positions[b]`; live_len:
  int `[]`, every row's positions are `< live_len`. Chunks of `C = min(chunk, S)` positions;
  chunk 0 always runs, the others (online softmax) only while `c * C < live_len`.
  Returns `[B, K, G, D]` float32.

  kernel: a `config.model.attention_kernel` value (`attention_impl`); "pallas" (TPU, and
  "auto" on TPU) or "pallas_interpret": the Pallas decode kernel instead
  (`pallas_attention.decode_attention`: each row reads its own live prefix, chunks of
  `decode_chunk(S, chunk)` positions); under a mesh, per device with heads split over "tensor"
  where it divides K (the engine's cache sharding).
  """
  impl = attention_impl(kernel)
  if impl != "xla":
    from oapl_jax.models.pallas_attention import decode_attention  # noqa: PLC0415
    spec = P(None, _axes_dividing(("tensor",), q.shape[1]), None, None)
    fn = functools.partial(decode_attention, chunk=chunk, interpret=impl == "pallas_interpret")
    return _over_mesh(fn, (spec, spec, spec, P()), spec)(q, k_cache, v_cache, positions)
  size = k_cache.shape[-1]
  c_len = min(chunk, size)

  def scores(lo):  # -> scores [B, K, G, C] (masked), values [B, K, C, D]
    start = jnp.minimum(lo, size - c_len)  # the last chunk may overlap the one before ...
    k = jax.lax.dynamic_slice_in_dim(k_cache, start, c_len, axis=3)  # [B, K, D, C]
    v = jax.lax.dynamic_slice_in_dim(v_cache, start, c_len, axis=2)  # [B, K, C, D]
    s = jnp.einsum("bkgd,bkdc->bkgc", q, k, preferred_element_type=jnp.float32)
    idx = start + jnp.arange(c_len)  # ... so indices below `lo` are masked out
    mask = (idx[None, :] >= lo) & (idx[None, :] <= positions[:, None])  # [B, C]
    return jnp.where(mask[:, None, None], s, -jnp.inf), v

  def pv(p, v):  # [B, K, G, C] x [B, K, C, D] -> [B, K, G, D]
    return jnp.einsum("bkgc,bkcd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)

  s, v = scores(0)  # index 0 is always visible, so every row has a finite max
  m = s.max(-1)  # [B, K, G]
  p = jnp.exp(s - m[..., None])
  carry = (m, p.sum(-1), pv(p, v))

  def body(c, carry):
    s, v = scores(c * c_len)
    return _online_update(carry, s, lambda p: pv(p, v))

  num_chunks = (live_len + c_len - 1) // c_len
  _, l, acc = jax.lax.fori_loop(1, num_chunks, body, carry)
  return acc / l[..., None]
