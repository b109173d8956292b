"""Unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from ``n`` samples of which ``c`` are correct.

  ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` so that no
  large binomial coefficient is formed. Returns 1.0 when ``n - c < k``.

  Raises:
    ValueError: if ``k < 1``, ``k > n``, ``c < 0`` or ``c > n``.
  """
  n, c, k = int(n), int(c), int(k)
  if k < 1 or k > n:
    raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
  if c < 0 or c > n:
    raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
  if n - c < k:
    return 1.0
  i = np.arange(n - c + 1, n + 1, dtype=np.float64)  # [c]
  return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_table(correct: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
  """Mean pass@k over problems for each k.

  Args:
    correct: ``[num_problems, n]`` bool or 0/1; ``correct[p, j]`` says sample j of problem p
    passed.
    ks: values of k, each ``1 <= k <= n``.

  Returns:
    ``{"pass@k": mean over problems}`` for each k in ``ks``.
  """
  correct = np.asarray(correct)
  if correct.ndim != 2 or correct.shape[0] == 0:
    raise ValueError(f"correct must be a non-empty [num_problems, n] array, got {correct.shape}")
  n = correct.shape[1]
  counts = (correct != 0).sum(axis=1)  # [num_problems]
  return {
    f"pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
    for k in ks
  }


def default_ks(n: int) -> list[int]:
  """Powers of two ``[1, 2, 4, ...]`` not exceeding ``n`` (``n >= 1``)."""
  if n < 1:
    raise ValueError(f"need n >= 1, got {n}")
  ks = [1]
  while ks[-1] * 2 <= n:
    ks.append(ks[-1] * 2)
  return ks


# --- maj@k and diversity (tasks whose answers end in a final answer: `task.final_answer`) -------


def group_ids(values: Sequence) -> np.ndarray:
  """`[n]` int: each value's first index among `values` (equal values share an id); None -> -1.

  Turns a problem's n answers (final answers, or whole texts) into numbers that can be gathered
  across processes and counted."""
  first: dict = {}
  return np.array([-1 if v is None else first.setdefault(v, i) for i, v in enumerate(values)],
                  np.int64)


def maj_at_k(answer_ids: np.ndarray, correct: np.ndarray, ks: Sequence[int], *,
             trials: int = 200, seed: int = 0) -> dict[int, float]:
  """maj@k of one problem: the chance that a majority vote over k of its n answers, drawn without
  replacement, picks the correct answer ({k: value}).

  answer_ids: `[n]` (`group_ids` of the final answers; -1 = no answer, which does not vote);
  correct: `[n]` bool (a correct answer's id is the gold answer's). Ties at the top are broken
  uniformly at random (gold among t tied answers counts 1/t). k = 1 and k = n are exact (c/n, and
  the one vote of all n); other k average `trials` random draws (fixed `seed`: deterministic).
  """
  ids, correct = np.asarray(answer_ids, np.int64), np.asarray(correct, bool)
  n = len(ids)
  if not correct.any():
    return {k: 0.0 for k in ks}
  gold = int(ids[correct][0])
  perms = np.random.default_rng(seed).random((trials, n)).argsort(axis=1)  # [trials, n]
  out = {}
  for k in ks:
    if not 1 <= k <= n:
      raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if k == 1:
      out[k] = float(correct.mean())
      continue
    draws = ids[None, :] if k == n else ids[perms[:, :k]]  # [t, k]
    t = len(draws)
    valid = draws >= 0
    flat = (draws + n * np.arange(t)[:, None])[valid]
    counts = np.bincount(flat, minlength=t * n).reshape(t, n)  # [t, n] votes per answer id
    top = counts.max(axis=1)
    tied = (counts == top[:, None]).sum(axis=1)
    wins = np.where((counts[:, gold] == top) & (top > 0), 1.0 / tied, 0.0)
    out[k] = float(wins.mean())
  return out


def maj_at_k_table(answer_ids: np.ndarray, correct: np.ndarray, ks: Sequence[int],
                   **kwargs) -> dict[str, float]:
  """`{"maj@k": mean over problems}` from `[num_problems, n]` answer ids and correctness."""
  per = [maj_at_k(i, c, ks, **kwargs) for i, c in zip(np.asarray(answer_ids), np.asarray(correct))]
  return {f"maj@{k}": float(np.mean([p[k] for p in per])) for k in ks}


def diversity(answer_ids: np.ndarray, chain_ids: np.ndarray, correct: np.ndarray) -> dict[str, float]:
  """Sequence-level diversity over `[num_problems, n]` samples, means over problems:
  distinct final answers (ignoring malformed ones), distinct whole answers (chains), and distinct
  chains among the correct answers (0 where none is correct)."""
  answer_ids, chain_ids = np.asarray(answer_ids), np.asarray(chain_ids)
  correct = np.asarray(correct, bool)
  return {
      "distinct_answers": float(np.mean([len(set(a[a >= 0].tolist())) for a in answer_ids])),
      "distinct_chains": float(np.mean([len(set(c.tolist())) for c in chain_ids])),
      "distinct_correct_chains": float(np.mean([len(set(c[m].tolist()))
                                                for c, m in zip(chain_ids, correct)])),
  }
