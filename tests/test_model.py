"""The transformer: prefill + decode equals a full forward pass; variants build and run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer, init_cache, write_prefix
from oapl_jax.models.transformer import LOGICAL_AXES


@nnx.jit
def _forward(model, tokens):
  return model(tokens, return_kv=True)


@nnx.jit(static_argnames=("chunk",))
def _decode(model, tokens, positions, cache, live_len, chunk, extra):
  return model.decode(tokens, positions, cache, live_len=live_len, chunk=chunk, **extra)


@pytest.mark.parametrize("chunk,reuse", [
    (256, False),  # one chunk
    (4, True),  # several chunks (online softmax, an overlapping last one); the engine's
])              # precomputed RoPE table and fused decode weights
@pytest.mark.parametrize("variant", [
    dict(qk_norm=True, qkv_bias=False, tie_embeddings=True),  # Qwen3
    dict(qk_norm=False, qkv_bias=True, tie_embeddings=False),  # Qwen2
])
def test_prefill_then_decode_equals_full_forward(variant, chunk, reuse):
  cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=96, **variant)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, cfg.vocab_size)
  full, _ = _forward(model, tokens)  # [3, 12, V]
  prompt_len = 5
  logits, kvs = _forward(model, tokens[:, :prompt_len])
  cache = write_prefix(init_cache(cfg, 3, 18), kvs, jnp.arange(3))  # 18: the last chunk overlaps
  stepwise = [logits[:, -1]]
  extra = dict(rope_table=model.rope_table(18), weights=model.decode_weights()) if reuse else {}
  for t in range(prompt_len, 12):
    step_logits, cache = _decode(model, tokens[:, t], jnp.full((3,), t), cache, t + 1, chunk, extra)
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
  logits, _ = _decode(model, step, jnp.asarray(lengths), cache, int(lengths.max()) + 1, 4, {})
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
