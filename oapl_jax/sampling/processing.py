"""Logit processing shared by the sampling engine and the trainer's log-prob kernel.

The log-prob contract (docs: oapl.md): a sampled token's log-prob is taken under the
distribution it was actually sampled from — logits / temperature, then top-k, then top-p
truncation, renormalised over the kept set. The trainer applies the *same* function to
pi_theta's logits, so that `log pi_theta - log pi_old == 0` when the weights are equal.

Project choice: when scoring a given token (the trainer's side), that token is always part
of the kept set. With equal weights this changes nothing (a sampled token was kept), and
with different weights it keeps `log pi_theta` finite when pi_theta would have truncated
the token away.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn. temperature > 0; top_p in (0, 1] (1 = off); top_k >= 0 (0 = off)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  @classmethod
  def from_config(cls, cfg) -> "SamplingParams":
    return cls(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k))


def keep_mask(scaled: jax.Array, params: SamplingParams) -> jax.Array:
  """Boolean `[..., V]`: tokens kept by top-k then top-p on temperature-scaled logits.

  Ties at the threshold are kept. Everything here is stop-gradient by nature (comparisons).
  """
  scaled = jax.lax.stop_gradient(scaled)
  keep = jnp.ones(scaled.shape, bool)
  if params.top_k > 0 and params.top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, params.top_k)[0][..., -1:]  # [..., 1]
    keep = scaled >= kth
  if params.top_p < 1.0:
    masked = jnp.where(keep, scaled, NEG_INF)
    desc = -jnp.sort(-masked, axis=-1)  # [..., V] descending
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept_sorted = mass_before < params.top_p  # smallest prefix reaching top_p
    threshold = jnp.min(jnp.where(kept_sorted, desc, jnp.inf), axis=-1, keepdims=True)
    keep = keep & (scaled >= threshold)
  return keep


def process_logits(logits: jax.Array, params: SamplingParams,
                   always_keep: jax.Array | None = None) -> jax.Array:
  """Logits `[..., V]` -> processed logits `[..., V]` (float32, truncated entries = -inf).

  always_keep: optional int `[...]` token ids that stay in the kept set (the trainer passes
  the tokens it scores; see the module docstring).
  """
  scaled = logits.astype(jnp.float32) / params.temperature
  keep = keep_mask(scaled, params)
  if always_keep is not None:
    keep = keep | jax.nn.one_hot(always_keep, scaled.shape[-1], dtype=bool)
  return jnp.where(keep, scaled, NEG_INF)


def entropy(processed: jax.Array) -> jax.Array:
  """Entropy `[...]` of the distribution given by processed logits `[..., V]` (nats)."""
  logp = jax.nn.log_softmax(processed, axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
