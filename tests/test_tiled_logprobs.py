"""The tiled log-prob kernel equals the plain one (values and gradients) and never holds [B, T, V].

The plain kernel is today's computation on full logits: `model(tokens[:, :-1])` -> `[B, T-1, V]`
-> `reference_logprobs` (process, log-softmax, gather, entropy). The tiled kernel must match it
to 1e-5 in float32 for every sampling setting and tile size (dividing T or not, one tile).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer
from oapl_jax.rl.logprobs import reference_logprobs, tiled_logprobs, token_logprobs
from oapl_jax.sampling.processing import SamplingParams, keep_mask

SAMPLINGS = {
    "off": SamplingParams(),
    "temp_topk_topp": SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
    "temp_topp": SamplingParams(temperature=1.3, top_p=0.9),
    "topk": SamplingParams(top_k=3),
}
B, T = 3, 21  # 20 targets per row


def plain_token_logprobs(model, tokens, sampling):
  """The reference: full `[B, T-1, V]` logits from the model's forward pass."""
  return reference_logprobs(model(tokens[:, :-1]), tokens[:, 1:], sampling)


def _tokens(vocab, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)  # random: often truncated


def _loss_and_grads(kernel, graphdef, params, tokens):
  """value_and_grad of a weighted sum of log-probs w.r.t. the params (entropy is a metric:
  not differentiated; its plain gradient is NaN where tokens are truncated, 0 * log 0)."""
  w = jax.random.uniform(jax.random.key(7), (B, T - 1))

  def loss(p):
    logp, ent = kernel(nnx.merge(graphdef, p), tokens)
    return jnp.sum(w * logp), (logp, ent)

  (value, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return value, logp, ent, grads


def _assert_trees_close(a, b, tol=1e-5):
  """Leaf by leaf |a - b| <= tol * (1 + |b|): 1e-5 absolute, relative for entries above 1
  (parameter gradients here reach ~10, where float32 sums in another order differ by ~1e-6)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _max_tree_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_kernel_equals_plain_values_and_grads(name):
  """tiled_logprobs vs the plain computation on hidden @ head: values and the gradients w.r.t.
  hidden states and head (through which all parameter gradients flow), for several tiles."""
  b, t, e, v = 3, 20, 16, 50
  keys = jax.random.split(jax.random.key(0), 4)
  hidden = jax.random.normal(keys[0], (b, t, e))
  head = jax.random.normal(keys[1], (e, v)) * 0.8  # peaked rows: top-p really truncates
  targets = jax.random.randint(keys[2], (b, t), 0, v)
  w = jax.random.uniform(keys[3], (b, t))
  sampling = SAMPLINGS[name]

  def run(kernel):
    def loss(hd, hm):
      logp, ent = kernel(hd, hm)
      return jnp.sum(w * logp), (logp, ent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, head)

  (_, (logp, ent)), grads = run(lambda hd, hm: reference_logprobs(
      jnp.dot(hd, hm, preferred_element_type=jnp.float32), targets, sampling))
  kept = keep_mask(jnp.dot(hidden, head) / sampling.temperature, sampling).sum(-1)  # [B, T]
  assert (kept < v).any() == (name != "off") and (kept > 1).any()
  for tile in (4, 7, 20, 64, 1):  # divides T or not, T (one tile), > T, 1
    (_, (logp_t, ent_t)), grads_t = run(
        lambda hd, hm: tiled_logprobs(hd, hm, targets, sampling, tile=tile))
    assert logp_t.shape == ent_t.shape == (b, t) and logp_t.dtype == ent_t.dtype == jnp.float32
    np.testing.assert_allclose(logp_t, logp, rtol=0, atol=1e-5, err_msg=f"tile {tile}")
    np.testing.assert_allclose(ent_t, ent, rtol=0, atol=1e-5, err_msg=f"tile {tile}")
    _assert_trees_close(grads_t, grads)
  assert float(jnp.max(jnp.abs(grads[1]))) > 1e-2  # not trivially zero
  # entropy is a metric: stop-gradient (the plain kernel's gradient is NaN where truncated)
  ent_grad = jax.grad(lambda hd: jnp.sum(tiled_logprobs(hd, head, targets, sampling, tile=7)[1]))
  assert not jnp.any(ent_grad(hidden))


@pytest.mark.parametrize("name, tiles", [("temp_topk_topp", (7, 64)), ("off", (4,))])
def test_model_equals_plain_values_and_grads(small_model, name, tiles):
  """token_logprobs on a Transformer vs today's plain kernel (full forward pass): log-probs,
  entropy and the parameter gradients of a weighted sum of log-probs."""
  cfg, graphdef, params = small_model
  sampling = SAMPLINGS[name]
  tokens = _tokens(cfg.vocab_size)
  plain = _loss_and_grads(lambda m, t: plain_token_logprobs(m, t, sampling), graphdef, params, tokens)
  assert _max_tree_diff(plain[3], jax.tree.map(jnp.zeros_like, plain[3])) > 1e-3
  for tile in tiles:
    tiled = _loss_and_grads(lambda m, t: token_logprobs(m, t, sampling, tile=tile), graphdef,
                            params, tokens)
    np.testing.assert_allclose(tiled[0], plain[0], rtol=1e-6)  # loss: a sum of 60 terms
    for p, q in zip(plain[1:3], tiled[1:3]):  # logprobs [B, T-1], entropy [B, T-1]
      assert q.dtype == jnp.float32 and q.shape == p.shape
      np.testing.assert_allclose(q, p, rtol=0, atol=1e-5, err_msg=f"tile {tile}")
    _assert_trees_close(tiled[3], plain[3])


def test_bfloat16_compute_close_to_plain():
  """bf16 compute, float32 params: the same logits per element; head gradients are summed over
  tiles after rounding each tile's part to bf16 (the plain kernel rounds once), so gradients
  agree to bf16 precision: 2e-2 relative to the largest entry of each gradient."""
  cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, dtype="bfloat16", param_dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  model.embed[...] = model.embed[...] * 15.0
  graphdef, params = nnx.split(model, nnx.Param)
  sampling = SAMPLINGS["temp_topk_topp"]
  tokens = _tokens(cfg.vocab_size, seed=1)
  plain = _loss_and_grads(lambda m, t: plain_token_logprobs(m, t, sampling), graphdef, params, tokens)
  tiled = _loss_and_grads(lambda m, t: token_logprobs(m, t, sampling, tile=7), graphdef, params,
                          tokens)
  np.testing.assert_allclose(tiled[1], plain[1], rtol=0, atol=1e-5)  # log-probs
  np.testing.assert_allclose(tiled[2], plain[2], rtol=0, atol=1e-5)  # entropy
  for g, h in zip(jax.tree.leaves(plain[3]), jax.tree.leaves(tiled[3])):
    assert g.dtype == h.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(g)))
    assert float(jnp.max(jnp.abs(g - h))) <= 2e-2 * scale


def test_model_kwargs_reach_hidden_states(small_model):
  cfg, graphdef, params = small_model
  model = nnx.merge(graphdef, params)
  tokens = _tokens(cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(T - 1) * 3, (B, T - 1))  # not a shift: RoPE is relative
  sampling = SAMPLINGS["temp_topp"]
  tiled, _ = token_logprobs(model, tokens, sampling, tile=6, positions=positions)
  plain, _ = reference_logprobs(model(tokens[:, :-1], positions), tokens[:, 1:], sampling)
  default, _ = token_logprobs(model, tokens, sampling, tile=6)
  np.testing.assert_allclose(tiled, plain, rtol=0, atol=1e-5)
  assert float(jnp.max(jnp.abs(tiled - default))) > 1e-3  # the positions were used


def test_bad_tile_is_an_error(small_model):
  cfg, graphdef, params = small_model
  with pytest.raises(ValueError, match="tile"):
    token_logprobs(nnx.merge(graphdef, params), _tokens(cfg.vocab_size), SamplingParams(), tile=0)


def test_top_k_by_counting_equals_lax_top_k():
  """keep_mask's top-k (bisection counting order keys) keeps exactly `scaled >= k-th largest`,
  ties at the k-th value included, with -inf entries and signed zeros."""
  x = jax.random.normal(jax.random.key(0), (64, 50))
  x = jnp.round(x * 2) / 2  # many ties
  x = x.at[:8, :45].set(-jnp.inf).at[8:16].set(0.0).at[8:16, ::2].set(-0.0)
  for k in (1, 2, 5, 10, 49):
    kth = jax.lax.top_k(x, k)[0][..., -1:]
    np.testing.assert_array_equal(keep_mask(x, SamplingParams(top_k=k)), x >= kth)


def test_keep_mask_matches_a_sorting_reference():
  """keep_mask (bisection thresholds) against the definition computed by brute force: top-k
  keeps values >= the k-th largest; top-p then keeps token i iff the mass (softmax over the
  top-k set) of the tokens strictly more likely than i is < top_p."""
  x = jax.random.normal(jax.random.key(1), (64, 50)) * 2.0
  x = x.at[:16].set(jnp.round(x[:16]))  # ties
  for params in (SamplingParams(top_p=0.8), SamplingParams(top_k=7, top_p=0.9),
                 SamplingParams(top_k=4), SamplingParams(top_p=0.3)):
    xs = np.asarray(x, np.float64)
    keep = np.ones(xs.shape, bool)
    if params.top_k:
      keep = xs >= np.sort(xs, axis=-1)[:, -params.top_k][:, None]
    if params.top_p < 1:
      p = np.where(keep, np.exp(xs - xs.max(-1, keepdims=True)), 0.0)
      p /= p.sum(-1, keepdims=True)
      above = (p[:, None, :] * (xs[:, None, :] > xs[:, :, None])).sum(-1)  # [rows, i]
      keep &= above < params.top_p
    np.testing.assert_array_equal(keep_mask(x, params), keep, err_msg=str(params))


def _largest_buffer(compiled_text: str) -> int:
  """Elements of the largest array shape in an HLO module's text."""
  dims = re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]*)\]", compiled_text)
  return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in dims)


def test_no_full_size_buffer_in_forward_or_backward():
  """The compiled value-and-grad of the tiled kernel has no array of B*T*V elements or more
  (the plain one does: the check can fail); its temp memory is a fraction of the plain one's."""
  b, t, e, v, tile = 2, 48, 16, 97, 8  # a block is [2, 8, 97]; the whole would be [2, 48, 97]
  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (b, t, e))
  head = jax.random.normal(keys[1], (e, v))
  targets = jax.random.randint(keys[2], (b, t), 0, v)
  sampling = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)

  def loss(kernel):
    return lambda hd, w: jnp.sum(kernel(hd, w)[0])

  tiled = lambda hd, w: tiled_logprobs(hd, w, targets, sampling, tile=tile)
  plain = lambda hd, w: reference_logprobs(jnp.dot(hd, w, preferred_element_type=jnp.float32),
                                        targets, sampling)
  compiled = {name: jax.jit(jax.value_and_grad(loss(k), argnums=(0, 1))).lower(hidden, head).compile()
              for name, k in (("tiled", tiled), ("plain", plain))}
  full = b * t * v
  assert _largest_buffer(compiled["plain"].as_text()) >= full
  assert _largest_buffer(compiled["tiled"].as_text()) < full // 2
  temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}
  assert temp["tiled"] * 2 < temp["plain"], temp
