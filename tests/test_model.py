"""The transformer: prefill + decode (the engine's decode step, `sampling/decode.py`, over the
engine's one-device weight layout) equals a full forward pass; variants build and run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer, init_cache, write_prefix
from oapl_jax.models.names import LOGICAL_AXES
from oapl_jax.sampling import decode as decode_lib
from oapl_jax.sampling.layout import EngineLayout


@nnx.jit
def _forward(model, tokens):
  return model(tokens, return_kv=True)


def _engine_decoder(model: Transformer, cache_len: int, chunk: int):
  """The engine's decode step over `model`'s weights in the engine layout on one device
  (`EngineLayout(cfg, tensor=1).relayout`: fused weights, the fused Params None), with the
  RoPE table of `cache_len` positions made once, as `Engine` does. Returns a jitted
  `step(tokens [B], positions [B], cache, live_len) -> (logits [B, V], cache)`."""
  graphdef, params = nnx.split(model, nnx.Param)
  rest, fused = jax.jit(EngineLayout(model.cfg, tensor=1).relayout)(params)
  rope_table = model.rope_table(cache_len)

  @jax.jit
  def step(tokens, positions, cache, live_len):
    return decode_lib.decode(nnx.merge(graphdef, rest), fused, tokens, positions, cache,
                             live_len=live_len, chunk=chunk, rope_table=rope_table)
  return step


@pytest.mark.parametrize("chunk", [
    256,  # one chunk
    4,  # several chunks (online softmax, an overlapping last one)
])
@pytest.mark.parametrize("variant", [
    dict(qk_norm=True, qkv_bias=False, tie_embeddings=True),  # Qwen3
    dict(qk_norm=False, qkv_bias=True, tie_embeddings=False),  # Qwen2
])
def test_prefill_then_decode_equals_full_forward(variant, chunk):
  cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=96, **variant)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  if cfg.qkv_bias:  # zero at init: random biases, so a decode step that skipped them would fail
    for i, layer in enumerate(model.layers):
      for name in ("q_bias", "k_bias", "v_bias"):
        bias = getattr(layer.attn, name)
        bias[...] = 0.1 * jax.random.normal(jax.random.key(10 + i), bias.shape)
  tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, cfg.vocab_size)
  full, _ = _forward(model, tokens)  # [3, 12, V]
  prompt_len = 5
  logits, kvs = _forward(model, tokens[:, :prompt_len])
  cache = write_prefix(init_cache(cfg, 3, 18), kvs, jnp.arange(3))  # 18: the last chunk overlaps
  step = _engine_decoder(model, 18, chunk)
  stepwise = [logits[:, -1]]
  for t in range(prompt_len, 12):
    step_logits, cache = step(tokens[:, t], jnp.full((3,), t), cache, jnp.int32(t + 1))
    stepwise.append(step_logits)
  stepwise = np.stack(stepwise[:-1], axis=1)  # predictions for positions prompt_len-1 .. 10
  np.testing.assert_allclose(stepwise, np.asarray(full[:, prompt_len - 1:11]), atol=2e-5, rtol=0)


def test_decode_rows_at_different_positions():
  """Rows at different lengths in one step (continuous batching) match their own forward."""
  cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=96)
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  tokens = jax.random.randint(jax.random.key(4), (3, 16), 0, cfg.vocab_size)
  full = np.asarray(_forward(model, tokens)[0])  # [3, 16, V]
  lengths = np.array([3, 9, 14])
  cache = init_cache(cfg, 3, 20)
  for row, n in enumerate(lengths):
    _, kvs = _forward(model, tokens[row:row + 1, :n])
    cache = write_prefix(cache, kvs, jnp.array([row]))
  step = jnp.asarray(tokens[np.arange(3), lengths])
  logits, _ = _engine_decoder(model, 20, 4)(step, jnp.asarray(lengths), cache,
                                            jnp.int32(lengths.max() + 1))
  np.testing.assert_allclose(np.asarray(logits), full[np.arange(3), lengths], atol=2e-5, rtol=0)


def test_weights_carry_logical_axes():
  cfg = ModelConfig(vocab_size=20, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_dim=64)
  _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  axes = jax.tree.leaves(jax.tree.map(lambda v: v.logical_axes, params,
                                      is_leaf=lambda x: isinstance(x, nnx.Variable)),
                         is_leaf=lambda x: isinstance(x, tuple))
  leaves = jax.tree.leaves(params)
  assert len(axes) == len(leaves)
  for a, leaf in zip(axes, leaves):
    assert len(a) == leaf.ndim


def test_logical_axes_names_every_axis_a_weight_carries():
  """LOGICAL_AXES (which config.sharding.rules must cover) is the set the weights use."""
  cfg = ModelConfig(vocab_size=20, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_dim=64, qk_norm=True, qkv_bias=True, tie_embeddings=False)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  used = {a for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
          for a in v.get_metadata()["logical_axes"]}
  assert used == set(LOGICAL_AXES)


def test_gqa_heads_must_divide():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, mlp_dim=8)
