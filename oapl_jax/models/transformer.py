"""A decoder-only transformer of the Qwen3 / Qwen2 / Llama family, in Flax NNX.

Blocks: RMSNorm -> grouped-query attention with RoPE (optional QK-norm, optional
qkv bias) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head
(optionally tied to the embedding).

Two entry points share every weight and every layer:
* `model(tokens)` — full causal forward pass, logits `[B, T, V]` (training, log-probs,
  prefill). With `return_kv=True` it also returns each layer's keys and values.
* `model.decode(tokens, positions, cache)` — one token per row against a KV cache
  (the sampling engine's decode step).

Every weight carries `logical_axes` metadata (e.g. `("embed", "mlp")`); one table in the
config maps logical axes to mesh axes (see `oapl_jax.sharding`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


ROPE_SCALING_TYPES = (None, "llama3")


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

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads}")
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
  """A normal(0, scale) weight with logical axis names; scale defaults to 1/sqrt(fan_in)."""
  scale = shape[0] ** -0.5 if scale is None else scale
  value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * weight, computed in float32."""

  def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
    self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies `[D/2]` float32 of the config's RoPE (plain or "llama3"-scaled).

  The "llama3" branch follows `transformers.modeling_rope_utils._compute_llama3_parameters`.
  """
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half))  # [D/2]
  if cfg.rope_scaling_type != "llama3":
    return inv_freq
  factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(is_medium, smoothed, scaled)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         inv_freq: jax.Array | None = None) -> jax.Array:
  """Rotary embedding, Hugging Face "rotate half" layout.

  x: `[B, T, N, D]`; positions: `[B, T]` int; inv_freq: `[D/2]` (default: plain RoPE with
  base `theta`; see `rope_frequencies`). Returns `[B, T, N, D]`.
  """
  half = x.shape[-1] // 2
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))  # [D/2]
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention with a boolean mask.

  q: `[B, T, N, D]`; k, v: `[B, S, K, D]` with N a multiple of K; mask: `[B, T, S]`
  (True = may attend). Softmax in float32. Returns `[B, T, N, D]`.
  """
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, d)  # [B, T, K, G, D]
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * d**-0.5
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, n, d)


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

  def project_qkv(self, x: jax.Array, positions: jax.Array):
    """x: `[B, T, E]`, positions `[B, T]` -> q `[B, T, N, D]`, k, v `[B, T, K, D]` (RoPE applied)."""
    dt = x.dtype
    q = jnp.einsum("bte,end->btnd", x, self.q_proj[...].astype(dt))
    k = jnp.einsum("bte,ekd->btkd", x, self.k_proj[...].astype(dt))
    v = jnp.einsum("bte,ekd->btkd", x, self.v_proj[...].astype(dt))
    if self.cfg.qkv_bias:
      q, k, v = q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt), v + self.v_bias[...].astype(dt)
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    theta, inv_freq = self.cfg.rope_theta, rope_frequencies(self.cfg)
    return rope(q, positions, theta, inv_freq), rope(k, positions, theta, inv_freq), v

  def output(self, attn: jax.Array) -> jax.Array:
    """attn: `[B, T, N, D]` -> `[B, T, E]`."""
    return jnp.einsum("btnd,nde->bte", attn, self.o_proj[...].astype(attn.dtype))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    p = cfg.param_dtype
    self.gate_proj = _param(rngs, (cfg.hidden_size, cfg.mlp_dim), ("embed", "mlp"), p)
    self.up_proj = _param(rngs, (cfg.hidden_size, cfg.mlp_dim), ("embed", "mlp"), p)
    self.down_proj = _param(rngs, (cfg.mlp_dim, cfg.hidden_size), ("mlp", "embed"), p)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))  # [B, T, M]
    return h @ self.down_proj[...].astype(dt)


class Block(nnx.Module):
  """One pre-norm transformer layer."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, kv=None):
    """x `[B, T, E]`. Without `kv`, attends within x (causal `mask` `[B, T, T]`).

    With `kv=(cache_k, cache_v, write)` (cache `[B, S, K, D]`, `write(cache, new)` inserts
    this step's keys/values), attends over the updated cache with `mask` `[B, T, S]`.
    Returns (x, (k, v)) where k, v are this layer's new keys/values or updated caches.
    """
    q, k, v = self.attn.project_qkv(self.input_norm(x), positions)
    if kv is not None:
      cache_k, cache_v, write = kv
      k, v = write(cache_k, k), write(cache_v, v)
    x = x + self.attn.output(attend(q, k, v, mask))
    x = x + self.mlp(self.post_attn_norm(x))
    return x, (k, v)


class Transformer(nnx.Module):
  """Decoder-only LM. See the module docstring."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype, scale=0.02)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.dtype)  # [B, T, E]

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      w = self.embed[...].astype(x.dtype).T  # [E, V]
    else:
      w = self.lm_head[...].astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)  # [B, T, V] float32

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               return_kv: bool = False):
    """Full causal forward pass.

    tokens: `[B, T]` int; positions: `[B, T]` (default `arange(T)`).
    Returns logits `[B, T, V]` float32, and with `return_kv` also a list over layers of
    (k, v), each `[B, T, K, D]`.
    """
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))  # [B, T, T]
    x = self._embed(tokens)
    kvs = []
    for layer in self.layers:
      x, kv = layer(x, positions, mask)
      kvs.append(kv)
    logits = self._logits(x)
    return (logits, kvs) if return_kv else logits

  def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict[str, Any]):
    """One decode step for every row against a KV cache.

    tokens: `[B]` int, the token at `positions` `[B]` of each row.
    cache: {"k": [L, B, S, K, D], "v": [L, B, S, K, D]}; row b holds valid keys at
    indices `< positions[b]`. This step writes its keys at `positions[b]` and attends to
    indices `<= positions[b]`.
    Returns (logits `[B, V]` float32, updated cache).
    """
    s = cache["k"].shape[2]
    pos = positions[:, None]  # [B, 1]
    mask = (jnp.arange(s)[None, :] <= pos)[:, None, :]  # [B, 1, S]
    write_at = jax.nn.one_hot(positions, s, dtype=cache["k"].dtype)[:, :, None, None]  # [B, S, 1, 1]

    def write(c, new):  # c [B, S, K, D], new [B, 1, K, D]
      return c * (1 - write_at) + new.astype(c.dtype) * write_at

    x = self._embed(tokens[:, None])  # [B, 1, E]
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      x, (k, v) = layer(x, pos, mask, kv=(cache["k"][i], cache["v"][i], write))
      new_k.append(k)
      new_v.append(v)
    logits = self._logits(x)[:, 0]  # [B, V]
    return logits, {"k": jnp.stack(new_k), "v": jnp.stack(new_v)}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict[str, jax.Array]:
  """Zero KV cache: {"k", "v"} each `[L, B, S, K, D]`."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
