"""Models: the NNX transformer shared by the sampling engine and the trainer."""

from oapl_jax.models.transformer import ModelConfig, Transformer, init_cache

__all__ = ["ModelConfig", "Transformer", "init_cache"]
