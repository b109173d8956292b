"""The built-in reasoning task: addition answered by a chain of steps (52-53 tokens), on CPU.

Same run as configs/tiny.py (supervised warm-up on clean then noisy demonstrations, whose
noise here is a dropped carry: oapl_jax/tasks/chain.py -> eval before -> OAPL -> eval after),
with answers ten to twenty times longer, so the summed log-ratios OAPL regresses are large and
a lagged sampler drifts over many tokens. pass@k is measured to k = 256.

  python -m oapl_jax.main --config=configs/reason.py --workdir=/tmp/oapl_reason
  python -m oapl_jax.main --config=configs/reason.py:smoke --workdir=/tmp/oapl_reason_smoke  # CI

Variants through the arg string: `smoke` (a few steps, for tests and CI).
Every setting and its comment: oapl_jax/config.py `defaults`; this file overrides a few.
"""

import ml_collections

from oapl_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, smoke=bool)
  c = config_lib.defaults("tiny_addition")  # model: 2 layers, width 128, 32-token vocabulary

  c.task = config_lib.task_section("chain_addition")  # oapl_jax/tasks/chain.py
  # Both operands 5 digits: each step's digits sit at fixed places of the prompt, which this
  # small model learns in 1000 warm-up steps (4-8 digits: not in 400; docs/reasoning_task.md).
  c.task.min_digits = 5  # Fewest digits per operand (a column is 9 answer tokens).
  c.task.max_digits = 5  # Most digits per operand: chains of 52-53 tokens with EOS.
  c.task.num_eval = 128  # Held-out problems (never drawn for training).

  # Measured base (32 held-out problems x 256 samples): pass@1 0.048, pass@256 0.719 (docs/reasoning_task.md,
  # "Calibration of the base"; digit_noise 0.5 gave pass@1 0.14-0.16 but pass@256 1.000).
  c.warmup.steps = 1000  # Clean demonstrations, then the last noisy_steps noisy ones.
  c.warmup.noisy_steps = 150
  c.warmup.batch_size = 64
  c.warmup.digit_noise = 0.7  # Chance each carry of a noisy demonstration is dropped.
  c.sampling.max_prompt_len = 24  # "<bos>99999+99999=" is 13 tokens (24: the base as measured).
  c.sampling.max_new_tokens = 54  # The longest chain is 53 tokens with EOS.
  c.sampling.max_slots = 256  # >= eval.samples_per_problem: a problem's samples decode together.
  c.rl.beta2 = 0.1  # As configs/tiny.py (docs/design.md, "Tiny-task betas").
  c.rl.lag = 10
  c.rl.groups_per_step = 16
  c.rl.groups_per_rollout = 16  # One fresh rollout per step: equal answers per step for every L.
  c.train.steps = 300
  c.train.lr = 3e-4
  c.eval.samples_per_problem = 256  # pass@k for k = 1, 2, 4, ..., 256.
  c.checkpoint.every = 100

  if args["smoke"]:
    c.task.min_digits = 2
    c.task.max_digits = 3
    c.sampling.max_new_tokens = 34
    c.warmup.steps = 30
    c.warmup.noisy_steps = 10
    c.task.num_eval = 4
    c.eval.samples_per_problem = 8
    c.train.steps = 4
    c.rl.lag = 2
    c.rl.groups_per_step = 2
    c.rl.groups_per_rollout = 2
    c.sampling.max_slots = 16
    c.checkpoint.every = 2
  return c
