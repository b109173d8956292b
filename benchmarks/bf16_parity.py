"""bf16 parity: the engine's recorded log-probs vs the trainer kernel's, on the same weights.

OAPL's log-ratio is `trainer log-prob - engine log-prob` summed over an answer, so any gap
between the two kernels on equal weights is noise in the loss. This script measures it on a
fixed workload:

* a small random Qwen3-like model (4 layers, width 512, 4 query / 2 KV heads of 128, MLP
  1024, QK-norm, tied embeddings, vocab 2048); float32 master weights, bfloat16 compute. The
  embedding is drawn with std 0.1 (logits of std ~2: peaked next-token distributions, as in
  a trained LM) and every RMSNorm weight is 1 + 0.1 N(0, 1) (not exactly representable in
  bfloat16, as in a trained model);
* the engine (`oapl_jax.sampling.Engine`, the config's default engine settings) samples
  16 prompts x 4 answers of up to 200 tokens at temperature 1 from the bfloat16 copy of the
  weights (the engine's snapshot);
* the trainer kernel (`oapl_jax.rl.logprobs.token_logprobs`) scores the same rows from the
  float32 master weights (computing in bfloat16).

Prints max and mean |engine - trainer| over answer tokens (nats per token), in bfloat16 and
(the same workload in float32 compute) float32, and bfloat16 again in a child process with
XLA's `--xla_allow_excess_precision=false`: on CPU, XLA emulates bfloat16 dots in float32
and by default drops the f32 -> bf16 -> f32 round trips it finds (the bf16 rounding of a
norm's or a projection's output), differently in the engine's programs and the trainer's,
which on this model is most of the remaining gap.

  python benchmarks/bf16_parity.py [--answers 200] [--prompts 16]
  python benchmarks/bf16_parity.py --check   # the log-prob check against rl.offline.logprob_tol
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax import config as config_lib
from oapl_jax.models import ModelConfig, Transformer
from oapl_jax.models.names import compiler_options
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import Engine, SamplingParams, rollout
from oapl_jax.sampling.engine import engine_settings

MODEL = ModelConfig(vocab_size=2048, hidden_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=128, mlp_dim=1024, qk_norm=True, tie_embeddings=True,
                    param_dtype="float32", dtype="bfloat16")


def random_params(cfg: ModelConfig, seed: int = 0):
  """(graphdef, float32 master params) of a random model (see the module docstring)."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  model.embed[...] = model.embed[...] * 5.0  # std 0.02 -> 0.1
  graphdef, params = nnx.split(model, nnx.Param)
  key = jax.random.key(seed + 1)

  def perturb(path, x):
    if path[-2].key.endswith("norm"):  # RMSNorm weights: 1 + 0.1 N(0, 1)
      return x + 0.1 * jax.random.normal(jax.random.fold_in(key, hash(str(path)) % 2**31), x.shape)
    return x

  params = jax.tree_util.tree_map_with_path(perturb, params)
  return graphdef, params


def measure(cfg: ModelConfig, *, prompts: int, answers: int, group: int = 4, seed: int = 0,
            min_decode_width: int | None = None, exact_rounding: bool = True, rows_apart: bool = False):
  """Returns (gaps over answer tokens `[n]`, number of answer tokens). exact_rounding: the
  engine's and the trainer kernel's programs round to the compute dtype wherever they say
  (`config.model.exact_rounding`); False: XLA's default. rows_apart: returns (the trainer's
  log-probs of the batch in one call, the same one row per call, the engine's, the answer-token
  mask) instead."""
  graphdef, master = random_params(cfg, seed)
  compute = jnp.dtype(cfg.dtype)
  snapshot = jax.tree.map(lambda x: x.astype(compute), master)  # the engine's copy
  sampling = SamplingParams(temperature=1.0)
  prompt_len = 24
  settings = engine_settings(config_lib.defaults("tiny_addition").sampling)
  if min_decode_width is not None:
    settings["min_decode_width"] = min_decode_width
  engine = Engine(graphdef, cfg, sampling, max_slots=prompts * group,
                  max_prefill_length=prompt_len, max_len=prompt_len + answers,
                  exact_rounding=exact_rounding, **settings)
  rng = np.random.default_rng(seed)
  ps = [[1] + list(rng.integers(3, cfg.vocab_size, rng.integers(4, prompt_len))) for _ in range(prompts)]
  ro = rollout(engine, snapshot, ps, group_size=group, max_new_tokens=answers, eos_id=-1,
               pad_id=0, key=jax.random.key(seed))
  batch = make_batch(ro, np.zeros(ro.num_samples), seq_len=prompt_len + answers, pad_id=0)
  score = jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t, sampling)[0],
                  compiler_options=compiler_options(exact_rounding))
  trainer = np.asarray(score(master, jnp.asarray(batch.tokens)))
  mask = batch.mask > 0
  if rows_apart:
    alone = np.concatenate([np.asarray(score(master, jnp.asarray(batch.tokens[i:i + 1])))
                            for i in range(len(batch.tokens))])
    return trainer, alone, batch.sampler_logprobs, mask
  return np.abs(trainer - batch.sampler_logprobs)[mask], int(mask.sum())


def check_margin(cfg: ModelConfig, *, prompts: int, answers: int, check_rows: int = 16,
                 draws: int = 2000, seed: int = 0) -> dict:
  """What `rl.offline.logprob_tol` is compared with, on this workload: the offline / remote check
  rescores `check_rows` answers one row per call (`offline.logprob_fn`) and takes the mean
  |stored - recomputed| over their tokens, while the train step scores each row inside its batch.
  Returns the in-batch vs one-row-per-call gap of the trainer kernel (mean, max per token), the
  engine's gap to each, and the check's statistic over `draws` random sets of `check_rows`
  answers (median, max)."""
  batch_lp, alone, engine, mask = measure(cfg, prompts=prompts, answers=answers, seed=seed, rows_apart=True)
  rng = np.random.default_rng(seed)
  per_row = [(np.abs(alone[i] - engine[i])[mask[i]].sum(), mask[i].sum()) for i in range(len(mask))]
  stats = []
  for _ in range(draws):
    pick = rng.choice(len(per_row), size=min(check_rows, len(per_row)), replace=False)
    stats.append(sum(per_row[i][0] for i in pick) / sum(per_row[i][1] for i in pick))
  apart = np.abs(batch_lp - alone)[mask]
  return {"in_batch_vs_alone_mean": float(apart.mean()), "in_batch_vs_alone_max": float(apart.max()),
          "engine_vs_in_batch_mean": float(np.abs(batch_lp - engine)[mask].mean()),
          "engine_vs_alone_mean": float(np.abs(alone - engine)[mask].mean()),
          "check_median": float(np.median(stats)), "check_max": float(np.max(stats)), "tokens": int(mask.sum())}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--answers", type=int, default=200)
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--check", action="store_true",
                      help="the log-prob check's statistic against rl.offline.logprob_tol (check_margin)")
  parser.add_argument("--seeds", type=int, default=3, help="with --check: workloads (model and prompt seeds)")
  args = parser.parse_args()
  flags = os.environ.get("XLA_FLAGS", "")
  if args.check:
    tol = config_lib.defaults("tiny_addition").rl.offline.logprob_tol
    for seed in range(args.seeds):
      m = check_margin(MODEL, prompts=args.prompts, answers=args.answers, seed=seed)
      print(f"seed {seed} ({m['tokens']} answer tokens, bfloat16, exact rounding): trainer in one call vs one row "
            f"per call: mean {m['in_batch_vs_alone_mean']:.2e}, max {m['in_batch_vs_alone_max']:.2e}; engine vs "
            f"trainer in batch {m['engine_vs_in_batch_mean']:.2e}, one row per call {m['engine_vs_alone_mean']:.2e}; "
            f"the check's statistic (16 answers): median {m['check_median']:.2e}, max {m['check_max']:.2e} "
            f"(logprob_tol {tol}: {tol / m['check_max']:.1f}x the max)", flush=True)
    return
  for dtype in args.dtypes.split(","):
    cfg = dataclasses.replace(MODEL, dtype=dtype)
    gap, n = measure(cfg, prompts=args.prompts, answers=args.answers)
    print(f"{dtype:9s} compute ({'XLA_FLAGS=' + flags if flags else 'default XLA flags'}): {n} answer "
          f"tokens, |engine - trainer| log-prob gap: max {gap.max():.3e}, mean {gap.mean():.3e} nats/token",
          flush=True)
  if "excess_precision" not in flags:
    env = {**os.environ, "XLA_FLAGS": flags + " --xla_allow_excess_precision=false"}
    subprocess.run([sys.executable, __file__, "--prompts", str(args.prompts), "--answers",
                    str(args.answers), "--dtypes", "bfloat16"], env=env, check=True)


if __name__ == "__main__":
  main()
