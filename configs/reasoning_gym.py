"""OAPL on a procedural reasoning_gym task: Qwen3-0.6B on `chain_sum` (a small, fast study run).

  python -m oapl_jax.main --config=configs/reasoning_gym.py --workdir=/mnt/runs/rg_chain_sum \
      --config.model.path=/mnt/ckpt/Qwen3-0.6B
  python -m oapl_jax.main --config=configs/reasoning_gym.py:dataset=basic_arithmetic ...

  # CPU check of the same code path against a tiny random HF checkpoint:
  python launch/make_tiny_hf.py
  python -m oapl_jax.main --config=configs/reasoning_gym.py:tiny --workdir=/tmp/oapl_rg_tiny

Arg string: comma-separated `tiny`, `lag=N` and/or `dataset=NAME` (any name in
`reasoning_gym.factory.DATASETS`; that dataset's own default settings are used, since
task.dataset_kwargs below are chain_sum's). Problems are generated on the fly, scored by the
dataset's own verifier; the answer is the last <answer>...</answer> of the response
(oapl_jax/tasks/reasoning_gym.py). This run is not in the paper: its sampling settings are this
project's choice; the optimizer and OAPL settings are the paper's (oapl_jax/config.py).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax import config as config_lib

TINY_MODEL = "/tmp/oapl_jax_tiny_hf/tiny_qwen3"  # made by `python launch/make_tiny_hf.py`


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, tiny=bool, lag=int, dataset=str)
  c = config_lib.defaults("tiny_qwen3" if args["tiny"] else "qwen3_0_6b")
  c.model.param_dtype = "bfloat16"
  c.model.dtype = "bfloat16"

  # oapl_jax/tasks/reasoning_gym.py: <answer> tag, the gym's verifier. task_section gives
  # tokenizer_path; the gym's own settings follow.
  c.task = config_lib.task_section("reasoning_gym")
  c.task.dataset = args["dataset"] or "chain_sum"  # reasoning_gym dataset name.
  # Settings passed to reasoning_gym.create_dataset (a dict, or a JSON object string); chain_sum's
  # are written out so that each can be overridden. Never seed/size (those are below).
  c.task.dataset_kwargs = ml_collections.ConfigDict(
      {} if args["dataset"] else dict(min_terms=2, max_terms=6, min_digits=1, max_digits=4))
  c.task.size = 100_000  # Train entries to draw from (generated when first drawn).
  c.task.num_eval = 128  # Held-out problems (from config.seed; train entries use another seed range).
  c.task.thinking = False  # enable_thinking for Qwen3's chat template (None = not passed).

  c.sampling.max_prompt_len = 512
  c.sampling.max_new_tokens = 1024
  c.sampling.max_slots = 256
  c.rl.lag = args["lag"] or 50
  c.rl.groups_per_step = 32
  c.rl.groups_per_rollout = 32
  c.train.steps = 500
  c.train.grad_accum = 1
  c.eval.samples_per_problem = 16

  if args["tiny"]:
    config_lib.shrink_for_cpu(c, TINY_MODEL)
    c.task.size = 1000
    c.task.num_eval = 4
    c.task.thinking = placeholder(bool)
    c.sampling.max_prompt_len = 256
    c.rl.lag = args["lag"] or 2
  return c
