"""A decoder-only transformer of the Qwen3 / Qwen2 / Llama family, in Flax NNX.

Blocks: RMSNorm -> grouped-query attention with RoPE (optional QK-norm, optional
qkv bias) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head
(optionally tied to the embedding).

This module holds the architecture (`ModelConfig`), its layers, norms and RoPE, and the
forward pass with its per-block remat; the attention kernels are in `attention.py`, the
engine's KV cache in `kv_cache.py`.

Entry points (all share every weight and every layer):
* `model(tokens)` — full causal forward pass, logits `[B, T, V]` (training, log-probs).
  With `return_kv=True` it also returns each layer's keys and values. With
  `segment_ids` `[B, T]` (and positions restarting in each segment) a row holds several
  sequences packed back to back, attention never crossing a segment (the trainer's packed rows). Attention is
  blockwise (`attention.causal_attention`: online softmax over blocks of `attn_block`
  positions, blocks above the causal diagonal skipped, no `[T, T]` tensor, a blockwise custom
  gradient; on TPU the Pallas splash kernel, `ModelConfig.attention_kernel`), and each transformer block runs under a remat policy (`REMAT_POLICIES`: "none" /
  "dots" / "full", `config.train.remat`); with remat, the blocks are one `lax.scan` over the
  layers' weights stacked in the compute dtype (`_scan_blocks`: on XLA:CPU only a scan keeps
  the saved activations to one input per layer; with "full" and no keys/values, the trainer's
  pass, the stack holds the compute dtype's bits and the backward is written out:
  `_full_remat_scan`).
* `model.prefill(tokens, lengths)` — the forward pass with the LM head only at each prompt's
  last token, plus every layer's keys and values (the sampling engine's prefill).
* The one-token decode step is `oapl_jax.sampling.decode.decode`, over the engine's weight
  layout (fused q/k/v and gate/up matrices split by whole heads, `sampling/layout.py`); it
  uses this module's layers, norms, RoPE (`rope_table`, `apply_rope`) and LM head,
  `attention.decode_attend` (attention of one query per row, reading the cache in chunks of
  `chunk` positions, only up to `live_len`, so a step costs what the live length needs, not
  the cache size) and the KV cache of `kv_cache.py` (`init_cache`, `write_prefix`; its layout
  is described there).

bfloat16 parity (issue 13): the forward pass computes what the decode step computes, so the
trainer's log-probs match the engine's: q scaled by 1/sqrt(D) in the compute dtype before the
score dot, then the attention arithmetic `attention.py` shares between both (float32
accumulation, a float32 online softmax, `_online_update`; see its docstring for block and
chunk lengths); RMSNorm weights rounded to the compute dtype (float32 master weights = the
bf16 snapshot); RoPE frequencies and tables computed on the host (the same bits in every
compiled program).

Every weight carries `logical_axes` metadata (e.g. `("embed", "mlp")`); one table in the
config maps logical axes to mesh axes (see `oapl_jax.sharding`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.models.attention import DEFAULT_ATTN_BLOCK, causal_attention
from oapl_jax.models.names import ROPE_SCALING_TYPES, dtype_name
from oapl_jax.models.pallas_names import ATTENTION_KERNELS
from oapl_jax.models.quant import is_qarray


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of the transformer. Field meanings follow Hugging Face's Qwen3 config."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  qk_norm: bool = True  # Qwen3: RMSNorm on each head's queries and keys.
  qkv_bias: bool = False  # Qwen2: bias on the q, k, v projections.
  tie_embeddings: bool = True  # LM head reuses the embedding matrix.
  # Dtypes: a name in DTYPE_NAMES or a NumPy/JAX dtype (jnp.bfloat16), stored as its name.
  param_dtype: str = "float32"  # Storage dtype of the weights.
  dtype: str = "float32"  # Compute dtype of matmuls (logits are always float32).
  # RoPE scaling (Llama-3.1). None = plain RoPE; "llama3" = Hugging Face's "llama3" rope type,
  # which divides the low frequencies by `rope_scaling_factor` and interpolates the middle band.
  rope_scaling_type: str | None = None
  rope_scaling_factor: float = 1.0  # "factor"
  rope_low_freq_factor: float = 1.0  # "low_freq_factor"
  rope_high_freq_factor: float = 4.0  # "high_freq_factor"
  rope_original_max_len: int = 8192  # "original_max_position_embeddings"
  max_position_embeddings: int | None = None  # Context length of the checkpoint; informational.
  # Not architecture: which attention code runs (`attention.attention_impl`; values
  # `pallas_names.ATTENTION_KERNELS`): "auto" = the Pallas TPU kernels on TPU, else blockwise.
  attention_kernel: str = "auto"

  def architecture(self) -> dict:
    """The fields a checkpoint or an offline file records and is checked against: all but
    `attention_kernel` (which code computes attention, not what the model is)."""
    fields = dataclasses.asdict(self)
    fields.pop("attention_kernel")
    return fields

  def __post_init__(self):
    for field in ("param_dtype", "dtype"):  # frozen: set through object.__setattr__
      object.__setattr__(self, field, dtype_name(getattr(self, field), f"model.{field}"))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads}")
    if self.attention_kernel not in ATTENTION_KERNELS:
      raise ValueError(f"model.attention_kernel={self.attention_kernel!r} is not one of "
                       f"{ATTENTION_KERNELS}")
    if self.rope_scaling_type not in ROPE_SCALING_TYPES:
      raise ValueError(
          f"model.rope_scaling_type={self.rope_scaling_type!r} is not supported; "
          f"use one of {ROPE_SCALING_TYPES}")
    if self.rope_scaling_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(
          f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
          f"model.rope_low_freq_factor={self.rope_low_freq_factor}")

  @classmethod
  def from_config(cls, cfg) -> "ModelConfig":
    """Builds from an ml_collections `config.model` section (ignores non-architecture keys)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in cfg.items() if k in names})


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
  """A normal(0, scale) weight with logical axis names; scale defaults to 1/sqrt(fan_in).

  The barrier keeps XLA from folding `scale` into the normal's own constants when init runs
  under `jax.jit` (a sharded init): the weights are then bit-identical to an eager init.
  """
  scale = shape[0] ** -0.5 if scale is None else scale
  value = scale * jax.lax.optimization_barrier(jax.random.normal(rngs.params(), shape, jnp.float32))
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * weight, computed in float32 from the weight rounded to x's dtype (so
  float32 master weights and the engine's bfloat16 copy give the same numbers)."""

  def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
    self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = self.weight[...].astype(x.dtype).astype(jnp.float32)  # as the compute-dtype snapshot has it
    return (x32 * w).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies `[D/2]` float32 of the config's RoPE (plain or "llama3"-scaled).

  Computed on the host in float64 and rounded once (a NumPy constant): the same bits in
  every compiled program (XLA's own `pow`, constant-folded in one program and evaluated in
  another, differs in the last bits, and RoPE tables that differ between the trainer and
  the engine flip bfloat16 roundings everywhere downstream).
  The "llama3" branch follows `transformers.modeling_rope_utils._compute_llama3_parameters`.
  """
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) / half))  # [D/2]
  if cfg.rope_scaling_type == "llama3":
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(is_medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
  """cos, sin `[B, T, 1, D/2]` float32 of positions `[B, T]` (computed once, shared by layers).

  Traced positions use XLA's cos/sin; the forward pass at positions `arange(T)` and the
  engine's decode table use `rope_table_host` (the same bits in every program).
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope_table_host(cfg: ModelConfig, size: int) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin `[size, D/2]` float32 of positions `0..size-1`, computed on the host: angle =
  position x inverse frequency rounded to float32 (as `rope_tables` computes it), cos / sin
  in float64 rounded once. A NumPy constant, identical in every compiled program."""
  angles = np.arange(size, dtype=np.float32)[:, None] * rope_frequencies(cfg)  # [size, D/2] float32
  angles = angles.astype(np.float64)
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding, Hugging Face "rotate half" layout. x `[B, T, N, D]` -> `[B, T, N, D]`."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


ADAPTER_SUFFIX = "_lora"  # a projection's low-rank adapter: attribute `q_proj_lora` beside `q_proj`


def adapted(module: nnx.Module, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """y, the projection `target` of x (any shape with x's leading dims), plus the output of its
  low-rank adapter when `module` has one (`models/lora.py`); else y itself, no op added."""
  adapter = getattr(module, target + ADAPTER_SUFFIX, None)
  if adapter is None:
    return y
  return y + adapter(x).reshape(y.shape)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optional QK-norm and qkv bias."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    p, d = cfg.param_dtype, cfg.hidden_size
    self.cfg = cfg
    self.q_proj = _param(rngs, (d, cfg.num_heads, cfg.head_dim), ("embed", "q_heads", "head_dim"), p)
    self.k_proj = _param(rngs, (d, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), p)
    self.v_proj = _param(rngs, (d, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), p)
    self.o_proj = _param(rngs, (cfg.num_heads, cfg.head_dim, d), ("q_heads", "head_dim", "embed"), p,
                         scale=(cfg.num_heads * cfg.head_dim) ** -0.5)
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((cfg.num_heads, cfg.head_dim), p), logical_axes=("q_heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((cfg.num_kv_heads, cfg.head_dim), p), logical_axes=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((cfg.num_kv_heads, cfg.head_dim), p), logical_axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, p, "head_dim")
      self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, p, "head_dim")

  def project_qkv(self, x: jax.Array, rope_cs: tuple[jax.Array, jax.Array]):
    """x: `[B, T, E]`, rope_cs: `rope_tables` -> q `[B, T, N, D]`, k, v `[B, T, K, D]` (RoPE applied).

    (The decode step's version over fused weights: `sampling.decode._project_qkv`.)
    """
    dt = x.dtype
    q = adapted(self, "q_proj", x, jnp.einsum("bte,end->btnd", x, self.q_proj[...].astype(dt)))
    k = adapted(self, "k_proj", x, jnp.einsum("bte,ekd->btkd", x, self.k_proj[...].astype(dt)))
    v = adapted(self, "v_proj", x, jnp.einsum("bte,ekd->btkd", x, self.v_proj[...].astype(dt)))
    if self.cfg.qkv_bias:
      q, k, v = q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt), v + self.v_bias[...].astype(dt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, *rope_cs), apply_rope(k, *rope_cs), v

  def output(self, attn: jax.Array) -> jax.Array:
    """attn: `[B, T, N, D]` -> `[B, T, E]` (one `[N*D, E]` matmul)."""
    b, t, n, d = attn.shape
    w = self.o_proj[...].astype(attn.dtype).reshape(n * d, -1)  # [N*D, E]
    attn = attn.reshape(b, t, n * d)
    return adapted(self, "o_proj", attn, attn @ w)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    p = cfg.param_dtype
    self.gate_proj = _param(rngs, (cfg.hidden_size, cfg.mlp_dim), ("embed", "mlp"), p)
    self.up_proj = _param(rngs, (cfg.hidden_size, cfg.mlp_dim), ("embed", "mlp"), p)
    self.down_proj = _param(rngs, (cfg.mlp_dim, cfg.hidden_size), ("mlp", "embed"), p)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x `[B, T, E]` -> `[B, T, E]`. (The decode step's version over fused weights:
    `sampling.decode._mlp`.)

    gate and up as one matmul over their weights stacked `[E, 2, F]` (stacked on a new axis,
    so an "mlp"-sharded F stays sharded and no weight moves between devices): one product
    forward, one for the input gradient and one for both weight gradients (10% faster train
    step at 32 x 160 tokens on CPU; `benchmarks/train_step.py`)."""
    dt = x.dtype
    w = jnp.stack([self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt)], axis=1)  # [E, 2, F]
    gate_up = jnp.einsum("bte,eaf->btaf", x, w)  # [B, T, 2, F]
    gate, up = adapted(self, "gate_proj", x, gate_up[..., 0, :]), adapted(self, "up_proj", x, gate_up[..., 1, :])
    h = jax.nn.silu(gate) * up  # [B, T, F]
    return adapted(self, "down_proj", h, h @ self.down_proj[...].astype(dt))


class Block(nnx.Module):
  """One pre-norm transformer layer."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, rope_cs, attn_block: int, rows=None, segment_ids=None):
    """Causal pass over x `[B, T, E]`; rope_cs: `rope_tables` of the positions; attention in
    blocks of `attn_block` positions (`causal_attention`). rows: optional sharding of the
    rows of `[B, T, E]` activations (see `Transformer.__call__`); segment_ids: None or
    `[B, T]` int32, packed rows (attention within a segment only; `Transformer.__call__`).

    Returns (x, (k, v)), k, v `[B, T, K, D]`.
    """
    pin = (lambda a: a) if rows is None else (lambda a: jax.lax.with_sharding_constraint(a, rows))  # noqa: E731
    q, k, v = self.attn.project_qkv(self.input_norm(x), rope_cs)  # [B, T, N|K, D]
    q = q * q.shape[-1] ** -0.5  # in the compute dtype, as `decode` scales it
    batch_axes = None if rows is None else getattr(rows, "spec", rows)[0]  # the Pallas kernel's rows
    out = causal_attention(q, k, v, attn_block, segment_ids=segment_ids,
                           kernel=self.attn.cfg.attention_kernel, batch_axes=batch_axes)  # [B, T, N, D]
    x = pin(x + pin(self.attn.output(out)))
    x = pin(x + pin(self.mlp(self.post_attn_norm(x))))
    return x, (k, v)


# What a block keeps for the backward pass (`config.train.remat`): every activation, only the
# outputs of weight matmuls (the rest recomputed), or only its input (all recomputed).
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _scan_blocks(layers: list[Block], x, rope_cs, attn_block: int, remat: str, rows=None,
                 return_kv: bool = True, segment_ids=None):
  """The blocks over x `[B, T, E]` as one `lax.scan` over their weights, each step one block
  under `jax.checkpoint(policy=REMAT_POLICIES[remat])`; rope_cs, rows, segment_ids: as `Block`
  takes them.

  The weights are cast to x's dtype (the compute dtype: every block rounds its weights to it
  before use, so the numbers are those of the plain loop) and stacked, `[L, ...]` per weight.
  A scan keeps one `[B, T, E]` input per layer for the backward pass and recomputes one
  block at a time; the same blocks unrolled under `jax.checkpoint` let XLA (CPU) keep far
  more alive (see docs/memory.md).
  Returns (x `[B, T, E]`, list over layers of (k, v) `[B, T, K, D]`; empty unless return_kv).
  """
  graphdef = nnx.graphdef(layers[0])
  if remat == "full" and not return_kv:  # the trainer's memory-lean path (below)
    splits = [_split_trainable(layer) for layer in layers]
    return _full_remat_scan((splits[0][0], attn_block, rows), x, [s[1] for s in splits],
                            [s[2] for s in splits], rope_cs, segment_ids), []
  states = [jax.tree.map(lambda w: w if is_qarray(w) else w.astype(x.dtype), nnx.state(layer),
                         is_leaf=is_qarray) for layer in layers]  # a QArray keeps its int8 and scale
  stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *states)  # [L, ...] per weight

  def step(x, state):
    x, kv = nnx.merge(graphdef, state)(x, rope_cs, attn_block, rows, segment_ids)
    return x, (kv if return_kv else None)

  x, kvs = jax.lax.scan(jax.checkpoint(step, policy=REMAT_POLICIES[remat]), x, stacked)
  if not return_kv:
    return x, []
  return x, [(kvs[0][i], kvs[1][i]) for i in range(len(layers))]  # [L, B, T, K, D] -> per layer


# remat "full" without keys/values (the trainer's pass): the scan above with its backward
# written out. XLA:CPU keeps a stacked bfloat16 array in float32 (it normalises bf16 copies and
# dynamic slices to f32), so `_scan_blocks`' `[L, ...]` weights and their stacked gradient cost
# float32 bytes per layer; here both are stacked as the compute dtype's bits (unsigned ints,
# which no pass widens) and each layer's slice is viewed as the compute dtype again inside the
# scan. The forward scan keeps each block's input; the backward scan recomputes one block at
# a time from it (`jax.vjp`), as `jax.checkpoint(policy=nothing_saveable)` does. Same
# arithmetic as `_scan_blocks`; see docs/memory.md for the bytes.


def _as_bits(w: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(w, jnp.dtype(f"uint{8 * w.dtype.itemsize}"))


def _stack_bits(states, dtype) -> Any:
  """List over layers of weight pytrees -> one pytree of `[L, ...]` bits of the weights in `dtype`
  (a quantised base's `QArray`s are stacked as they are: int8 values and float32 scales, which no
  pass widens, read as `dtype` inside the block)."""
  def stack(*ws):
    if is_qarray(ws[0]):
      return jax.tree.map(lambda *xs: jnp.stack(xs), *ws)
    return jnp.stack([_as_bits(w.astype(dtype)) for w in ws])
  return jax.tree.map(stack, *states, is_leaf=is_qarray)


def _from_bits(bits, dtype) -> Any:
  return jax.tree.map(lambda b: b if is_qarray(b) else jax.lax.bitcast_convert_type(b, dtype), bits,
                      is_leaf=is_qarray)


def _no_gradient(w: jax.Array, shape) -> jax.Array:
  """The (zero) cotangent of a frozen weight leaf: float0 for integers (a QArray's values)."""
  if jnp.issubdtype(w.dtype, jnp.integer):
    return np.zeros(shape, jax.dtypes.float0)
  return jnp.zeros(shape, w.dtype)


def _split_trainable(layer: Block):
  """(graphdef, trained, frozen) weight states of a block: with low-rank adapters
  (`models/lora.py`) the adapters and the frozen base, else every weight and nothing."""
  graphdef, adapters, weights = nnx.split(layer, nnx.LoRAParam, ...)
  if jax.tree.leaves(adapters):
    return graphdef, adapters, weights
  return graphdef, weights, adapters


def _apply_block(static, x, state, frozen, rope_cs, segment_ids):
  graphdef, attn_block, rows = static
  return nnx.merge(graphdef, state, frozen)(x, rope_cs, attn_block, rows, segment_ids)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _full_remat_scan(static, x, states, frozen, rope_cs, segment_ids):
  """x `[B, T, E]` through the blocks `states` + `frozen` (lists over layers of weight states,
  any dtype, used in x's dtype; `_split_trainable`: the backward computes gradients of `states`
  only, `frozen`'s are zeros); static: (graphdef, attn_block, rows); segment_ids: None or
  `[B, T]` int32 (no gradient). Returns x after the last block."""
  return _full_remat_fwd(static, x, states, frozen, rope_cs, segment_ids)[0]


def _full_remat_fwd(static, x, states, frozen, rope_cs, segment_ids):
  bits, frozen_bits = _stack_bits(states, x.dtype), _stack_bits(frozen, x.dtype)
  step = lambda x, b: (_apply_block(static, x, *_from_bits(b, x.dtype), rope_cs, segment_ids), x)  # noqa: E731
  y, inputs = jax.lax.scan(step, x, (bits, frozen_bits))  # inputs: [L, B, T, E], each block's input
  dtypes = jax.tree.map(lambda w: jnp.zeros((), w.dtype), states[0])  # the master dtypes
  zeros = jax.tree.map(lambda w: jnp.zeros((), w.dtype), frozen)  # the frozen weights' (no) gradients
  return y, (bits, frozen_bits, inputs, rope_cs, segment_ids, dtypes, zeros)


def _full_remat_bwd(static, residuals, dy):
  bits, frozen_bits, inputs, rope_cs, segment_ids, dtypes, zeros = residuals
  dtype = inputs.dtype

  def step(dy, xs):
    b, f, x = xs
    frozen = _from_bits(f, dtype)
    _, vjp = jax.vjp(lambda x, w: _apply_block(static, x, w, frozen, rope_cs, segment_ids), x,
                     _from_bits(b, dtype))
    dx, dw = vjp(dy)
    return dx, jax.tree.map(_as_bits, dw)

  dx, dbits = jax.lax.scan(step, dy, (bits, frozen_bits, inputs), reverse=True)
  grads = _from_bits(dbits, dtype)  # [L, ...] per weight, in the compute dtype
  dstates = [jax.tree.map(lambda g, z: g[i].astype(z.dtype), grads, dtypes)
             for i in range(inputs.shape[0])]
  dfrozen = [jax.tree.map(lambda z, w: _no_gradient(z, w.shape[1:]), z, frozen_bits) for z in zeros]
  return dx, dstates, dfrozen, jax.tree.map(jnp.zeros_like, rope_cs), None


_full_remat_scan.defvjp(_full_remat_fwd, _full_remat_bwd)


class Transformer(nnx.Module):
  """Decoder-only LM. See the module docstring."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "vocab_embed"), cfg.param_dtype, scale=0.02)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("vocab_embed", "vocab"), cfg.param_dtype)

  def _embed(self, tokens: jax.Array, rows=None) -> jax.Array:
    """The embeddings `[B, T, E]` of `tokens`, in the compute dtype.

    rows: as in `__call__`. On a mesh of more than one device, the lookup reads the table split
    by its width E over every mesh axis (a re-layout of the vocab-split table: each device
    sends and receives 1/n of it), gathers its E-slice for every row (the token ids, int32,
    are all-gathered) and hands the rows to their devices (one all-to-all of a [B, T, E]
    activation). The table's gradient comes back the same way. Left to itself, XLA gathers
    the whole vocab-split table on every device and all-reduces a whole float32 gradient of it
    (`--dry_run=compile` shows it; tests/test_aot.py). The same values either way."""
    table = self.embed[...]
    mesh = getattr(rows, "mesh", None)
    if mesh is not None and mesh.size > 1:
      axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
      if self.cfg.hidden_size % math.prod(mesh.shape[a] for a in axes) == 0:
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, axes))
        x = jnp.take(jax.lax.with_sharding_constraint(table, split), tokens, axis=0)
        return jax.lax.with_sharding_constraint(x, rows).astype(self.cfg.dtype)
    return jnp.take(table, tokens, axis=0).astype(self.cfg.dtype)  # [B, T, E]

  def head_matrix(self) -> jax.Array:
    """The LM head `[E, V]` (the embedding transposed when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def _logits(self, x: jax.Array, head: jax.Array | None = None) -> jax.Array:
    x = self.final_norm(x)
    w = (self.head_matrix() if head is None else head).astype(x.dtype)  # [E, V]
    return jnp.dot(x, w, preferred_element_type=jnp.float32)  # [B, T, V] float32

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               segment_ids: jax.Array | None = None, return_kv: bool = False,
               attn_block: int | None = None, remat: str = "none", rows=None):
    """Full causal forward pass.

    tokens: `[B, T]` int; positions: `[B, T]` (default `arange(T)`).
    segment_ids: None (one sequence per row), or `[B, T]` int32 for packed rows (several
    sequences back to back in a row): query i attends key j iff j <= i and both have the same
    segment id; each segment a contiguous run (`attention.causal_attention`). The caller passes
    positions restarting at 0 in each segment; then each segment's outputs are those of the
    segment run alone (to float32 rounding: other block boundaries).
    attn_block: attention query/key block length (None: `DEFAULT_ATTN_BLOCK`; any value
    gives the same numbers up to float rounding); remat: what each block keeps for the
    backward pass, one of `REMAT_POLICIES` (the same numbers for every policy); rows: None, or
    the sharding (a `NamedSharding` / `PartitionSpec` over the current mesh) that every
    `[B, T, E]` activation between sublayers is pinned to: the trainer splits them by rows
    over its batch shards, which GSPMD alone does not always keep (the same numbers).
    Returns logits `[B, T, V]` float32, and with `return_kv` also a list over layers of
    (k, v), each `[B, T, K, D]`.
    """
    x, kvs = self._hidden(tokens, positions, attn_block, remat, rows, return_kv, segment_ids)
    logits = self._logits(x)
    return (logits, kvs) if return_kv else logits

  def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                    segment_ids: jax.Array | None = None, attn_block: int | None = None,
                    remat: str = "none", rows=None) -> jax.Array:
    """Final hidden states `[B, T, E]` (after the final norm, compute dtype): the logits are
    `hidden_states(tokens) @ head_matrix()` in float32 (the tiled log-prob kernel's input).
    segment_ids, attn_block, remat, rows: as in `__call__`."""
    x = self._hidden(tokens, positions, attn_block, remat, rows, False, segment_ids)[0]
    return self.final_norm(x)

  def _hidden(self, tokens: jax.Array, positions: jax.Array | None,
              attn_block: int | None = None, remat: str = "none", rows=None,
              return_kv: bool = True, segment_ids: jax.Array | None = None):
    """Causal pass up to (excluding) the final norm: x `[B, T, E]` and each layer's (k, v)
    (with remat other than "none", only if return_kv).

    remat "none": the blocks in a Python loop; otherwise one `lax.scan` over the layers, each
    block under `jax.checkpoint` with the `remat` policy (`_scan_blocks`).
    """
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} is not one of {list(REMAT_POLICIES)}")
    block = DEFAULT_ATTN_BLOCK if attn_block is None else attn_block
    if block < 1:
      raise ValueError(f"attn_block={attn_block} must be >= 1")
    b, t = tokens.shape
    if positions is None:  # [1, T, 1, D/2] host constants
      rope_cs = tuple(jnp.asarray(x)[None, :, None, :] for x in rope_table_host(self.cfg, t))
    else:
      rope_cs = rope_tables(positions, rope_frequencies(self.cfg))
    x = self._embed(tokens, rows)
    if remat != "none":
      return _scan_blocks(list(self.layers), x, rope_cs, block, remat, rows, return_kv, segment_ids)
    kvs = []
    for layer in self.layers:
      x, kv = layer(x, rope_cs, block, rows, segment_ids)
      kvs.append(kv)
    return x, kvs

  def prefill(self, tokens: jax.Array, lengths: jax.Array, attn_block: int | None = None):
    """Prompts for the sampling engine: the LM head only at each prompt's last token.

    tokens: `[B, T]` int, right-padded; lengths: `[B]` (1 <= length <= T); attn_block: as in
    `__call__`. Returns (logits
    `[B, V]` float32 of the token after each prompt, list over layers of (k, v) `[B, T, K, D]`).
    """
    x, kvs = self._hidden(tokens, None, attn_block)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, E]
    return self._logits(last)[:, 0], kvs

  def rope_table(self, size: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[size, D/2]` of positions `0..size-1`, for the decode step
    (`sampling.decode.decode(..., rope_table=)`)."""
    return tuple(jnp.asarray(x) for x in rope_table_host(self.cfg, size))  # [size, D/2]
