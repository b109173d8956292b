"""Sampling: the JetStream engine, its logit processing, and group rollouts.

The names below load on first use (PEP 562). `SampledTokens` and `TokenizerAdapter` come from
`jetstream_adapter`, which imports JetStream and through it seqio and TensorFlow (about
0.6 GiB resident and seconds of start-up); the engine itself imports none of them.
"""

import importlib
import sys
import types

from oapl_jax.sampling.processing import SamplingParams, process_logits, sample

_LAZY = {name: "oapl_jax.sampling.engine" for name in (
    "Engine", "EngineParams", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "Steps")}
_LAZY.update({name: "oapl_jax.sampling.jetstream_adapter" for name in (
    "SampledTokens", "TokenizerAdapter")})
_LAZY.update({"Rollout": "oapl_jax.sampling.rollout", "rollout": "oapl_jax.sampling.rollout"})

__all__ = ["Engine", "EngineParams", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "Rollout",
           "SampledTokens", "SamplingParams", "Steps", "TokenizerAdapter", "process_logits",
           "rollout", "sample"]


def __getattr__(name: str):
  """The engine's names, imported on first use (PEP 562)."""
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_LAZY[name]), name)
  globals()[name] = value
  return value


class _Package(types.ModuleType):
  """This package, with `rollout` always the function: importing the submodule
  `oapl_jax.sampling.rollout` makes Python set the package's attribute `rollout` to the
  module, which the eager `from ... import rollout` used to overwrite again."""

  def __setattr__(self, name, value):
    if name == "rollout" and isinstance(value, types.ModuleType):
      value = value.rollout
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
