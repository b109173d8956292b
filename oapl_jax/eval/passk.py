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
