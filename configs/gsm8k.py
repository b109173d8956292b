"""OAPL on grade-school math: Qwen3-0.6B on GSM8K, on the one device of a Colab-class runtime.

  # The weights and the data on local disk (any way that gives the files; docs/real_model.md):
  python -m oapl_jax.main --config=configs/gsm8k.py --workdir=/tmp/oapl_gsm8k \
      --config.model.path=/data/Qwen3-0.6B \
      --config.task.train_path=/data/gsm8k/main/train-00000-of-00001.parquet \
      --config.task.eval_path=/data/gsm8k/main/test-00000-of-00001.parquet
  # GSM8K through TFDS's huggingface: namespace (splits train / test), prepared into data_dir
  # beforehand; TFDS resolves the name through the Hub's API, so this needs network at run time:
  python -m oapl_jax.main --config=configs/gsm8k.py --workdir=/tmp/oapl_gsm8k \
      --config.model.path=/data/Qwen3-0.6B --config.task.data_dir=/data/tfds \
      --config.task.train_path=tfds:huggingface:gsm8k/main \
      --config.task.eval_path=tfds:huggingface:gsm8k/main
  # Only when asked: fetch Qwen/Qwen3-0.6B and openai/gsm8k's Parquet files from the Hugging Face
  # Hub into its cache (huggingface_hub.snapshot_download); prints the three settings to add:
  python -m configs.gsm8k --fetch
  # A 40-80 GB device (A100 / H100 80 GB, L40S 48 GB): longer answers, a larger batch:
  python -m oapl_jax.main --config=configs/gsm8k.py:large --workdir=/tmp/oapl_gsm8k_large \
      --config.model.path=/data/Qwen3-0.6B \
      --config.task.train_path=/data/gsm8k/main/train-00000-of-00001.parquet \
      --config.task.eval_path=/data/gsm8k/main/test-00000-of-00001.parquet
  # Memory plans of both on one device (no weight is read):
  python -m oapl_jax.main --config=configs/gsm8k.py --config.mesh.topology=h100x1 --dry_run
  python -m oapl_jax.main --config=configs/gsm8k.py:large --config.mesh.topology=h100x1 --dry_run

  # CPU check of the same code path: a tiny random Qwen3 written locally and the 50 problems in
  # configs/data/gsm8k_tiny_{train,eval}.jsonl (a few minutes on 2 cores):
  python launch/make_tiny_hf.py --preset=tiny_qwen3
  python -m oapl_jax.main --config=configs/gsm8k.py:tiny --workdir=/tmp/oapl_gsm8k_tiny

Arg string: comma-separated `tiny`, `large`, `lora`, `lora_4b`, `lora_4b_l4`, `qlora_4b` and/or `lag=N`. Reading this file
downloads nothing.

Rows are GSM8K's: `question` and `answer`, the answer a worked solution ending in `#### N`
(or only the number). The math reward (oapl_jax/rewards/math.py, math-verify) compares the
answer's last `\\boxed{}` (else, with task.fallback_last_number, its last number) to the
reference; on a GSM8K reference math-verify takes the final number after `####` (checked on the
tiny file by tests/test_gsm8k.py).

Fitting 16 GB (Colab's TPU v5e-1 and L4 class): one device holds the trainer and the engine
(sync mode: they take turns). Float32 master weights and AdamW state (bfloat16 ones would lose
lr-1e-6 updates: config.model.param_dtype) with their gradients and the two bfloat16 snapshots of
pi_old are 11.1 GiB of the 0.6 B parameters, so a step is one question's 8 answers, the engine
decodes 16 answers at once and the log-prob kernel works in tiles of 16 tokens: the planner's
estimate is 14.5 GiB per device (`--dry_run` above; tests/test_gsm8k.py keeps it under 14.6 GiB).
That is too tight for a T4 (15 GB, about 14.5 GiB usable after CUDA's own). The `large` variant
(40 GB and up) takes 8 questions per step, 1024-token answers and 64 decode slots (30.4 GiB).
Wall times on Colab runtimes are not measured.

Low-rank adapters (`lora`: rank 16 on every projection, config.model.lora): the base stays frozen
in bfloat16, only the adapters and their AdamW state are float32, so Qwen3-0.6B fits a T4 or a
v5e-1 with two questions per step (8.8 GiB planned), and `lora_4b` puts Qwen3-4B on a 40 GB
A100 (28.2 GiB; a 24 GB L4 is 5.8 GiB short of it). `lora_4b_l4` is `lora_4b` without a standing
merged copy of the weights (model.lora.merge="in_refresh": the refresh merges each layer as it lays
it out for the engine), which puts Qwen3-4B on a 24 GB L4 (21.0 GiB planned). `qlora_4b` is
`lora_4b_l4` over an int8 base (model.base_quant: the trainer's base 4.1 GiB, not 7.5) whose engine
holds its bfloat16 weights (7.5 GiB) only while it samples (sampling.release_weights: laid out
again for each rollout): Qwen3-4B on a 16 GB T4 (13.8 GiB planned) or v5e-1 (14.6). Planned bytes:
docs/real_model.md; `--dry_run` with --config.mesh.topology=t4x1, v5e-1, a100-40gx1 or l4x1.
"""

import glob
import os

import ml_collections

from oapl_jax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # tiny files shipped in the repo
TINY_MODEL = "/tmp/oapl_jax_tiny_hf/tiny_qwen3"  # made by `python launch/make_tiny_hf.py`
TINY_TRAIN = os.path.join(DATA, "gsm8k_tiny_train.jsonl")  # 42 original GSM8K-format problems
TINY_EVAL = os.path.join(DATA, "gsm8k_tiny_eval.jsonl")  # 8 more, held out
HUB_MODEL = "Qwen/Qwen3-0.6B"  # Hugging Face repo of the weights (the `hub` variant)
HUB_DATA = "openai/gsm8k"  # Hugging Face dataset repo of GSM8K (the `hub` variant: its Parquet files)
TFDS_DATA = "tfds:huggingface:gsm8k/main"  # GSM8K through TFDS's huggingface: namespace (needs the Hub's API)


def hub_files() -> tuple[str, str, str]:
  """(model folder, train Parquet, test Parquet) fetched from the Hub into its local cache.

  Only `python -m configs.gsm8k --fetch` and notebooks/real_model.ipynb call it: reading the
  config touches no network. ValueError (one line) if the Hub cannot be reached.
  """
  from huggingface_hub import snapshot_download  # noqa: PLC0415 (only the fetch needs it)

  try:
    model = snapshot_download(HUB_MODEL, allow_patterns=["*.json", "*.safetensors", "*.txt"])
    data = snapshot_download(HUB_DATA, repo_type="dataset", allow_patterns=["main/*.parquet"])
  except Exception as e:  # noqa: BLE001 - no network, the Hub unreachable, a gated repo: one line
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ValueError(f"cannot fetch {HUB_MODEL} / {HUB_DATA} from the Hugging Face Hub "
                     f"({type(e).__name__}: {first}); give --config.model.path and "
                     "--config.task.train_path / eval_path to local copies instead") from None
  train = sorted(glob.glob(os.path.join(data, "main", "train-*.parquet")))
  test = sorted(glob.glob(os.path.join(data, "main", "test-*.parquet")))
  if len(train) != 1 or len(test) != 1:
    raise ValueError(f"{HUB_DATA} in {data}: expected one train and one test Parquet file under "
                     f"main/, found {len(train)} and {len(test)}")
  return model, train[0], test[0]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_lib.parse_arg(arg, tiny=bool, large=bool, lora=bool, lora_4b=bool, lora_4b_l4=bool,
                              qlora_4b=bool, lag=int)
  args["lora_4b_l4"] = args["lora_4b_l4"] or args["qlora_4b"]
  args["lora_4b"] = args["lora_4b"] or args["lora_4b_l4"]
  preset = "tiny_qwen3" if args["tiny"] else "qwen3_4b" if args["lora_4b"] else "qwen3_0_6b"
  c = config_lib.defaults(preset)
  c.model.param_dtype = "float32"  # Master weights and AdamW state (bfloat16 would lose lr-1e-6 updates).
  c.model.dtype = "bfloat16"  # Compute, and the engine's copy of pi_old.
  c.train.remat = "full"  # Recompute each block in the backward pass: 512-token answers in 16 GB.

  # oapl_jax/tasks/math.py: chat prompt + "\boxed{}" instruction, math-verify reward.
  c.task = config_lib.task_section("math")
  # Sources (task.train_path / eval_path, not set here): GSM8K's train (7473 problems) and test
  # (1319) Parquet files, JSONL in the same fields, or TFDS_DATA with train_split / eval_split.
  c.task.question_field = "question"  # GSM8K's field names.
  c.task.answer_field = "answer"  # Field holding the reference: a worked solution ending "#### N", or N.
  c.task.num_eval = 128  # First 128 test problems for pass@k before and after (all 1319: None).
  c.task.skip_bad_rows = True  # A prompt longer than sampling.max_prompt_len is skipped and counted, not fatal.
  c.task.thinking = False  # Qwen3's chat template without <think>: short answers, no thinking trace.
  c.task.fallback_last_number = True  # Without a \boxed{}, grade the last number (GSM8K answers are numbers).
  c.task.reward_workers = 1  # Processes scoring answers (math-verify); 1 = in the trainer process (Colab's 2 cores).

  c.sampling.temperature = 1.0  # On-policy samples for OAPL; pass@k at the same temperature.
  c.sampling.max_prompt_len = 320  # GSM8K questions with the chat template: up to ~250 tokens.
  c.sampling.max_new_tokens = 512  # Non-thinking answers to GSM8K: ~150-300 tokens.
  c.sampling.max_slots = 16  # Answers decoded at once: 2 groups of 8 (KV cache 1.4 GiB).
  c.sampling.engines = 1  # One device: the engine shares it with the trainer.
  c.rl.lag = args["lag"] or 10  # Refresh pi_old every 10 steps: several refreshes in a short run on one device (paper: 50 over 1000 steps).
  c.rl.group_size = 8  # G answers per question (paper: 8).
  c.rl.groups_per_step = 1  # One question's 8 answers per trainer step (16 GB; paper: 32).
  c.rl.groups_per_rollout = 2  # The engine samples 2 groups per call (fills its 16 slots).
  c.train.grad_accum = 1  # No accumulation: a running gradient sum would cost another 2.2 GiB.
  c.train.logprob_tile = 16  # Log-prob kernel: [8, 16, 151936] float32 logits tiles (~0.5 GiB).
  c.train.steps = 500  # Trainer steps (the notebook stops earlier, at its budget of minutes); wall time not measured.
  c.train.lr = 1e-6  # Paper's AdamW lr.
  c.eval.samples_per_problem = 8  # pass@1 .. pass@8.
  c.checkpoint.every = 50

  if args["large"]:  # 40-80 GB
    c.sampling.max_new_tokens = 1024
    c.sampling.max_slots = 64  # 8 groups at once (KV cache ~9 GiB; plan ~30 GiB: an A100 40 GB fits).
    c.rl.groups_per_step = 8  # 64 answers per step.
    c.rl.groups_per_rollout = 8
    c.train.grad_accum = 4  # Micro-batches of 2 groups (16 rows x 1344 tokens).
    c.train.logprob_tile = 64
    c.eval.samples_per_problem = 16

  if args["lora"] or args["lora_4b"]:  # low-rank adapters: a frozen bfloat16 base (docs/real_model.md)
    c.model.lora.rank = 16  # Adapters on every projection of every block.
    c.model.lora.alpha = 32.0  # Their output scaled by alpha / rank = 2.
    c.model.lora.init_from = None  # Or a PEFT adapter folder (r=16, lora_alpha=32, all 7 projections) to start from.
    c.train.lr = 1e-5  # Adapters start at zero and move through a rank-16 product: larger steps than full training's 1e-6.
    c.rl.groups_per_step = 2  # Two questions' 16 answers per step: the memory full training spends on AdamW.
    c.rl.groups_per_rollout = 2  # The engine's 16 slots hold one step's groups.
  if args["lora_4b"]:  # Qwen3-4B on a 40 GB device (A100 40 GB; 28.2 GiB planned): --config.model.path=/data/Qwen3-4B
    c.rl.groups_per_step = 1  # One question's 8 answers per step.
    c.sampling.max_slots = 8  # One group decoded at once (a 36-layer KV cache).
    c.rl.groups_per_rollout = 1
  if args["lora_4b_l4"]:  # Qwen3-4B on a 24 GB L4 (l4x1): 21.0 GiB planned, 1.3 GiB to spare
    c.model.lora.merge = "in_refresh"  # No standing merged copy (7.5 GiB): merged layer by layer at each refresh.
  if args["qlora_4b"]:  # Qwen3-4B on a 16 GB T4 or v5e-1: 13.8 / 14.6 GiB planned
    c.model.base_quant = "int8"  # The frozen base's projections in int8: 4.1 GiB, not 7.5 (the engine's copy stays bf16).
    c.sampling.release_weights = True  # The engine's bf16 copy (7.5 GiB) only while it samples, laid out per rollout.

  if args["tiny"]:
    config_lib.shrink_for_cpu(c, TINY_MODEL)  # float32, 4 RL steps, lag 2, 2 groups per step
    c.task.train_path = TINY_TRAIN
    c.task.eval_path = TINY_EVAL
    c.task.num_eval = None  # All 8.
    c.sampling.max_prompt_len = 256  # The tiny byte-level tokenizer spends ~1 token per character.
    c.sampling.max_new_tokens = 16
    c.rl.lag = args["lag"] or 2
  return c


if __name__ == "__main__":
  import sys

  if sys.argv[1:] != ["--fetch"]:
    sys.exit("usage: python -m configs.gsm8k --fetch  (downloads Qwen3-0.6B and GSM8K from the Hub "
             "into its cache and prints the settings to add)")
  try:
    model_dir, train_file, test_file = hub_files()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"--config.model.path={model_dir} --config.task.train_path={train_file} "
        f"--config.task.eval_path={test_file}")
