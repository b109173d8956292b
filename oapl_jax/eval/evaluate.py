"""pass@k of a policy on the task's held-out problems, sampled through a `Sampler`."""

from __future__ import annotations

import jax

from oapl_jax import distributed
from oapl_jax.eval.passk import default_ks, pass_at_k_table
from oapl_jax.sampling.sampler import Sampler

EVAL_KEY_SALT = 1_000_003  # eval draws fold this into the seed's key: the same draws before/after


def eval_key(seed: int) -> jax.Array:
  """The sampling key of every evaluation of a run (same draws before, during and after)."""
  return jax.random.fold_in(jax.random.key(seed), EVAL_KEY_SALT)


def evaluate(sampler: Sampler, params, *, samples_per_problem: int, key: jax.Array) -> dict:
  """pass@k of `params` on `sampler.task`'s held-out problems.

  Returns {"pass@1": ..., "pass@2": ..., ..., "num_problems", "samples_per_problem",
  "mean_answer_tokens", "correct_per_problem"} (k = powers of two up to n)."""
  problems = sampler.task.eval_problems()
  n = samples_per_problem
  scored = sampler.sample(params, problems, group_size=n, key=key)
  # multi-host: each process sampled and scored its share; every process gets the whole table
  rewards = distributed.gather_groups(scored.rewards, scored.index, len(problems))
  lengths = distributed.gather_groups(scored.rollout.lengths, scored.index, len(problems))
  correct = rewards.reshape(len(problems), n) > 0.5
  return {**pass_at_k_table(correct, default_ks(n)), "num_problems": len(problems),
          "samples_per_problem": n, "mean_answer_tokens": float(lengths.mean()),
          "correct_per_problem": correct.sum(axis=1).tolist()}  # any pass@k can be recomputed
