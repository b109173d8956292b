"""pass@k of a policy on the task's held-out problems, sampled through a `Sampler`.

Also, for every task: `entropy_per_token`, the mean of -log pi over the sampled answer tokens
(a Monte Carlo estimate of the policy's per-token entropy on its own samples; the engine's
log-probs, of the distribution it sampled from). For a task whose answers end in a final
answer (`task.final_answer(response) -> str | None`, chain_addition): maj@k and diversity
(`passk.maj_at_k_table`, `passk.diversity`), from per-sample ids gathered like the rewards.
"""

from __future__ import annotations

import jax

from oapl_jax import distributed
import numpy as np

from oapl_jax.eval.passk import default_ks, diversity, group_ids, maj_at_k_table, pass_at_k_table
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
  logprob_sums = distributed.gather_groups(scored.rollout.logprobs.sum(axis=1), scored.index,
                                           len(problems))
  correct = rewards.reshape(len(problems), n) > 0.5
  out = {**pass_at_k_table(correct, default_ks(n)), "num_problems": len(problems),
         "samples_per_problem": n, "mean_answer_tokens": float(lengths.mean()),
         "entropy_per_token": float(-logprob_sums.sum() / max(lengths.sum(), 1)),
         "correct_per_problem": correct.sum(axis=1).tolist()}  # any pass@k can be recomputed
  if scored.env_metrics is not None:  # multi-turn: how the episodes went, over all processes
    names = sorted(scored.env_metrics)
    env = dict(zip(names, distributed.totals(*(scored.env_metrics[k] for k in names))))
    out["tool_call_rate"] = env["episodes_calling"] / (len(problems) * n)
    out["env"] = env
  final_answer = getattr(sampler.task, "final_answer", None)
  if final_answer is not None:
    out.update(_votes_and_diversity(sampler, scored, final_answer, correct, n, len(problems)))
  return out


def _votes_and_diversity(sampler: Sampler, scored, final_answer, correct, n: int,
                         num_problems: int) -> dict:
  """maj@k, distinct answers / chains, and per problem the answer ids (`answer_ids`: first index
  of each sample's final answer among the problem's n, -1 if malformed), so any maj@k can be
  recomputed like pass@k from `correct_per_problem`."""
  texts = sampler.decode(scored.rollout)
  local = len(texts) // n
  answers = [final_answer(t) for t in texts]
  ans_ids = np.concatenate([group_ids(answers[j * n:(j + 1) * n]) for j in range(local)] or [[]])
  chain_ids = np.concatenate([group_ids(texts[j * n:(j + 1) * n]) for j in range(local)] or [[]])
  ans_ids = distributed.gather_groups(ans_ids, scored.index, num_problems).reshape(num_problems, n)
  chain_ids = distributed.gather_groups(chain_ids, scored.index, num_problems).reshape(num_problems, n)
  return {**maj_at_k_table(ans_ids, correct, default_ks(n)), **diversity(ans_ids, chain_ids, correct),
          "answer_ids": ans_ids.tolist()}
