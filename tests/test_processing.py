"""Logit processing and the sampler shared by the engine and the trainer kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oapl_jax.sampling.processing import SamplingParams, keep_mask, process_logits, sample


def _exact_keep(x: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
  """The definition in float64: top-k, then keep i iff mass(strictly more likely) < top_p."""
  if top_k:
    x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
  p = np.exp(x - x.max())
  p /= p.sum()
  before = np.array([p[x > v].sum() for v in x])
  return np.isfinite(x) & (before < top_p)


@pytest.mark.parametrize("top_k", [0, 7])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_keep_mask_is_top_k_then_top_p(top_p, top_k):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(24, 200)) * rng.uniform(0.5, 5, (24, 1))
  x[::2] = np.round(x[::2] * 2) / 2  # ties at the threshold, and -0.0 next to 0.0
  x = x.astype(np.float32)
  got = np.asarray(jax.jit(keep_mask, static_argnums=1)(jnp.asarray(x), SamplingParams(top_p=top_p, top_k=top_k)))
  for row in range(x.shape[0]):
    np.testing.assert_array_equal(got[row], _exact_keep(x[row].astype(np.float64), top_p, top_k))


def test_sample_draws_from_the_processed_distribution():
  logits = jax.random.normal(jax.random.key(0), (3, 40)) * 2
  processed = process_logits(logits, SamplingParams(temperature=0.8, top_p=0.8))
  n = 100_000
  u = jax.random.uniform(jax.random.key(1), (n,))
  tokens, logp = jax.jit(jax.vmap(lambda v: sample(processed, jnp.full((3,), v))))(u)  # [n, 3]
  probs = np.asarray(jax.nn.softmax(processed, axis=-1))
  tokens = np.asarray(tokens)
  for row in range(3):
    freq = np.bincount(tokens[:, row], minlength=40) / n
    assert freq[probs[row] == 0].sum() == 0  # never a truncated token
    assert np.abs(freq - probs[row]).max() < 5 * np.sqrt(0.25 / n)
  np.testing.assert_allclose(np.asarray(logp), np.log(probs[np.arange(3), tokens]), atol=1e-5)
