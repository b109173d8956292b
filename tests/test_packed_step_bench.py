"""benchmarks/packed_step.py: its answers and layouts (hand-checked), and a `--quick` run (tiny
model and shapes, one repetition): well-formed output, every side trained the same answers (the
same real token count and, from the same weights, the same first-step loss). No timing assertion."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "packed_step.py")
_spec = importlib.util.spec_from_file_location("packed_step_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_answer_lengths_are_long_tailed_or_even():
  pareto = bench.answer_lengths("pareto", 20_000, 256, seed=0)
  assert pareto.min() >= 12 and pareto.max() == 256 and 30 < pareto.mean() < 45
  even = bench.answer_lengths("even", 20_000, 256, seed=0)
  assert even.min() == 1 and even.max() == 256 and abs(even.mean() - 128.5) < 3


def test_rows_share_a_prompt_per_group_and_count_prompt_plus_answer():
  rows = bench.rows_of(np.array([3, 1, 5, 2] * 4), prompt=4, seq=10, seed=0)
  assert rows.tokens.shape == (16, 10) and rows.mask.shape == (16, 9)
  np.testing.assert_array_equal(rows.tokens[:8, :4], np.tile(rows.tokens[0, :4], (8, 1)))
  assert (rows.tokens[8, :4] != rows.tokens[0, :4]).any()
  np.testing.assert_array_equal(rows.mask.sum(1), rows.answer_lengths)
  assert bench.real_tokens(rows) == 16 * 4 + 4 * (3 + 1 + 5 + 2)


@pytest.mark.parametrize("layout,budget", [("padded", 0), ("bucketed", 20), ("packed", 12)])
def test_torch_layouts_place_every_answer_once_within_its_chunk(layout, budget):
  lengths = np.array([7, 3, 12, 5, 1, 9, 4, 4])
  seen = []
  for rows, width, places, restart in bench.Torch.placement(layout, lengths, budget):
    fill = np.zeros((rows, width), int)
    for i, r, a in places:
      assert a + lengths[i] <= width
      fill[r, a:a + lengths[i]] += 1
      seen.append(i)
    assert fill.max() == 1  # no two answers overlap
    if layout == "bucketed":  # rows x the chunk's longest answer within the budget
      assert rows * width <= max(budget, lengths.max())
    if layout == "packed":  # rows of at most the budget
      assert width <= budget
    assert restart == (layout == "packed")
  assert sorted(seen) == list(range(len(lengths)))


def test_quick_run_trains_the_same_answers_on_every_side():
  with_torch = importlib.util.find_spec("torch") is not None
  cmd = [sys.executable, _PATH, "--quick"] + (["--torch"] if with_torch else [])
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(_PATH)))
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(result["figures"]) == {"pareto", "even"}
  for dist, sides in result["figures"].items():
    names = set(sides)
    assert any(n.startswith("padded") for n in names) and any(n.startswith("packed") for n in names)
    if with_torch:
      assert {"torch packed 64", "torch bucketed 128", "torch padded"} <= names
    real = result["lengths"][dist]["real_tokens"]
    first = next(iter(sides.values()))["warmup_loss"]
    for name, f in sides.items():
      assert f["real_tokens"] == real, name  # the same answers, prompt + answer each
      assert f["seconds"] > 0 and f["tokens_per_s"] == pytest.approx(real / f["seconds"])
      assert f["warmup_loss"] == pytest.approx(first, rel=1e-5), name  # same weights, same answers
      assert 0 <= f["pad_fraction"] < 1 and f["computed"] >= real
    packed = [f for n, f in sides.items() if n.startswith("packed")]
    padded = [f for n, f in sides.items() if n.startswith("padded")]
    assert all(p["micro_batches"] >= 1 and p["rows_filled"] >= 1 for p in packed)
    assert max(p["pad_fraction"] for p in packed) < min(p["pad_fraction"] for p in padded)
    ratios = result["ratios"][dist]
    assert ratios["packed/padded"] > 0 and ratios["best_packed"] in sides
