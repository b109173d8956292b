"""Architectures of published checkpoints, as `ModelConfig` keyword arguments.

Values are those of each model's Hugging Face `config.json`. Use with
`ModelConfig(**PRESETS[name])`, or `oapl_jax.models.build.model_config(name)`; for the size
without building weights, `oapl_jax.models.build.param_count(name)`.

Names and numbers only: nothing here imports JAX, Flax or the rest of oapl_jax (config files
read it).
"""

from __future__ import annotations

from typing import Any

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
