"""Logit processing shared by the sampling engine and the trainer's log-prob kernel.

The log-prob contract (docs/algorithm.md "The log-prob contract"): a sampled token's log-prob is taken under the
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
  (so ties at the threshold are kept). Both leave a set `scaled >= threshold`: see
  `keep_threshold`. Everything here is stop-gradient by nature.
  """
  if not truncates(params, scaled.shape[-1]):
    return jnp.ones(scaled.shape, bool)
  return scaled >= keep_threshold(scaled, params)[..., None]


def truncates(params: SamplingParams, vocab: int) -> bool:
  """Whether top-k or top-p can drop tokens from a `vocab`-sized distribution."""
  return 0 < params.top_k < vocab or params.top_p < 1.0


def keep_threshold(scaled: jax.Array, params: SamplingParams) -> jax.Array:
  """float32 `[...]`: the scaled logit of the least likely token top-k then top-p keep.

  scaled: `[..., V]` float32 (no NaNs). The kept set is `scaled >= threshold` (-inf: all).
  Found by bisection on 32-bit order keys (no sort, no `lax.top_k`): each of the 32 steps per
  threshold is one reduction over the vocabulary (one all-reduce of `[...]` when V is
  sharded) that compares `scaled` with the float a key stands for, so apart from `scaled`
  only top-p's probabilities are a `[..., V]` buffer. Stop-gradient.
  """
  scaled = jax.lax.stop_gradient(scaled).astype(jnp.float32)
  threshold = jnp.zeros(scaled.shape[:-1], jnp.uint32)  # an order key; 0: all kept
  if 0 < params.top_k < scaled.shape[-1]:
    threshold = _top_k_threshold(scaled, params.top_k)
  if params.top_p < 1.0:
    threshold = jnp.maximum(threshold, _top_p_threshold(scaled, params.top_p, threshold))
  return _key_value(threshold)


def _order_key(x: jax.Array) -> jax.Array:
  """uint32 keys `[...]` ordered like the float32 values x (no NaNs; -0.0 keyed as 0.0)."""
  x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


_KEY_NEG_INF = 0x007FFFFF  # _order_key(-inf): the smallest key of a non-NaN float


def _key_value(key: jax.Array) -> jax.Array:
  """float32 `[...]` f with `x >= f` <=> `_order_key(x) >= key` for every non-NaN float32 x.

  The inverse of `_order_key` on keys of floats; keys below -inf's give -inf (every x is
  >= them), keys above +inf's give NaN (no x is), and the unused key between -0.0 and 0.0
  gives -0.0 (x >= -0.0 <=> x >= 0.0).
  """
  key = jnp.maximum(key, jnp.uint32(_KEY_NEG_INF))
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _top_k_threshold(scaled: jax.Array, k: int) -> jax.Array:
  """The order key `[...]` of the k-th largest entry of scaled `[..., V]` (1 <= k < V).

  Bisection for the largest t with count(key >= t) >= k, which is exactly the k-th largest
  key (with multiplicity, so ties at the k-th value are kept): 32 counts over the vocabulary.
  """
  def body(_, bounds):  # invariant: count(key >= lo) >= k > count(key >= hi)
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    count = jnp.sum(scaled >= _key_value(mid)[..., None], axis=-1, dtype=jnp.int32)
    return jnp.where(count >= k, mid, lo), jnp.where(count >= k, hi, mid)

  lo = jnp.zeros(scaled.shape[:-1], jnp.uint32)
  hi = _order_key(jnp.max(scaled, axis=-1)) + jnp.uint32(1)  # no wrap: the max is not NaN
  return jax.lax.fori_loop(0, 32, body, (lo, hi))[0]


def _top_p_threshold(scaled: jax.Array, top_p: float, floor: jax.Array) -> jax.Array:
  """The order key `[...]` of the least likely token top-p keeps among those with key >= floor.

  scaled: `[..., V]`; floor: `[...]` (top-k's threshold key, or 0). Bisection for the smallest
  t with mass(key > t) < top_p, the mass under the softmax over the tokens with key >= floor:
  32 masked sums over the vocabulary instead of a sort, several times cheaper per decode step
  on CPU. The result is >= floor unless rounding puts that set's mass below top_p
  (`keep_threshold` takes the larger of the two).
  """
  m = jnp.max(scaled, axis=-1, keepdims=True)  # the most likely token is always kept
  e = jnp.where(scaled >= _key_value(floor)[..., None], jnp.exp(scaled - m), 0.0)  # [..., V]
  probs = e / jnp.sum(e, axis=-1, keepdims=True)

  def body(_, bounds):  # invariant: mass(key > lo) >= top_p > mass(key > hi)
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    above = scaled >= _key_value(mid + jnp.uint32(1))[..., None]  # key > mid (mid < hi: no wrap)
    below = jnp.sum(jnp.where(above, probs, 0.0), axis=-1) < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  lo = jnp.zeros(scaled.shape[:-1], jnp.uint32)
  return jax.lax.fori_loop(0, 32, body, (lo, _order_key(m[..., 0])))[1]


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
  """Inclusive prefix sums `[S, V'/B, B]` of probabilities `[S, V]`, by blocks of B =
  `_CDF_BLOCK` tokens (V' = V padded to the block; token i is at [:, i // B, i % B]).

  Two levels: a triangular matmul inside the blocks, then a cumsum of the block totals (XLA's
  CPU cumsum over the whole vocabulary is several times slower). Kept in blocks: `sample`
  counts over them as they are (flattened to [S, V'], XLA:TPU copied them to a layout with
  the slots in the 128 lanes, 128 x V' x 4 bytes however few the slots).
  """
  s, v = p.shape
  pad = -v % _CDF_BLOCK
  blocks = jnp.pad(p, ((0, 0), (0, pad))).reshape(s, -1, _CDF_BLOCK)  # [S, V'/B, B]
  tri = jnp.triu(jnp.ones((_CDF_BLOCK, _CDF_BLOCK), p.dtype))  # tri[i, j] = i <= j
  within = jnp.matmul(blocks, tri, precision=jax.lax.Precision.HIGHEST)  # [S, V'/B, B]
  offsets = jnp.cumsum(within[..., -1], axis=-1) - within[..., -1]  # [S, V'/B] exclusive
  return within + offsets[..., None]


def sample(processed: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row from softmax(processed), and its log-prob under that distribution.

  processed: `[S, V]` float32 (truncated entries -inf; from `process_logits`); u: `[S]`
  uniform in [0, 1). Returns (tokens `[S]` int32, log-probs `[S]` float32). The token is the
  first whose CDF exceeds `u * total`; a truncated token (probability 0) is never returned.
  """
  logp_all = jax.nn.log_softmax(processed, axis=-1)  # [S, V]
  probs = jnp.exp(logp_all)
  cdf = _cdf(probs)  # [S, V'/B, B]
  threshold = u * cdf[:, -1, -1]  # [S]
  # first index with cdf > threshold: a count, the same in any order
  tokens = jnp.sum(cdf <= threshold[:, None, None], axis=(1, 2))
  tokens = jnp.minimum(tokens, processed.shape[-1] - 1)
  pick = lambda t: jnp.take_along_axis(logp_all, t[:, None], axis=-1)[:, 0]  # [S]
  logp = pick(tokens)
  # Rounding can only ever land on a zero-probability token at a block edge: take the last
  # kept token instead (a max-reduce; argmax is several times slower on CPU).
  ok = jnp.isfinite(logp)
  last_kept = jnp.max(jnp.where(probs > 0, jnp.arange(probs.shape[-1]), 0), axis=-1)
  tokens = jnp.where(ok, tokens, last_kept)
  return tokens.astype(jnp.int32), jnp.where(ok, logp, pick(last_kept))
