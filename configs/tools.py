"""The built-in tool task: the mixed chain task's two-digit products with a calculator the model
may call, on CPU (issue 61 point 5).

Each problem is "axn=" (a of 3 digits, n of 2), answered by a chain of column steps
(oapl_jax/tasks/chain_mix.py) or, in a multi-turn trajectory, by a call to the calculator
environment (oapl_jax/envs/calculator.py) and the result copied (oapl_jax/tasks/tool_mix.py).
The base's chains drop carries (noisy warm-up demonstrations) and only a few of its
demonstrations call the calculator, so it calls rarely and solves few problems; RL can find
that the call pays. Calibration and the measured runs: docs/tools_task.md.

  python -m oapl_jax.main --config=configs/tools.py --workdir=/tmp/oapl_tools
  python -m oapl_jax.main --config=configs/tools.py:smoke --workdir=/tmp/oapl_tools_smoke  # CI

Variants through the arg string: `smoke` (a few steps, for tests and CI).
Every setting and its comment: oapl_jax/config.py `defaults`; this file overrides a few.
"""

import ml_collections

from oapl_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, smoke=bool)
  c = config_lib.repo_config("reason.py:smoke" if args["smoke"] else "reason.py")  # model, RL settings
  task = config_lib.task_section("tool_mix")  # oapl_jax/tasks/tool_mix.py
  task.min_digits = 3  # Fewest digits of the first operand (the multiplier: two digits, 10-99).
  task.max_digits = 3  # Most digits of the first operand: chains of 43 tokens with EOS.
  task.num_eval = c.task.num_eval  # Held-out problems (never drawn for training).
  task.operations = "x"  # Products by a two-digit number only (chain_mix's hardest rule).
  task.noisy_operations = "x"  # Their noisy warm-up chains drop carries (warmup.digit_noise).
  task.tool_demos = 0.15  # Fraction of warm-up demonstrations that call the calculator (always right; 0.05 on seed 1: base pass@1 0.006, docs/tools_task.md).
  c.task = task
  c.env.name = "calculator"  # calculator(expression), answered in the trajectory (envs/calculator.py).
  c.env.max_turns = 2  # A call and the answer; a second call ends the episode (scored as it stands).
  c.env.max_env_tokens = 12  # A reply: <tool_response>, up to 10 characters, </tool_response> (a wider one ends the trajectory).
  c.warmup.digit_noise = 0.7  # Chance each carry of a noisy chain demonstration is dropped.
  c.sampling.max_new_tokens = 46  # The longest chain (43 tokens with EOS) and room to spare.
  c.train.steps = 200  # RL steps.
  c.eval.every = 50  # Held-out pass@1 and tool-call rate every 50 steps.
  c.eval.samples_per_problem = 32  # pass@k for k = 1 .. 32.
  if args["smoke"]:
    c.task.tool_demos = 0.5  # Half of its few demonstrations call: the call format is learned in its short warm-up.
    c.warmup.steps = 40  # Enough for well-formed calls the calculator answers (tests/test_tools_task.py), not for right answers.
    c.warmup.noisy_steps = 10  # The last 10 on noisy chains.
    c.sampling.max_new_tokens = 46  # The full run's problems (reason.py:smoke has 34: shorter chains).
    c.train.steps = 4  # A few OAPL steps (reason.py:smoke's lag 2, 2 groups per step).
    c.eval.every = 0  # Evaluations before and after only.
    c.eval.samples_per_problem = 8  # 8 trajectories per held-out problem (reason.py:smoke's 4 problems).
  return c
