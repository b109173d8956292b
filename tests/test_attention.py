"""Blockwise causal attention (oapl_jax/models/attention.py) and the per-block remat policy
(oapl_jax/models/transformer.py)."""

import dataclasses
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer
from oapl_jax.models import attention as tr


def _load_benchmark(name: str):
  """A module of benchmarks/ by file path (a site-packages `benchmarks` shadows the folder)."""
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def dense_reference_attention(q, k, v):
  """The plain causal attention the blockwise one replaces: float32 scores `[B, K, G, T, T]`
  and a `[T, T]` mask. q `[B, T, N, D]` (already scaled), k, v `[B, T, K, D]`."""
  b, t, n, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, n // kv, d)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, n, d)


def _qkv(t, n=4, kv=2, d=8, b=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, d)) * 2
  k = jax.random.normal(keys[1], (b, t, kv, d)) * 2
  v = jax.random.normal(keys[2], (b, t, kv, d))
  w = jax.random.normal(keys[3], (b, t, n, d))  # a random cotangent
  return q, k, v, w


@pytest.mark.parametrize("t,block", [(13, 4), (3, 8), (16, 4), (16, 16), (1, 4)])
def test_blockwise_equals_dense(t, block):
  """Values and gradients, T not a multiple of the block, T < block, T a multiple."""
  q, k, v, w = _qkv(t)

  def value_and_grads(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)

  got, g_got = value_and_grads(lambda q, k, v: tr.causal_attention(q, k, v, block))
  want, g_want = value_and_grads(dense_reference_attention)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_blocks_above_the_diagonal_are_skipped(monkeypatch):
  """Every score block computed is counted (forward and backward): nb (nb + 1) / 2 of the
  nb^2 query/key block pairs, each pass, for nb = 5 query blocks."""
  calls = []
  original = tr._scores

  def counting(qi, kj, mask):
    jax.debug.callback(lambda: calls.append(1))
    return original(qi, kj, mask)

  monkeypatch.setattr(tr, "_scores", counting)
  q, k, v, w = _qkv(20)
  out = jax.jit(lambda q, k, v: tr.causal_attention(q, k, v, 4))(q, k, v)
  jax.block_until_ready(out)
  assert len(calls) == 15  # 5 * 6 / 2, not 25
  calls.clear()
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(tr.causal_attention(q, k, v, 4) * w), (0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
  assert len(calls) == 30  # forward 15 + backward 15


def test_no_t_by_t_buffer():
  """The compiled forward + backward holds no buffer with a [T, T] (or larger) footprint,
  and its scratch memory grows about linearly with T (the dense one quadratically)."""
  def compiled(fn, t):
    q, k, v, w = _qkv(t, n=4, kv=2, d=16, b=1)
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))
    return f.lower(q, k, v).compile()

  blockwise = lambda q, k, v: tr.causal_attention(q, k, v, 64)
  t = 1024
  text = compiled(blockwise, t).as_text()
  shapes = [tuple(int(x) for x in dims.split(",")) for dims in re.findall(r"\[([\d,]+)\]", text)]
  assert max(np.prod(s) for s in shapes) < t * t  # the largest: [B, T, N, D] arrays
  assert not any(s.count(t) >= 2 for s in shapes)
  temp = lambda fn, t: compiled(fn, t).memory_analysis().temp_size_in_bytes
  assert temp(blockwise, 2048) < 2.5 * temp(blockwise, 1024)
  assert temp(dense_reference_attention, 2048) > 3.5 * temp(dense_reference_attention, 1024)


CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=48)


def test_model_forward_any_block_and_remat():
  """The model's logits and gradients: equal for every block length and every remat policy."""
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, CFG.vocab_size)

  def loss(p, block, remat):
    logits = nnx.merge(graphdef, p)(tokens, attn_block=block, remat=remat)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

  results = {(b, r): jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))(params, b, r)
             for b, r in [(4, "none"), (4, "dots"), (4, "full"), (19, "none"), (64, "none")]}
  (_, want), want_g = results[(64, "none")]
  for (block, remat), ((_, logits), grads) in results.items():
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5, err_msg=f"{block} {remat}")
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{block} {remat}")
  for remat in ("dots", "full"):  # the same block, a different policy: the same numbers
    (_, a), ga = results[(4, remat)]
    (_, b), gb = results[(4, "none")]
    np.testing.assert_allclose(a, b, atol=1e-6)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
      np.testing.assert_allclose(x, y, atol=1e-6)


def test_scanned_blocks_give_the_loop_s_kv_and_numbers():
  """With remat the blocks run as one scan over stacked weights (`_scan_blocks`): the same
  per-layer keys/values, logits and gradients as the Python loop (float32). In bfloat16
  compute XLA:CPU's excess precision (float32 intermediates kept across fusions) makes the
  two differ in the last bits, as the unrolled remat already did for gradients."""
  for dtype, tol in (("float32", 1e-5),):  # JAX 0.12's CPU backend: 9.5e-6 (reassociation)
    cfg = dataclasses.replace(CFG, num_layers=3, param_dtype="float32", dtype=dtype)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)

    def run(p, remat):
      logits, kvs = nnx.merge(graphdef, p)(tokens, attn_block=8, remat=remat, return_kv=True)
      return jnp.sum(logits[..., 5]), kvs

    f = jax.jit(jax.value_and_grad(run, has_aux=True), static_argnums=1)
    (loss_a, kv_a), g_a = f(params, "none")
    (loss_b, kv_b), g_b = f(params, "full")
    assert len(kv_b) == cfg.num_layers
    for x, y in zip(jax.tree.leaves((loss_a, kv_a, g_a)), jax.tree.leaves((loss_b, kv_b, g_b))):
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=tol,
                                 rtol=tol, err_msg=dtype)


def test_full_remat_scan_keeps_weights_as_bits():
  """remat "full" without keys/values (the trainer's pass) runs `_full_remat_scan`, which
  stacks the weights and their gradient as the compute dtype's bits: bf16 compute on float32
  master weights gives the same loss and bit-equal gradients as the `jax.checkpoint` scan
  over stacked bf16 weights (still run when keys/values are returned), in less scratch memory
  (XLA:CPU keeps stacked bf16 in float32)."""
  cfg = dataclasses.replace(CFG, num_layers=4, param_dtype="float32", dtype="bfloat16")
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, cfg.vocab_size)

  def loss(p, return_kv):
    m = nnx.merge(graphdef, p)
    x, _ = m._hidden(tokens, None, 8, "full", None, return_kv)
    return jnp.sum(m.final_norm(x).astype(jnp.float32) ** 2)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (loss_bits, g_bits), (loss_stack, g_stack) = grad(params, False), grad(params, True)
  assert float(loss_bits) == float(loss_stack)
  for a, b in zip(jax.tree.leaves(g_bits), jax.tree.leaves(g_stack)):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  temp = {kv: grad.lower(params, kv).compile().memory_analysis().temp_size_in_bytes
          for kv in (False, True)}
  assert temp[False] < temp[True], temp


def test_remat_policy_changes_what_is_saved():
  """"full" keeps fewer residuals than "none" (the policy is really applied)."""
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((2, 64), jnp.int32)

  def temp(remat):
    f = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens, attn_block=16, remat=remat))))
    return f.lower(params).compile().memory_analysis().temp_size_in_bytes

  assert temp("full") < temp("none")
  with pytest.raises(ValueError, match="remat"):
    nnx.merge(graphdef, params)(tokens, remat="some")


@pytest.mark.parametrize("prompts, answers", [(4, 40), (4, 41), (8, 40)])
def test_bf16_engine_trainer_parity(prompts, answers):
  """bf16 compute: the engine's recorded log-probs and the trainer kernel's on equal weights
  (float32 master weights, the engine on their bfloat16 copy) differ by <= 1e-3 nats/token on
  average (a 2-layer width-128 model of benchmarks/bf16_parity.py), at more than one batch
  shape. Measured (2026-12-02): 3.0e-4 / 3.2e-4 / 3.6e-4 with config.model.exact_rounding;
  without it, XLA drops bf16 roundings by shape: 2.5e-4 at 4 x 40 but 9.3e-3 / 9.2e-3 at the
  other two."""
  bf16_parity = _load_benchmark("bf16_parity")
  cfg = dataclasses.replace(bf16_parity.MODEL, num_layers=2, hidden_size=128, head_dim=32,
                            mlp_dim=256, vocab_size=512)
  gap, n = bf16_parity.measure(cfg, prompts=prompts, answers=answers)
  assert n == prompts * 4 * answers
  assert gap.mean() <= 1e-3, (gap.mean(), gap.max())
