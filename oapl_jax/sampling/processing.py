"""Logit processing shared by the sampling engine and the trainer's log-prob kernel.

The log-prob contract (docs: oapl.md): a sampled token's log-prob is taken under the
distribution it was actually sampled from — logits / temperature, then top-k, then top-p
truncation, renormalised over the kept set. The trainer applies the *same* function to
pi_theta's logits, so that `log pi_theta - log pi_old == 0` when the weights are equal.

Sampling (`sample`) draws by inverse CDF with one uniform number per row: on CPU this costs
a fraction of Gumbel-max (`jax.random.categorical` needs `V` random numbers per row).

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

  Top-k keeps every token at least as likely as the k-th most likely one (ties at the k-th
  value are kept). Top-p keeps the smallest set of most likely tokens whose mass reaches
  top_p: token i is kept iff the mass of the tokens strictly more likely than it is < top_p
  (so ties at the threshold are kept). Both thresholds are found by bisection on order keys
  (no sort, no `lax.top_k`: each of the 32 steps is one reduction over the vocabulary, which
  stays a reduction when V is sharded). Everything here is stop-gradient by nature.
  """
  scaled = jax.lax.stop_gradient(scaled)
  keep = jnp.ones(scaled.shape, bool)
  if params.top_k > 0 and params.top_k < scaled.shape[-1]:
    keys = _order_key(scaled)
    keep = keys >= _top_k_threshold(keys, params.top_k)[..., None]
  if params.top_p < 1.0:
    masked = jnp.where(keep, scaled, NEG_INF)
    keep = keep & (_order_key(masked) >= _top_p_threshold(masked, params.top_p)[..., None])
  return keep


def _order_key(x: jax.Array) -> jax.Array:
  """uint32 keys `[...]` ordered like the float32 values x (no NaNs; -0.0 keyed as 0.0)."""
  x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _top_p_threshold(masked: jax.Array, top_p: float) -> jax.Array:
  """The order key `[...]` of the least likely token top-p keeps (masked: `[..., V]`).

  Bisection on the 32-bit keys for the smallest t with mass(key > t) < top_p: 32 masked sums
  over the vocabulary instead of a sort, several times cheaper per decode step on CPU.
  """
  probs = jax.nn.softmax(masked, axis=-1)  # [..., V]
  keys = _order_key(masked)

  def body(_, bounds):  # invariant: mass(key > lo) >= top_p > mass(key > hi)
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    mass = jnp.sum(jnp.where(keys > mid[..., None], probs, 0.0), axis=-1)
    below = mass < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  lo = jnp.zeros(keys.shape[:-1], jnp.uint32)
  _, hi = jax.lax.fori_loop(0, 32, body, (lo, jnp.max(keys, axis=-1)))
  return hi


def _top_k_threshold(keys: jax.Array, k: int) -> jax.Array:
  """The order key `[...]` of the k-th largest entry of keys `[..., V]` (1 <= k <= V).

  Bisection for the largest t with count(key >= t) >= k, which is exactly the k-th largest
  key (with multiplicity): 32 counts over the vocabulary. Keys must not be NaN keys (the
  `+ 1` below would wrap).
  """
  def body(_, bounds):  # invariant: count(key >= lo) >= k > count(key >= hi)
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    enough = jnp.sum(keys >= mid[..., None], axis=-1, dtype=jnp.int32) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo = jnp.zeros(keys.shape[:-1], jnp.uint32)
  lo, _ = jax.lax.fori_loop(0, 32, body, (lo, jnp.max(keys, axis=-1) + jnp.uint32(1)))
  return lo


def process_logits(logits: jax.Array, params: SamplingParams,
                   always_keep: jax.Array | None = None) -> jax.Array:
  """Logits `[..., V]` -> processed logits `[..., V]` (float32, truncated entries = -inf).

  always_keep: optional int `[...]` token ids that stay in the kept set (the trainer passes
  the tokens it scores; see the module docstring).
  """
  scaled = logits.astype(jnp.float32) / params.temperature
  keep = keep_mask(scaled, params)
  if always_keep is not None:
    keep = keep | (jnp.arange(scaled.shape[-1]) == always_keep[..., None])  # no one-hot buffer
  return jnp.where(keep, scaled, NEG_INF)


def entropy(processed: jax.Array) -> jax.Array:
  """Entropy `[...]` of the distribution given by processed logits `[..., V]` (nats)."""
  logp = jax.nn.log_softmax(processed, axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


_CDF_BLOCK = 64  # vocabulary block of the two-level prefix sum in `sample`


def _cdf(p: jax.Array) -> jax.Array:
  """Inclusive prefix sums `[S, V']` of probabilities `[S, V]` (V' = V padded to the block).

  Two levels: a triangular matmul inside blocks of `_CDF_BLOCK` tokens, then a cumsum of the
  block totals (XLA's CPU cumsum over the whole vocabulary is several times slower).
  """
  s, v = p.shape
  pad = -v % _CDF_BLOCK
  blocks = jnp.pad(p, ((0, 0), (0, pad))).reshape(s, -1, _CDF_BLOCK)  # [S, V'/B, B]
  tri = jnp.triu(jnp.ones((_CDF_BLOCK, _CDF_BLOCK), p.dtype))  # tri[i, j] = i <= j
  within = jnp.matmul(blocks, tri, precision=jax.lax.Precision.HIGHEST)  # [S, V'/B, B]
  offsets = jnp.cumsum(within[..., -1], axis=-1) - within[..., -1]  # [S, V'/B] exclusive
  return (within + offsets[..., None]).reshape(s, -1)


def sample(processed: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row from softmax(processed), and its log-prob under that distribution.

  processed: `[S, V]` float32 (truncated entries -inf; from `process_logits`); u: `[S]`
  uniform in [0, 1). Returns (tokens `[S]` int32, log-probs `[S]` float32). The token is the
  first whose CDF exceeds `u * total`; a truncated token (probability 0) is never returned.
  """
  logp_all = jax.nn.log_softmax(processed, axis=-1)  # [S, V]
  probs = jnp.exp(logp_all)
  cdf = _cdf(probs)  # [S, V']
  threshold = u * cdf[:, -1]  # [S]
  tokens = jnp.sum(cdf <= threshold[:, None], axis=-1)  # first index with cdf > threshold
  tokens = jnp.minimum(tokens, processed.shape[-1] - 1)
  pick = lambda t: jnp.take_along_axis(logp_all, t[:, None], axis=-1)[:, 0]  # [S]
  logp = pick(tokens)
  # Rounding can only ever land on a zero-probability token at a block edge: take the last
  # kept token instead (a max-reduce; argmax is several times slower on CPU).
  ok = jnp.isfinite(logp)
  last_kept = jnp.max(jnp.where(probs > 0, jnp.arange(probs.shape[-1]), 0), axis=-1)
  tokens = jnp.where(ok, tokens, last_kept)
  return tokens.astype(jnp.int32), jnp.where(ok, logp, pick(last_kept))
