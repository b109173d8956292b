"""The transformer: prefill + decode equals a full forward pass; variants build and run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer, init_cache


@pytest.mark.parametrize("variant", [
    dict(qk_norm=True, qkv_bias=False, tie_embeddings=True),  # Qwen3
    dict(qk_norm=False, qkv_bias=True, tie_embeddings=False),  # Qwen2
])
def test_prefill_then_decode_equals_full_forward(variant):
  cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=96, **variant)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, cfg.vocab_size)
  full = model(tokens)  # [3, 12, V]
  prompt_len = 5
  logits, kvs = model(tokens[:, :prompt_len], return_kv=True)
  cache = init_cache(cfg, 3, 16)
  cache = {"k": cache["k"].at[:, :, :prompt_len].set(jnp.stack([k for k, _ in kvs])),
           "v": cache["v"].at[:, :, :prompt_len].set(jnp.stack([v for _, v in kvs]))}
  stepwise = [logits[:, -1]]
  for t in range(prompt_len, 12):
    step_logits, cache = model.decode(tokens[:, t], jnp.full((3,), t), cache)
    stepwise.append(step_logits)
  stepwise = np.stack(stepwise[:-1], axis=1)  # predictions for positions prompt_len-1 .. 10
  np.testing.assert_allclose(stepwise, np.asarray(full[:, prompt_len - 1:11]), atol=2e-5, rtol=0)


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


def test_gqa_heads_must_divide():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, mlp_dim=8)
