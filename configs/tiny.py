"""The embedded default: OAPL on two-digit addition with a tiny Qwen3-style model, on CPU.

The run: supervised warm-up (clean, then noisy demonstrations: the base model, pass@1 about
0.1-0.3) -> eval before -> OAPL training in sync mode -> eval after. A few minutes on 2 cores.

  python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/oapl_tiny
  python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/oapl_tiny_s3 \
      --config.seed=3 --config.rl.lag=20
  python -m oapl_jax.main --config=configs/tiny.py:smoke --workdir=/tmp/oapl_smoke  # seconds; CI
  python -m oapl_jax.main --config=configs/tiny.py:lora --workdir=/tmp/oapl_tiny_lora
  python -m oapl_jax.main --config=configs/tiny.py:lora,int8 --workdir=/tmp/oapl_tiny_qlora

Variants through the arg string: `smoke` (a few steps, for tests and CI); `lora` (rank-8
adapters on the warmed-up base, which stays frozen: docs/real_model.md "Low-rank adapters");
`int8` (with `lora`: the frozen base quantised to int8, `model.base_quant`).
Every setting and its comment: oapl_jax/config.py `defaults`; this file overrides a few.
"""

import ml_collections

from oapl_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, smoke=bool, lora=bool, int8=bool)
  c = config_lib.defaults("tiny_addition")  # model: 2 layers, width 128, 18-token vocabulary

  c.task = config_lib.task_section("addition")  # Embedded procedural task (oapl_jax/tasks/arithmetic.py).
  c.task.min_digits = 2  # Fewest digits per operand.
  c.task.max_digits = 2  # Most digits per operand.
  c.task.num_eval = 128  # Held-out problems (never drawn for training).

  c.warmup.steps = 1500  # The base model is made in the run: 1300 clean + 200 noisy steps.
  c.warmup.noisy_steps = 200
  c.warmup.digit_noise = 0.25
  c.sampling.max_prompt_len = 8  # "<bos>99+99=" is 7 tokens.
  c.sampling.max_new_tokens = 6  # Answers need <= 4 (3 digits + EOS).
  c.sampling.max_slots = 128
  c.rl.beta2 = 0.1  # Not the paper's 1e-3: see docs/design.md ("Tiny-task betas").
  c.rl.lag = 10
  c.rl.groups_per_step = 16
  c.rl.groups_per_rollout = 32
  c.train.steps = 300
  c.train.lr = 3e-4  # A tiny model trained in minutes, not a 4B one over days.

  if args["lora"]:
    c.model.lora.rank = 8  # Adapters on every projection; the warmed-up base is frozen.
    c.model.lora.alpha = 16.0
    c.train.lr = 2e-3  # Adapters start at zero and move through a rank-8 product: a larger step.
  if args["int8"]:  # with lora: the frozen base's projections held as int8 (QLoRA-style)
    c.model.base_quant = "int8"

  if args["smoke"]:
    c.warmup.steps = 30
    c.warmup.noisy_steps = 10
    c.task.num_eval = 8
    c.eval.samples_per_problem = 4
    c.train.steps = 6
    c.rl.lag = 3
    c.rl.groups_per_step = 4
    c.rl.groups_per_rollout = 6
    c.sampling.max_slots = 32
    c.checkpoint.every = 2
  return c
