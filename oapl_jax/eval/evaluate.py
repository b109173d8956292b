"""pass@k of a policy on the task's held-out problems, sampled through the engine."""

from __future__ import annotations

import jax
import numpy as np

from oapl_jax.eval.passk import default_ks, pass_at_k_table


def decode_answers(tokenizer, ro) -> list[str]:
  """The text of every answer of a rollout, row order."""
  return [tokenizer.decode(ro.answers[i, :ro.lengths[i]]) for i in range(ro.num_samples)]


def score_rollout(task, tokenizer, problems, ro) -> np.ndarray:
  """Rewards `[P*G]` of a rollout whose prompt p is `problems[p]`.

  Tasks with a `score_batch(responses, problems)` method (code: parallel sandboxes) get the
  whole rollout at once; others are scored answer by answer with `score(response, problem)`.
  """
  g = ro.group_size
  responses = decode_answers(tokenizer, ro)
  owners = [problems[i // g] for i in range(ro.num_samples)]
  if hasattr(task, "score_batch"):
    return np.asarray(task.score_batch(responses, owners), np.float32)
  return np.array([task.score(r, p) for r, p in zip(responses, owners)], np.float32)


def evaluate(engines, params, task, tokenizer, *, samples_per_problem: int, max_new_tokens: int,
             key: jax.Array) -> dict:
  """pass@k of `params` sampled through `engines` (a `sampling.parallel.Replicas`).

  Returns {"pass@1": ..., "pass@2": ..., ..., "num_problems", "samples_per_problem",
  "mean_answer_tokens", "correct_per_problem"} (k = powers of two up to n)."""
  problems = task.eval_problems()
  prompts = [tokenizer.encode(p.prompt, add_bos=True) for p in problems]
  n = samples_per_problem
  ro = engines.rollout(params, prompts, group_size=n, max_new_tokens=max_new_tokens,
                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, key=key)
  correct = score_rollout(task, tokenizer, problems, ro).reshape(len(problems), n) > 0.5
  return {**pass_at_k_table(correct, default_ks(n)), "num_problems": len(problems),
          "samples_per_problem": n, "mean_answer_tokens": float(ro.lengths.mean()),
          "correct_per_problem": correct.sum(axis=1).tolist()}  # any pass@k can be recomputed
