"""The names `config.rl` is checked against: the losses and the GRPO baseline's options.

JAX-free, so that `oapl_jax.config` validates without starting JAX; `rl/losses.py` registers a
loss under each of `LOSS_NAMES` (and checks, on import, that it registers exactly these).
"""

LOSS_NAMES = ("oapl", "grpo")  # rl.loss: OAPL's least squares | the GRPO+IS baseline
ADV_NORMS = ("std", "none")  # GRPO (divide by the group's std) | Dr.GRPO (no division)
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask", "none")  # min(w, C) | drop outside [1/C, C] | w = 1
NORMS = ("token_mean", "seq_mean", "constant")
