"""Architectures of published checkpoints, as `ModelConfig` keyword arguments.

Values are those of each model's Hugging Face `config.json`. Use with
`ModelConfig(**PRESETS[name])`, or `param_count(name)` for the size without building weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the presets themselves import neither JAX nor Flax (config files read them)
  from oapl_jax.models.transformer import ModelConfig

_QWEN3 = dict(vocab_size=151936, head_dim=128, num_kv_heads=8, rope_theta=1e6, rms_norm_eps=1e-6,
              qk_norm=True, qkv_bias=False, max_position_embeddings=40960)
_R1_QWEN = dict(head_dim=128, qk_norm=False, qkv_bias=True, tie_embeddings=False,
                max_position_embeddings=131072)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_0_6b": dict(_QWEN3, hidden_size=1024, num_layers=28, num_heads=16, mlp_dim=3072,
                       tie_embeddings=True),
    "qwen3_1_7b": dict(_QWEN3, hidden_size=2048, num_layers=28, num_heads=16, mlp_dim=6144,
                       tie_embeddings=True),
    # Qwen3-4B; Qwen3-4B-Thinking-2507 has the same weights' shapes (see its own preset).
    "qwen3_4b": dict(_QWEN3, hidden_size=2560, num_layers=36, num_heads=32, mlp_dim=9728,
                     tie_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, num_layers=36, num_heads=32, mlp_dim=12288,
                     tie_embeddings=False),
    # DeepSeek-R1-Distill-Qwen-*: Qwen2 architecture (qkv bias, untied LM head).
    "r1_distill_qwen_1_5b": dict(_R1_QWEN, vocab_size=151936, hidden_size=1536, num_layers=28,
                                 num_heads=12, num_kv_heads=2, mlp_dim=8960, rope_theta=1e4,
                                 rms_norm_eps=1e-6),
    "r1_distill_qwen_7b": dict(_R1_QWEN, vocab_size=152064, hidden_size=3584, num_layers=28,
                               num_heads=28, num_kv_heads=4, mlp_dim=18944, rope_theta=1e4,
                               rms_norm_eps=1e-6),
    "r1_distill_qwen_14b": dict(_R1_QWEN, vocab_size=152064, hidden_size=5120, num_layers=48,
                                num_heads=40, num_kv_heads=8, mlp_dim=13824, rope_theta=1e6,
                                rms_norm_eps=1e-5),
    "llama3_1_8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=5e5,
                        rms_norm_eps=1e-5, qk_norm=False, qkv_bias=False, tie_embeddings=False,
                        rope_scaling_type="llama3", rope_scaling_factor=8.0,
                        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_len=8192, max_position_embeddings=131072),
}
# The embedded default's model (configs/tiny.py): trained from scratch on CPU in minutes.
PRESETS["tiny_addition"] = dict(vocab_size=32, hidden_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=32, mlp_dim=384, rope_theta=1e4,
                                rms_norm_eps=1e-6, qk_norm=True, qkv_bias=False,
                                tie_embeddings=True)
# Tiny random stand-ins with the same code paths, for CPU runs of the real-model configs
# (`configs/math.py:tiny`, `configs/code.py:tiny`); made by `launch/make_tiny_hf.py`.
PRESETS["tiny_qwen3"] = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=1e6,
                             rms_norm_eps=1e-6, qk_norm=True, qkv_bias=False, tie_embeddings=True,
                             max_position_embeddings=4096)
PRESETS["tiny_qwen2"] = dict(PRESETS["tiny_qwen3"], qk_norm=False, qkv_bias=True,
                             tie_embeddings=False, rope_theta=1e4)
# The 2507 release differs from Qwen3-4B only in RoPE base and context length.
PRESETS["qwen3_4b_thinking_2507"] = dict(PRESETS["qwen3_4b"], rope_theta=5e6,
                                         max_position_embeddings=262144)


def model_config(preset: str | Mapping[str, Any] | ModelConfig) -> ModelConfig:
  """ModelConfig of a preset name, a kwargs dict, or a ModelConfig (returned as is)."""
  from oapl_jax.models.transformer import ModelConfig  # noqa: PLC0415 (imports Flax)
  if isinstance(preset, ModelConfig):
    return preset
  if isinstance(preset, str):
    if preset not in PRESETS:
      raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[preset]
  return ModelConfig(**preset)


def param_count(preset: str | Mapping[str, Any] | ModelConfig) -> int:
  """Number of weights of the model, from abstract shapes only (nothing is allocated)."""
  import jax  # noqa: PLC0415 (JAX, Flax, NumPy only here: importing the presets needs none)
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from oapl_jax.models.transformer import Transformer  # noqa: PLC0415
  cfg = model_config(preset)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  shapes = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  return int(sum(np.prod(s.shape, dtype=np.int64) for s in shapes))
