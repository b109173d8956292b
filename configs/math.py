"""OAPL on competition math: Qwen3-4B-Thinking-2507 on DeepScaleR prompts (the paper's math run).

  python -m oapl_jax.main --config=configs/math.py --workdir=/mnt/runs/math_l50 \
      --config.model.path=/mnt/ckpt/Qwen3-4B-Thinking-2507 \
      --config.task.train_path=/mnt/data/deepscaler.jsonl \
      --config.task.eval_path=/mnt/data/aime2025.jsonl
  python -m oapl_jax.main --config=configs/math.py:lag=100 ...   # the paper's other stable lag

  # CPU check of the same code path against a tiny random HF checkpoint:
  python launch/make_tiny_hf.py
  python -m oapl_jax.main --config=configs/math.py:tiny --workdir=/tmp/oapl_math_tiny

  # The Python tool (oapl_jax/envs/python_tool.py, docs/agents.md): the env section offers it in
  # Qwen3's tool format; `tiny,tools` for the CPU check:
  python -m oapl_jax.main --config=configs/math.py:tools --dry_run

Arg string: comma-separated `tiny`, `tools` and/or `lag=N`. `tools` sets the env section only:
runs sample single answers until the engine samples trajectories (docs/agents.md, "What is
built").
Settings the paper fixes (docs/algorithm.md, "The paper's settings"): G = 8, L = 50 (100 also
stable), beta1 = 1, beta2 = 1e-3, AdamW lr 1e-6, betas (0.9, 0.95), eps 1e-10, no weight decay,
cosine schedule with 2% warm-up and min-lr ratio 0.05, grad-norm clip 1.0. The answer length
and temperature of the math runs are not in our copy of the paper: 16384 new tokens at
temperature 1.0 are this project's choice.
"""

import math
import os

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax import config as config_lib

TINY_MODEL = "/tmp/oapl_jax_tiny_hf/tiny_qwen3"  # made by `python launch/make_tiny_hf.py`
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # tiny files shipped in the repo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, tiny=bool, lag=int, tools=bool)
  c = config_lib.defaults("tiny_qwen3" if args["tiny"] else "qwen3_4b_thinking_2507")
  c.model.param_dtype = "float32"  # Master weights and AdamW state (bfloat16 would lose lr-1e-6 updates).
  c.model.dtype = "bfloat16"  # Compute, and the engines' copy of pi_old.
  c.train.remat = "full"  # Long answers: recompute each block in the backward pass.

  # oapl_jax/tasks/math.py: chat prompt + "\boxed{}" instruction, math-verify reward. Sources,
  # question_field, num_eval, tokenizer_path: config_lib.task_section. Training prompts: DeepScaleR
  # (fields "problem", "answer"); held-out problems: AIME 2025, HMMT 2025, BRUMO 2025.
  c.task = config_lib.task_section("math")
  c.task.answer_field = "answer"  # Field holding the reference answer.
  c.task.thinking = True  # Passed to the chat template as enable_thinking (None = not passed).
  c.task.fallback_last_number = False  # Without a \boxed{}, grade the last number in the answer.
  c.task.reward_workers = 2  # Processes scoring answers with math-verify (1 = in the trainer process).

  c.sampling.max_prompt_len = 1024
  c.sampling.max_new_tokens = 16384
  c.sampling.max_slots = 256  # In total: 32 per engine.
  c.sampling.engines = 8  # 8 replicas x 4 devices: the KV cache (612 GiB) spread to ~19 GiB per v5p chip.
  c.sampling.tensor = 4
  c.sampling.cache_bucket = 128  # Whole 128-lane TPU tiles: below 128 positions XLA:TPU's decode loop holds a padded copy of the keys.
  c.rl.lag = args["lag"] or 50
  c.rl.groups_per_step = 32
  c.rl.groups_per_rollout = 32
  # 10 steps' answers in one continuous batch (a divisor of the lag): slot utilisation ~0.5 -> ~0.9
  # with answers spread over 0-16k tokens; 0.1 GiB of host memory per v5p-64 host; a preemption
  # loses at most 10 steps' sampling (docs/performance.md "Window rollouts").
  c.rl.window_rollouts = math.gcd(10, c.rl.lag)
  c.train.steps = 1000
  c.train.grad_accum = 8
  # Packed rows (docs/design.md "Packed rows"): a step computes its answers' tokens, not padding to
  # the longest; on answers spread evenly over 0-16k the compiled step has 1.8x fewer FLOPs (math.py,
  # v5p-64: 5 of 8 micro-batches run; docs/performance.md). Rows of seq_len tokens, as many per
  # micro-batch as a padded micro-batch's; each host packs its own answers.
  c.train.packing = True
  c.eval.samples_per_problem = 16

  if args["tools"]:
    # oapl_jax/envs/python_tool.py: the model may call python(code), run in the bubblewrap sandbox,
    # written and answered in Qwen3's format (<tool_call> JSON, <tool_response> turns); the task
    # scores the final plain turn as it scores an answer.
    c.env.name = "python"
    c.env.max_turns = 8  # Model turns per episode: up to 7 turns of tool calls before the answer.
    c.env.tool_timeout_s = 10.0  # Wall-clock seconds per program (its CPU limit: the same + 1 s).
    c.env.tool_output_chars = 2000  # Characters of a program's stdout the model sees; the rest is cut.
    c.env.sandbox_memory_mb = 1024  # Address-space limit of a program (as configs/code.py's tests).
    c.env.allow_unsandboxed = False  # Without bubblewrap each call is refused (the model told so), never run bare.

  if args["tiny"]:
    config_lib.shrink_for_cpu(c, TINY_MODEL)
    c.task.train_path = os.path.join(DATA, "math_tiny_train.jsonl")
    c.task.eval_path = os.path.join(DATA, "math_tiny_eval.jsonl")
    c.task.question_field = "question"
    c.task.thinking = placeholder(bool)
    c.sampling.max_prompt_len = 128
    c.rl.lag = args["lag"] or 2
    c.rl.window_rollouts = 1
  return c
