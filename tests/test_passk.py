"""Tests for oapl_jax.eval.passk."""

import math
import random

import numpy as np
import pytest

from oapl_jax.eval.passk import default_ks, pass_at_k, pass_at_k_table


def _comb_formula(n, c, k):
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_hand_cases():
  assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
  assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
  assert pass_at_k(10, 0, 3) == 0.0
  assert pass_at_k(10, 10, 3) == 1.0
  assert pass_at_k(10, 8, 3) == 1.0  # n - c < k


def test_matches_comb_formula():
  rng = random.Random(0)
  for _ in range(200):
    n = rng.randint(1, 300)
    c = rng.randint(0, n)
    k = rng.randint(1, n)
    assert pass_at_k(n, c, k) == pytest.approx(_comb_formula(n, c, k), rel=1e-9, abs=1e-12)


def test_large_n_is_finite():
  value = pass_at_k(2048, 3, 256)
  assert 0.0 < value < 1.0
  assert value == pytest.approx(_comb_formula(2048, 3, 256), rel=1e-9)


def test_monotone_in_k():
  n, c = 64, 5
  values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
  assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))
  assert values[0] == pytest.approx(c / n)
  assert values[-1] == 1.0


def test_table_averages_over_problems():
  correct = np.array(
    [
      [1, 0, 0, 0],  # c=1: pass@1 = .25, pass@2 = .5, pass@4 = 1
      [0, 0, 0, 0],  # c=0: 0, 0, 0
      [True, True, False, True],  # c=3: .75, 1, 1
    ]
  )
  table = pass_at_k_table(correct, [1, 2, 4])
  assert set(table) == {"pass@1", "pass@2", "pass@4"}
  assert table["pass@1"] == pytest.approx((0.25 + 0 + 0.75) / 3)
  assert table["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
  assert table["pass@4"] == pytest.approx((1 + 0 + 1) / 3)


def test_default_ks():
  assert default_ks(1) == [1]
  assert default_ks(8) == [1, 2, 4, 8]
  assert default_ks(10) == [1, 2, 4, 8]
  assert default_ks(256)[-1] == 256


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 1, 0), (4, 5, 2), (4, -1, 2)])
def test_errors(n, c, k):
  with pytest.raises(ValueError):
    pass_at_k(n, c, k)


def test_table_errors():
  with pytest.raises(ValueError):
    pass_at_k_table(np.ones((2, 4)), [8])
  with pytest.raises(ValueError):
    pass_at_k_table(np.ones(4), [1])
  with pytest.raises(ValueError):
    default_ks(0)
