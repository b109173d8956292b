"""Three column rules in one task: 5-digit addition, subtraction and multiplication by a digit,
each answered by a chain of steps (52-54 tokens), on CPU (issue 41: a task meant not to saturate).

The reasoning task of configs/reason.py has one rule to learn (write the carry): every method
ends near pass@1 1 and pass@k = 1 for k > 1. Here each problem's operation is drawn from
task.operations and has its own carry rule (oapl_jax/tasks/chain_mix.py); the base's noisy
demonstrations drop carries and borrows. Same model, warm-up and RL settings as reason.py.

  python -m oapl_jax.main --config=configs/mix.py --workdir=/tmp/oapl_mix
  python -m oapl_jax.main --config=configs/mix.py:smoke --workdir=/tmp/oapl_mix_smoke  # CI

Variants through the arg string: `smoke` (a few steps, for tests and CI).
Every setting and its comment: oapl_jax/config.py `defaults`; this file overrides a few.
Its base's calibration: docs/reasoning_task.md, "The mixed task".
"""

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, smoke=bool)
  c = config_lib.repo_config("reason.py:smoke" if args["smoke"] else "reason.py")  # all but the task
  task = config_lib.task_section("chain_mix")  # oapl_jax/tasks/chain_mix.py
  task.min_digits = c.task.min_digits  # Fewest digits per operand (the multiplier: one digit, 2-9).
  task.max_digits = c.task.max_digits  # Most digits per operand: chains of up to 53 tokens with EOS.
  task.num_eval = c.task.num_eval  # Held-out problems (never drawn for training).
  task.operations = "+-*"  # Operations drawn uniformly per problem: "+", "-", "*" (by one digit), "x" (by two digits).
  task.noisy_operations = placeholder(str)  # Operations whose noisy warm-up demonstrations drop carries; None = all.
  c.task = task
  c.warmup.digit_noise = 0.5  # Chance each carry or borrow of a noisy demonstration is dropped.
  return c
