"""The restated findings' verdicts (oapl_jax/studies/verdicts.py) on runs made up in memory."""

import pytest

from oapl_jax.studies import results, stats, verdicts
from oapl_jax.studies.report import report_markdown
from oapl_jax.studies.verdicts import HELD, MIXED, NOT_HELD, Part

N = 8  # samples per held-out problem


def _eval(correct):
  return {"samples_per_problem": N, "correct_per_problem": list(correct),
          "pass@1": sum(correct) / (N * len(correct)), f"pass@{N}": sum(c > 0 for c in correct) / len(correct)}


def _run(method, lag, seed, after, before=(0, 1, 2, 1), kept=0.5, during=()):
  """A finished run: 4 problems x N samples with correct counts `before` / `after`, its entropy
  going from 1.0 to `kept` over 40 steps, held-out pass@1 `during` at 100, 200, ... answers."""
  summary = {"config": {"train": {"steps": 40, "lr": 1e-3}, "rl": {"groups_per_step": 2, "group_size": 4},
                        "task": {"num_eval": 4}, "eval": {"samples_per_problem": N}},
             "eval_before": _eval(before), "eval_after": _eval(after),
             "evals_during": [{"step": 10 * (i + 1), "pass@1": p, "samples_generated": 100 * (i + 1)}
                              for i, p in enumerate(during)],
             "samples_generated": 1000, "trainer_steps": 40, "train_seconds": 5.0}
  metrics = [{"step": t, "entropy": 1.0 if t <= 20 else kept} for t in range(1, 41)]
  return results.RunResult(method, lag, seed, summary, metrics, wall_seconds=60.0)


def test_a_difference_is_held_only_when_its_interval_is_above_zero():
  assert Part.from_diffs("x", [0.1, 0.2, 0.15]).verdict == HELD
  assert Part.from_diffs("x", [0.3, -0.1, 0.2]).verdict == MIXED  # mean > 0, interval reaches 0
  assert Part.from_diffs("x", [0.4]).verdict == MIXED  # one seed: no interval
  assert Part.from_diffs("x", [-0.1, -0.2, -0.1]).verdict == NOT_HELD
  assert Part.from_diffs("x", [0.1, -0.1]).verdict == NOT_HELD  # mean 0
  assert "> 0 in 2 of 3" in Part.from_diffs("x", [0.3, -0.1, 0.2]).text


def test_a_per_seed_part_is_held_in_every_seed_and_a_claim_in_every_part():
  assert [Part.from_flags("x", f, "").verdict for f in ([1, 1], [0, 0], [1, 0])] == [HELD, NOT_HELD, MIXED]
  held, no = Part("a", HELD), Part("b", NOT_HELD)
  assert verdicts.Claim("c", [held, held]).verdict == HELD
  assert verdicts.Claim("c", [no, no]).verdict == NOT_HELD
  assert verdicts.Claim("c", [held, no]).verdict == MIXED


def _study():
  """OAPL far ahead at L = 50 in every seed, OAPL falling with the lag, GRPO+IS collapsing its
  entropy at L = 1 and OAPL keeping it; GRPO+IS below its base at large k at L = 50."""
  runs = []
  for s in range(3):
    runs += [
        _run("oapl", 1, s, after=(8, 8, 7, 6 + s % 2), kept=0.9, during=(0.5, 0.8)),
        _run("oapl", 50, s, after=(6, 5, 4, 3 + s), kept=0.8, during=(0.3, 0.5)),
        _run("oapl", 100, s, after=(4, 3, 2, 1 + s), kept=0.8),
        _run("grpo_tis", 1, s, after=(8, 8, 8, 8 - s), kept=0.1, during=(0.7, 0.95)),
        _run("grpo_tis", 50, s, after=(2, 1, 0, s), kept=1.0, during=(0.1, 0.2)),
    ]
  return runs


def test_the_claims_on_a_made_up_study():
  made = verdicts.claims(_study())

  def claim(start):
    return next(c for c in made if c.name.startswith(start))
  b = claim("(b)")
  # OAPL at L = 50 is below GRPO+IS at L = 1 at every k, but trains stably at L = 100
  assert [p.verdict for p in b.parts] == [NOT_HELD] * 4 + [HELD] and b.verdict == MIXED
  drop = claim("OAPL's pass@1 falls")
  assert drop.verdict == HELD and "OAPL L=1 - OAPL L=100" in drop.parts[1].text
  same = claim("OAPL ahead")
  assert [p.verdict for p in same.parts] == [NOT_HELD, HELD] and same.verdict == MIXED
  entropy = claim("(c) GRPO's entropy")
  assert [p.verdict for p in entropy.parts] == [HELD, NOT_HELD]  # L = 1: 0.9 vs 0.1; L = 50: 0.8 vs 1.0
  assert "OAPL 0.90 - GRPO+IS 0.10" in entropy.parts[0].text
  passk = claim("(c) after training")
  by_text = {p.text.split(":")[0]: p.verdict for p in passk.parts}
  assert by_text["OAPL at L=1"] == HELD and by_text["GRPO+IS at L=50"] == MIXED  # seed 0 ends below at k = 8
  eff = claim("(d)")
  # GRPO+IS at L = 1 reaches its final at 1000 answers; OAPL at L = 50 never does
  assert eff.parts[0].verdict == NOT_HELD and "never vs 1,000" in eff.parts[0].text


def test_the_report_carries_the_verdicts():
  text = report_markdown(_study(), study="reason", command="cmd", figures={})
  section = text.split("## The findings, restated", 1)[1].split("\n## ", 1)[0]
  assert verdicts.RULE in section
  assert "**(b) OAPL at L = 50 ahead of GRPO+IS at L = 1 on pass@1..8, and stable at L = 100: mixed.**" in section
  assert "- pass@1 at L=50, OAPL - GRPO+IS: " in section and section.count(": held.") >= 3


def test_no_claim_without_both_runs_of_a_pair():
  only_oapl = [_run("oapl", 50, s, after=(1, 1, 1, 1)) for s in range(2)]
  names = [c.name for c in verdicts.claims(only_oapl)]
  assert not any(n.startswith(("(b)", "(d)", "OAPL ahead")) for n in names)
  assert verdicts.restated([]) == []


@pytest.mark.parametrize("diffs", [[0.2, 0.25, 0.3], [-0.2, -0.25, -0.3]])
def test_the_orientation_of_a_comparison(diffs):
  """A study where OAPL at L = 50 beats GRPO+IS at L = 1 by `diffs` in pass@1 gets (b)'s first
  part held, and the mirror image not held."""
  def spread(total):  # `total` correct answers over 4 problems of N samples
    return [min(N, max(0, total - N * i)) for i in range(4)]
  runs = []
  for s, d in enumerate(diffs):
    runs += [_run("oapl", 50, s, after=spread(16 + round(32 * d))), _run("grpo_tis", 1, s, after=spread(16))]
  b = verdicts.paper_setting_claim(stats.by_run(runs))
  assert b.parts[0].verdict == (HELD if diffs[0] > 0 else NOT_HELD)
