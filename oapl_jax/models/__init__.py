"""Models: the NNX transformer shared by the sampling engine and the trainer.

The names below are imported on first use (PEP 562), so that `oapl_jax.models.presets` (read by
the config files) imports neither JAX nor Flax.
"""

import importlib

_HOMES = {  # public name -> the submodule that defines it
    "ModelConfig": "transformer", "Transformer": "transformer", "init_cache": "kv_cache",
    "write_prefix": "kv_cache", "from_hf": "hf", "to_hf": "hf", "param_count": "build",
}

__all__ = ["ModelConfig", "Transformer", "from_hf", "init_cache", "param_count", "to_hf",
           "write_prefix"]


def __getattr__(name: str):
  """`oapl_jax.models.Transformer` and the rest of `__all__`, imported from their submodule."""
  if name not in _HOMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
  globals()[name] = value  # later look-ups skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
