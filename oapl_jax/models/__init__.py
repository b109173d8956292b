"""Models: the NNX transformer shared by the sampling engine and the trainer."""

from oapl_jax.models.hf import from_hf, to_hf
from oapl_jax.models.transformer import ModelConfig, Transformer, init_cache, write_prefix

__all__ = ["ModelConfig", "Transformer", "from_hf", "init_cache", "to_hf", "write_prefix"]
