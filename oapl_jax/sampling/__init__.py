"""Sampling: the JetStream engine, its logit processing, and group rollouts."""

from oapl_jax.sampling.engine import Engine, SampledTokens
from oapl_jax.sampling.processing import SamplingParams, process_logits
from oapl_jax.sampling.rollout import Rollout, rollout

__all__ = ["Engine", "SampledTokens", "SamplingParams", "process_logits", "Rollout", "rollout"]
