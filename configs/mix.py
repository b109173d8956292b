"""Four column rules in one task: 3-digit addition, subtraction, multiplication by a digit and by a
two-digit number, each answered by a chain of steps (up to 46 tokens), on CPU (issue 41: a task
meant not to saturate).

The reasoning task of configs/reason.py has one rule to learn (write the carry): every method
ends near pass@1 1 and pass@k = 1 for k > 1. Here each problem's operation is drawn from
task.operations and has its own rule (oapl_jax/tasks/chain_mix.py): three carry rules the base's
noisy demonstrations break, and the two-digit product table ("x"), demonstrated cleanly, which
the base knows only in part and RL learns fact by fact. Same model and RL settings as reason.py;
a longer warm-up (3000 steps). Calibration (the sixth candidate of docs/reasoning_task.md, "The
mixed task"): base pass@1 0.243 (x 0.31), pass@64 0.734; GRPO+IS at L = 1 ends at 0.842 after
1000 steps (x 0.46).

  python -m oapl_jax.main --config=configs/mix.py --workdir=/tmp/oapl_mix
  python -m oapl_jax.main --config=configs/mix.py:smoke --workdir=/tmp/oapl_mix_smoke  # CI

Variants through the arg string: `smoke` (a few steps, for tests and CI).
Every setting and its comment: oapl_jax/config.py `defaults`; this file overrides a few.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, smoke=bool)
  c = config_lib.repo_config("reason.py:smoke" if args["smoke"] else "reason.py")  # all but the task
  task = config_lib.task_section("chain_mix")  # oapl_jax/tasks/chain_mix.py
  task.min_digits = 3  # Fewest digits per operand (the multipliers: one digit 2-9, or two 10-99).
  task.max_digits = 3  # Most digits per operand: chains of up to 45 tokens with EOS ("x").
  task.num_eval = c.task.num_eval  # Held-out problems (never drawn for training).
  task.operations = "+-*x"  # Operations drawn uniformly per problem: "+", "-", "*" (by one digit), "x" (by two digits).
  task.noisy_operations = "+-*"  # Operations whose noisy warm-up demonstrations drop carries; None = all ("x" is learned from clean ones).
  c.task = task
  c.warmup.digit_noise = 0.7  # Chance each carry or borrow of a noisy demonstration is dropped.
  c.sampling.max_new_tokens = 46  # The longest chain ("x", 3 digits) and room to spare.
  if not args["smoke"]:
    c.warmup.steps = 3000  # The two-digit table needs 3x reason.py's warm-up (1000 steps: x solved 0.007).
  return c
