"""OAPL on code: DeepSeek-R1-Distill-Qwen-14B on DeepCoder's training set (the paper's code run).

  python -m oapl_jax.main --config=configs/code.py --workdir=/mnt/runs/code \
      --config.model.path=/mnt/ckpt/DeepSeek-R1-Distill-Qwen-14B \
      --config.task.train_path=/mnt/data/deepcoder_train.jsonl \
      --config.task.eval_path=/mnt/data/livecodebench.jsonl

  # CPU check of the same code path against a tiny random HF checkpoint (Qwen2 architecture):
  python launch/make_tiny_hf.py
  python -m oapl_jax.main --config=configs/code.py:tiny --workdir=/tmp/oapl_code_tiny

The paper's code settings (docs/algorithm.md): prompts <= 4096 tokens, answers <= 32000,
temperature 0.6, top-p 0.95, a batch of 256 prompts per optimizer step, the optimizer of
configs/math.py, and two rounds of training with the engine refreshed after about 400 steps
(lag 400, 800 steps). The paper trains 4 epochs on each round's fixed samples; our sync loop
instead draws fresh samples from the same pi_old throughout a round (same lag, no sample reuse);
`--config.rl.mode=offline` trains on fixed rounds as the paper does (docs/offline.md).
"""

import os

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax import config as config_lib

TINY_MODEL = "/tmp/oapl_jax_tiny_hf/tiny_qwen2"  # made by `python launch/make_tiny_hf.py`
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # tiny files shipped in the repo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  tiny = config_lib.parse_arg(arg, tiny=bool)["tiny"]
  c = config_lib.defaults("tiny_qwen2" if tiny else "r1_distill_qwen_14b")
  c.model.param_dtype = "float32"  # Master weights and AdamW state (bfloat16 would lose lr-1e-6 updates).
  c.model.dtype = "bfloat16"  # Compute, and the engines' copy of pi_old.
  c.train.remat = "full"  # Long answers: recompute each block in the backward pass.

  # oapl_jax/tasks/code.py: problem + format instruction; sandboxed tests. Sources,
  # question_field, num_eval, tokenizer_path: config_lib.task_section. Training problems:
  # DeepCoder; held-out problems: LiveCodeBench.
  c.task = config_lib.task_section("code")
  c.task.tests_field = "tests"  # Field holding the tests (dict, JSON string, or LiveCodeBench list).
  c.task.thinking = placeholder(bool)  # enable_thinking for the chat template (None = not passed).
  c.task.timeout_s = 6.0  # Wall-clock limit per test run in the sandbox.
  c.task.memory_mb = 1024  # Address-space limit of the sandboxed program.
  c.task.partial_credit = False  # Reward = fraction of tests passed instead of all-or-nothing.
  c.task.allow_unsandboxed = False  # Run with rlimits only if bubblewrap is missing (unsafe).

  c.sampling.temperature = 0.6
  c.sampling.top_p = 0.95
  c.sampling.max_prompt_len = 4096
  c.sampling.max_new_tokens = 32000
  c.sampling.max_slots = 256  # In total: 16 per engine.
  c.sampling.engines = 16  # 16 replicas x 4 devices: the KV cache (1.7 TiB) spread to ~26 GiB per v5p chip.
  c.sampling.tensor = 4
  c.sampling.cache_bucket = 128  # Whole 128-lane TPU tiles: below 128 positions XLA:TPU's decode loop holds a padded copy of the keys.
  c.rl.lag = 400
  c.rl.groups_per_step = 256
  c.rl.groups_per_rollout = 256
  # 10 steps' answers in one continuous batch (divides the lag): a step's 8 waves per engine no
  # longer end in a drain each; 0.8 GiB of host memory per v5p-128 host (the plan's "host").
  c.rl.window_rollouts = 10
  c.train.steps = 800
  c.train.grad_accum = 32  # 64-row micro-batches: one row per device of a v5p-128 (fsdp 64).
  # Packed rows (docs/design.md "Packed rows"): a step computes its answers' tokens, not padding to
  # the longest; on answers spread evenly over 0-16k the compiled step has 1.8x fewer FLOPs (math.py,
  # v5p-64: 5 of 8 micro-batches run; docs/performance.md). Rows of seq_len tokens, as many per
  # micro-batch as a padded micro-batch's; each host packs its own answers.
  c.train.packing = True
  c.eval.samples_per_problem = 16

  if tiny:
    config_lib.shrink_for_cpu(c, TINY_MODEL)
    c.task.train_path = os.path.join(DATA, "code_tiny_train.jsonl")
    c.task.eval_path = os.path.join(DATA, "code_tiny_eval.jsonl")
    c.sampling.max_prompt_len = 256
    c.rl.window_rollouts = 1
  return c
