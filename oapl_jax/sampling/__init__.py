"""Sampling: the JetStream engine, its logit processing, and group rollouts."""

from oapl_jax.sampling import jetstream_compat  # noqa: F401  (before any JetStream orchestrator)
from oapl_jax.sampling.engine import (FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Engine, EngineParams,
                                      SampledTokens, Steps, TokenizerAdapter)
from oapl_jax.sampling.processing import SamplingParams, process_logits, sample
from oapl_jax.sampling.rollout import Rollout, rollout

__all__ = ["Engine", "EngineParams", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "Rollout",
           "SampledTokens", "SamplingParams", "Steps", "TokenizerAdapter", "process_logits",
           "rollout", "sample"]
