"""Shared fixtures: a tiny random model, and the smoke config."""

import jax
import pytest
from flax import nnx

from configs import tiny
from oapl_jax.models import ModelConfig, Transformer



@pytest.fixture(scope="session")
def small_model():
  """(cfg, graphdef, params) of a random model with sharp logits, so top-p really truncates."""
  cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, qk_norm=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.embed[...] = model.embed[...] * 15.0  # std 0.3: peaked next-token distributions
  graphdef, params = nnx.split(model, nnx.Param)
  return cfg, graphdef, params


@pytest.fixture
def smoke_config():
  return tiny.get_config("smoke")
