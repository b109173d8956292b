"""The names a model's settings are checked against: dtypes, RoPE scalings, logical axes.

JAX-free (names, and NumPy to read a dtype), so that `oapl_jax.config` validates `config.model`
and `config.sharding.rules` without starting JAX; `models/transformer.py` uses the same names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROPE_SCALING_TYPES = (None, "llama3")
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # Weight / compute dtypes the model supports.
# Every logical axis name a weight carries (`logical_axes` metadata); `config.sharding.rules`
# needs a rule for each (oapl_jax/sharding.py). V vocabulary, E hidden size, F MLP width,
# N query heads, K key/value heads, D head width; "norm" is the hidden-size RMSNorm weights;
# "vocab_embed" is E of the embedding table and LM head (a rule of its own: see config.py).
# Projections of a block a low-rank adapter may be attached to (config.model.lora.targets).
BASE_QUANTS = ("none", "int8")  # model.base_quant: how a LoRA run holds its frozen base (models/quant.py)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGICAL_AXES = ("vocab", "embed", "vocab_embed", "mlp", "q_heads", "kv_heads", "head_dim", "norm")


def dtype_name(value: Any, argument: str = "dtype") -> str:
  """The canonical name in `DTYPE_NAMES` of a dtype as JAX users write it: the name itself,
  or a NumPy / JAX dtype or scalar type (`jnp.bfloat16`, `np.float32`, `jnp.dtype("float16")`).
  Anything else (`"float8"`, `3`, `None`, Python's `float`) is a ValueError naming `argument`."""
  if isinstance(value, str):
    name = value
  else:
    try:
      name = None if value is None else np.dtype(value).name  # np.dtype(None) would be float64
    except TypeError:
      name = None
  if name not in DTYPE_NAMES:
    raise ValueError(f"{argument}={value!r} is not supported; use one of {list(DTYPE_NAMES)} "
                     "(a name, or a NumPy/JAX dtype such as jnp.bfloat16)")
  return name


def compiler_options(exact_rounding: bool) -> dict | None:
  """XLA options of the programs that run the model (the train step, the engines' prefill and
  decode, the log-prob pass): with `exact_rounding` (`config.model.exact_rounding`), XLA may not
  keep float32 where the program rounds to the compute dtype. By default XLA drops such
  f32 -> bf16 -> f32 round trips where its fusions meet them, and where it does depends on the
  shapes, so bfloat16 log-probs of a row would change with the batch it is scored in
  (docs/design.md "Engine/trainer parity in bfloat16")."""
  return {"xla_allow_excess_precision": False} if exact_rounding else None
