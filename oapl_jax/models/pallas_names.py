"""The values of `config.model.attention_kernel` (JAX-free, so `oapl_jax.config` validates the
setting without starting JAX; `models/attention.py` resolves them, `attention_impl`).

* "auto": the Pallas TPU kernels when the devices the model runs on are TPUs (checked when the
  program is traced: `jax.devices()`), else the blockwise XLA code. A program compiled ahead of
  time for TPU on a CPU host (`jax.experimental.topologies`) sees CPU devices: set "pallas".
* "xla": the blockwise JAX code everywhere (cuDNN's fused kernel on a GPU with 16-bit dtypes).
* "pallas": the Pallas TPU kernels (splash attention for the causal pass, `pallas_attention`'s
  decode kernel for the engine); they compile for TPU only.
* "pallas_interpret": the same kernels in Pallas interpret mode, on any backend (slow; the
  CPU tests' check that the kernels compute what the blockwise code computes).
"""

ATTENTION_KERNELS = ("auto", "xla", "pallas", "pallas_interpret")
