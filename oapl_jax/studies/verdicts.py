"""The paper's findings restated as claims with a verdict each (held / not held / mixed), pure
functions of a study's finished runs (`results.RunResult`, methods "oapl" and "grpo_tis").

A claim is a list of parts; each part is one comparison, paired by seed (both runs of a seed
start from the same base and see the same prompts), oriented so that a positive difference is
what the claim says:

* a difference part (`Part.from_diffs`): held when the 95% Student-t interval of the mean
  per-seed difference lies above 0; not held when the mean is <= 0; mixed when the mean is
  above 0 but the interval reaches 0 (always so with one seed: no interval).
* a per-seed part (`Part.from_flags`, for "in every seed" claims and for answers-to-reach, which
  can be "never"): held when it holds in every seed, not held in none, mixed otherwise.

A claim is held when every part is, not held when no part is held or mixed, mixed otherwise.
`restated` returns the report's lines.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oapl_jax.studies.stats import (
  by_run,
  entropy_window,
  first_reaching,
  paired_interval,
  paired_text,
)

HELD, NOT_HELD, MIXED = "held", "not held", "mixed"
OAPL, GRPO = "oapl", "grpo_tis"
PAPER_LAG = 50  # (b): OAPL at L = 50 against GRPO+IS at L <= 1
STABLE_LAG = 100  # (b): "and still trains stably at L = 100"
PAPER_KS = (1, 2, 4, 8)  # (b): the paper's math table, pass@1..8


@dataclasses.dataclass(frozen=True)
class Part:
  text: str  # what was compared and the per-seed figures
  verdict: str

  @staticmethod
  def from_diffs(what: str, diffs) -> Part:
    """A part from per-seed differences (> 0: the claim)."""
    mean, lo, _ = paired_interval(diffs)
    verdict = NOT_HELD if mean <= 0 else HELD if lo > 0 else MIXED
    return Part(f"{what}: " + paired_text(diffs, "> 0"), verdict)

  @staticmethod
  def from_flags(what: str, flags, details: str, unit: str = "seeds") -> Part:
    """A part that holds or not in each seed (`flags`; or in each of another `unit`)."""
    n = sum(bool(f) for f in flags)
    verdict = HELD if n == len(flags) else NOT_HELD if n == 0 else MIXED
    return Part(f"{what}: in {n} of {len(flags)} {unit} ({details})", verdict)


@dataclasses.dataclass(frozen=True)
class Claim:
  name: str
  parts: list[Part]

  @property
  def verdict(self) -> str:
    verdicts = {p.verdict for p in self.parts}
    return HELD if verdicts == {HELD} else NOT_HELD if verdicts == {NOT_HELD} else MIXED


def _pairs(by, a: tuple[str, int], b: tuple[str, int]):
  """[(seed, run a, run b)] for the seeds that have both runs."""
  seeds = sorted(s for (m, lag, s) in by if (m, lag) == a and (*b, s) in by)
  return [(s, by[(*a, s)], by[(*b, s)]) for s in seeds]


def _runs(by, method: str, lag: int) -> list:
  """The runs of (method, lag), by seed."""
  return [by[k] for k in sorted(by) if k[:2] == (method, lag)]


def _final(r, key: str = "pass@1") -> float:
  return r.summary["eval_after"][key]


def _passk_after(r, k: int) -> float:
  return float(r.passk("after", [k])[0])


def _lags(by, method) -> list[int]:
  return sorted({lag for (m, lag, _) in by if m == method})


def paper_setting_claim(by) -> Claim | None:
  """(b): OAPL at L = 50 ahead of GRPO+IS at L = 1 on pass@1..8, and OAPL stable at L = 100
  (its pass@1 after above its base's)."""
  pairs = _pairs(by, (OAPL, PAPER_LAG), (GRPO, 1))
  if not pairs:
    return None
  n = min(r.summary["eval_after"]["samples_per_problem"] for _, a, g in pairs for r in (a, g))
  parts = [Part.from_diffs(f"pass@{k}, OAPL L={PAPER_LAG} - GRPO+IS L=1",
                           [_passk_after(a, k) - _passk_after(g, k) for _, a, g in pairs])
           for k in PAPER_KS if k <= n]
  if stable := _runs(by, OAPL, STABLE_LAG):
    parts.append(Part.from_diffs(f"OAPL at L={STABLE_LAG} trains stably: pass@1 after - before",
                                 [_final(r) - r.summary["eval_before"]["pass@1"] for r in stable]))
  return Claim(f"(b) OAPL at L = {PAPER_LAG} ahead of GRPO+IS at L = 1 on pass@1..{min(n, PAPER_KS[-1])}, "
               f"and stable at L = {STABLE_LAG}", parts)


def lag_drop_claim(by) -> Claim | None:
  """The first study's finding: OAPL's final pass@1 falls with the lag (L = 1 minus each longer L)."""
  parts = [Part.from_diffs(f"pass@1, OAPL L=1 - OAPL L={lag}", [_final(a) - _final(b) for _, a, b in pairs])
           for lag in _lags(by, OAPL) if lag > 1 and (pairs := _pairs(by, (OAPL, 1), (OAPL, lag)))]
  return Claim("OAPL's pass@1 falls with the lag (held: the drop survives)", parts) if parts else None


def same_lag_claim(by) -> Claim | None:
  """The comparison the paper did not run: OAPL ahead of GRPO+IS at the same lag, pass@1."""
  parts = [Part.from_diffs(f"pass@1 at L={lag}, OAPL - GRPO+IS", [_final(a) - _final(g) for _, a, g in pairs])
           for lag in _lags(by, OAPL) if (pairs := _pairs(by, (OAPL, lag), (GRPO, lag)))]
  return Claim("OAPL ahead of GRPO+IS at the same lag (not in the paper)", parts) if parts else None


def _kept(r) -> float:
  """The fraction of its policy entropy a run kept: last 20 logged steps over the first 20."""
  first = entropy_window(r, True)
  return entropy_window(r, False) / first if first else float("nan")


def entropy_claim(by) -> Claim | None:
  """(c), first half, as a comparison: OAPL keeps more of its entropy than GRPO+IS at each lag
  (the kept fractions are in the text, so a reader sees whether either collapses)."""
  parts = []
  for lag in _lags(by, OAPL):
    if pairs := _pairs(by, (OAPL, lag), (GRPO, lag)):
      ka, kg = [_kept(a) for _, a, _ in pairs], [_kept(g) for _, _, g in pairs]
      parts.append(Part.from_diffs(
          f"entropy kept (last 20 / first 20 steps) at L={lag}, OAPL {np.mean(ka):.2f} - "
          f"GRPO+IS {np.mean(kg):.2f}", [a - g for a, g in zip(ka, kg)]))
  name = "(c) GRPO's entropy collapses and OAPL's does not, read as: OAPL keeps more of its entropy than GRPO+IS"
  return Claim(name, parts) if parts else None


def _passk_gaps(r) -> np.ndarray:
  n = r.summary["eval_after"]["samples_per_problem"]
  ks = np.arange(1, n + 1)
  return r.passk("after", ks) - r.passk("before", ks)


def passk_claim(by) -> Claim | None:
  """(c), second half: after training, pass@k is at or above the base's for every k (each run,
  per seed), and OAPL's pass@k is above GRPO+IS's at the same lag (mean over k, per seed)."""
  parts = []
  for method, name in ((OAPL, "OAPL"), (GRPO, "GRPO+IS")):
    for lag in _lags(by, method):
      worst = [float(_passk_gaps(r).min()) for r in _runs(by, method, lag)]
      parts.append(Part.from_flags(f"{name} at L={lag}: pass@k after >= before for every k",
                                   [w >= -1e-12 for w in worst],
                                   "worst after - before per seed: " + ", ".join(f"{w:+.3f}" for w in worst)))
  for lag in _lags(by, OAPL):
    if pairs := _pairs(by, (OAPL, lag), (GRPO, lag)):
      n = min(r.summary["eval_after"]["samples_per_problem"] for _, a, g in pairs for r in (a, g))
      ks = np.arange(1, n + 1)
      diffs = [float(np.mean(a.passk("after", ks) - g.passk("after", ks))) for _, a, g in pairs]
      parts.append(Part.from_diffs(f"more so: pass@k after at L={lag}, OAPL - GRPO+IS, mean over k = 1..{n}", diffs))
  return Claim("(c) after training both raise pass@k to at least the base's for every k, OAPL more so",
               parts) if parts else None


def _fmt_answers(x: float | None) -> str:
  return "never" if x is None else f"{x:,.0f}"


def efficiency_claim(by) -> Claim | None:
  """(d): OAPL reaches GRPO+IS's final pass@1 with fewer generated answers than GRPO+IS first
  reached it, per seed (read at the evaluations): at the paper's setting (OAPL L = 50, GRPO+IS
  L = 1) and at each same lag."""
  comparisons = [(PAPER_LAG, 1)] + [(lag, lag) for lag in _lags(by, OAPL)]
  parts = []
  for lag_a, lag_g in comparisons:
    if not (pairs := _pairs(by, (OAPL, lag_a), (GRPO, lag_g))):
      continue
    reach = [(first_reaching(a, _final(g)), first_reaching(g, _final(g))) for _, a, g in pairs]
    parts.append(Part.from_flags(
        f"OAPL L={lag_a} reaches GRPO+IS L={lag_g}'s final pass@1 with fewer answers than GRPO+IS",
        [o is not None and o < g for o, g in reach],
        "answers, OAPL vs GRPO+IS, per seed: " + ", ".join(f"{_fmt_answers(o)} vs {_fmt_answers(g)}"
                                                          for o, g in reach)))
  return Claim("(d) OAPL needs fewer generated answers to reach GRPO+IS's result", parts) if parts else None


def claims(results) -> list[Claim]:
  """Every claim the runs have data for, in the report's order."""
  by = by_run(results)
  made = (paper_setting_claim(by), lag_drop_claim(by), same_lag_claim(by), entropy_claim(by),
          passk_claim(by), efficiency_claim(by))
  return [c for c in made if c is not None]


RULE = ("Each part is paired by seed and oriented so that > 0 is the claim. A difference is held "
        "when its 95% t-interval over seeds lies above 0, not held when its mean is <= 0, mixed "
        "otherwise (a mean above 0 whose interval reaches 0, or one seed). A per-seed part is held "
        "in every seed, not held in none, mixed otherwise. A claim is held when every part is, not "
        "held when every part is not held, mixed otherwise.")


def restated(results) -> list[str]:
  """The report's section: each claim with its verdict and its parts ([] without any)."""
  made = claims(results)
  if not made:
    return []
  lines = ["## The findings, restated (verdicts computed from the runs)", "", RULE, ""]
  for c in made:
    lines.append(f"**{c.name}: {c.verdict}.**")
    lines += [f"- {p.text}: {p.verdict}." for p in c.parts]
    lines.append("")
  return lines
