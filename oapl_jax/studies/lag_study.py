"""The lag study: OAPL and GRPO+IS at several engine lags L, several seeds, on an embedded task.

The paper ran GRPO+IS only at lag 1 and OAPL at lag 50-100. This study runs both (and OAPL
with the paper's betas) at each L, from one shared base model per seed, with the same number
of generated answers per run, and writes a report with plots. `--study` picks the task
(`STUDIES`): "tiny" (configs/tiny.py, two-digit addition: docs/lag_study.md) or "reason"
(configs/reason.py, addition answered by a 52-53-token chain of steps, pass@k to k = 256).

    python -m oapl_jax.studies.lag_study --out=/tmp/lag_study                 # the full study
    python -m oapl_jax.studies.lag_study --out=/tmp/ls --reduced --lags 1 2 --seeds 0   # seconds
    python -m oapl_jax.studies.lag_study --study=reason --out=/tmp/rs --sweep-lrs 1e-4 3e-4 1e-3 \
        --lags 1 10 50 100 --seeds 0 1 2 3 4 --budget-minutes=45             # one piece

Learning-rate sweep (`--sweep-lrs`): before the study's runs, each method is run at every lr
at lag `--sweep-lag` on seed `--sweep-seed` (not one of the study's seeds), under
`<out>/sweep/`; the lr with the best final pass@1 is each method's lr for the study
(`<out>/sweep/chosen.json`, reported). Runs already finished under `--out` (a `summary.json`)
are skipped and an unfinished one resumes from its checkpoints, so a study runs in pieces:
`--budget-minutes` starts no run after that many minutes (then exit code 3 says more is left:
run the same command again; SIGTERM / SIGINT stop the run in progress with a checkpoint and
exit 128 + the signal number, one line on stderr). From Python: `run_study(...)`, then `write_report(...)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time

import numpy as np

from oapl_jax import config as config_lib
from oapl_jax.errors import UserError, one_line
from oapl_jax.eval.passk import pass_at_k
from oapl_jax.metrics import read_metrics

# method name -> (label, config overrides). Everything else is configs/tiny.py.
METHODS: dict[str, tuple[str, dict]] = {
    "oapl": ("OAPL (beta1=1, beta2=0.1)", {"rl.loss": "oapl"}),
    "oapl_paper_betas": ("OAPL, paper betas (beta1=1, beta2=1e-3)",
                         {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2": 1e-3}),
    "grpo_tis": ("GRPO+IS (token TIS, C=2)",
                 {"rl.loss": "grpo", "rl.grpo.is_level": "token", "rl.grpo.is_mode": "truncate",
                  "rl.grpo.is_cap": 2.0}),
}
DEFAULT_LAGS = (1, 10, 50, 100)
DEFAULT_SEEDS = (0, 1, 2)
# The study's settings on top of configs/tiny.py: every run generates the same answers per step
# (one fresh rollout of 16 groups per step, none dropped), and evaluation has 64 samples per
# problem for pass@1..64 (every 50 steps too, for the pass@1 curve).
FULL = {"rl.groups_per_step": 16, "rl.groups_per_rollout": 16, "eval.samples_per_problem": 64,
        "eval.every": 50, "checkpoint.every": 1000, "log.progress": False}
# CI-sized: a few steps of everything, same code path.
REDUCED = {"warmup.steps": 30, "warmup.noisy_steps": 10, "task.num_eval": 8, "train.steps": 4,
           "rl.groups_per_step": 2, "rl.groups_per_rollout": 2, "eval.samples_per_problem": 8,
           "eval.every": 2, "sampling.max_slots": 32, "checkpoint.every": 1000, "log.progress": False}
# The reasoning study (configs/reason.py): 256 samples per held-out problem (pass@k, maj@k to
# k = 256) on 64 problems; one eval.samples_per_problem serves every evaluation, so those during
# training (the pass@1 curve, sample efficiency) are every 100 steps.
REASON_FULL = {"rl.groups_per_step": 16, "rl.groups_per_rollout": 16, "task.num_eval": 64,
               "eval.samples_per_problem": 256, "eval.every": 100, "checkpoint.every": 25,
               "log.progress": False}
# CI-sized: configs/reason.py:smoke (2-3-digit chains, 4 steps) with an evaluation mid-run.
REASON_REDUCED = {"eval.every": 2, "checkpoint.every": 1000, "log.progress": False}


@dataclasses.dataclass(frozen=True)
class Study:
  """A study's task: its config file (and its CI-sized variant), the settings of a full and of
  a CI-sized run on top, a description."""
  config: str
  full: dict
  reduced: dict
  title: str
  about: str
  launcher: str  # the script in launch/ that runs the full study and writes its report
  reduced_config: str | None = None  # None: `config`


STUDIES = {
    "tiny": Study("tiny.py", FULL, REDUCED, "Lag study: OAPL vs GRPO+IS at engine lags L on the tiny task",
                  "`configs/tiny.py` (two-digit addition, a 2-layer width-128 model whose base is "
                  "made by a supervised warm-up shared by all runs of a seed)", "launch/lag_study.sh"),
    "reason": Study("reason.py", REASON_FULL, REASON_REDUCED,
                    "Reasoning study: OAPL vs GRPO+IS at engine lags L on chain-of-steps addition",
                    "`configs/reason.py` (5-digit addition answered by a chain of column steps, "
                    "52-53 tokens; a 2-layer width-128 model whose base, shared by all runs of a "
                    "seed, is made by a supervised warm-up ending on demonstrations with dropped "
                    "carries)", "launch/reasoning_study.sh", reduced_config="reason.py:smoke"),
}


def _set(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def study_config(method: str, lag: int, seed: int, *, reduced: bool = False,
                 cache_dir: str | None = None, overrides: dict | None = None, study: str = "tiny"):
  """The study's config file with its settings, the method's, `rl.lag=lag` and `seed`."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; known: {sorted(METHODS)}")
  if study not in STUDIES:
    raise ValueError(f"unknown study {study!r}; known: {sorted(STUDIES)}")
  spec = STUDIES[study]
  c = config_lib.repo_config(spec.reduced_config or spec.config if reduced else spec.config)
  for k, v in {**(spec.reduced if reduced else spec.full), **METHODS[method][1],
               **(overrides or {})}.items():
    _set(c, k, v)
  c.rl.lag, c.seed = lag, seed
  c.warmup.cache_dir = cache_dir
  return c


def run_dir(out: str, method: str, lag: int, seed: int, lr: float | None = None) -> str:
  """`<out>/runs/<method>_lag<L>_seed<S>`; a sweep run: `<out>/sweep/<...>_lr<lr>`."""
  if lr is None:
    return os.path.join(out, "runs", f"{method}_lag{lag}_seed{seed}")
  return os.path.join(out, "sweep", f"{method}_lag{lag}_seed{seed}_lr{lr:g}")


class BudgetSpent(Exception):
  """`--budget-minutes` ran out with runs left (the study resumes where it stopped)."""


def _run_all(out: str, todo: list, *, reduced: bool, overrides: dict | None, study: str,
             deadline: float | None, echo, in_sweep: bool = False) -> list[str]:
  """Runs each (seed, lag, method, lr) of `todo` not finished yet; a run left unfinished by an
  earlier piece resumes from its checkpoints. Raises `BudgetSpent` past `deadline`."""
  from oapl_jax import train  # heavy import, only when running
  dirs = []
  for i, (seed, lag, method, lr) in enumerate(todo, 1):
    d = run_dir(out, method, lag, seed, lr if in_sweep else None)
    dirs.append(d)
    if os.path.isfile(os.path.join(d, "summary.json")):
      echo(f"[{i}/{len(todo)}] {os.path.basename(d)}: done already")
      continue
    if deadline is not None and time.perf_counter() > deadline:
      raise BudgetSpent(f"budget spent: {len(todo) - i + 1} of {len(todo)} runs left "
                        f"(next: {os.path.basename(d)}); run the same command again to go on")
    t0 = time.perf_counter()
    config = study_config(method, lag, seed, reduced=reduced, study=study,
                          overrides={**(overrides or {}), **({"train.lr": lr} if lr else {})},
                          cache_dir=os.path.join(out, "base_models"))
    s = train.run(config, d)
    wall_path = os.path.join(d, "study_wall_seconds.json")
    with open(wall_path + ".part", "a") as f:  # pieces of a resumed run add up
      f.write(f"{time.perf_counter() - t0}\n")
    with open(wall_path, "w") as f:
      json.dump(sum(float(x) for x in open(wall_path + ".part")), f)
    echo(f"[{i}/{len(todo)}] {os.path.basename(d)}: pass@1 {s['eval_before']['pass@1']:.3f} -> "
         f"{s['eval_after']['pass@1']:.3f} ({time.perf_counter() - t0:.0f}s)")
  return dirs


def sweep(out: str, *, methods, lrs, lag: int, seed: int, reduced: bool = False,
          overrides: dict | None = None, study: str = "tiny", deadline: float | None = None,
          echo=print) -> dict[str, float]:
  """Each method at each lr (lag `lag`, seed `seed`); returns and writes `<out>/sweep/chosen.json`:
  per method the lr of the best final pass@1 (ties: the smaller lr)."""
  todo = [(seed, lag, m, float(lr)) for m in methods for lr in lrs]
  _run_all(out, todo, reduced=reduced, overrides=overrides, study=study, deadline=deadline,
           echo=echo, in_sweep=True)
  chosen, table = {}, {}
  for method in methods:
    scores = []
    for lr in sorted(float(x) for x in lrs):
      with open(os.path.join(run_dir(out, method, lag, seed, lr), "summary.json")) as f:
        scores.append((json.load(f)["eval_after"]["pass@1"], -lr, lr))
    table[method] = {f"{lr:g}": p for p, _, lr in scores}
    chosen[method] = max(scores)[2]
  with open(os.path.join(out, "sweep", "chosen.json"), "w") as f:
    json.dump({"lag": lag, "seed": seed, "pass1_after": table, "lr": chosen}, f, indent=1)
  echo("sweep: " + ", ".join(f"{m} lr={lr:g}" for m, lr in chosen.items()))
  return chosen


def run_study(out: str, *, methods=tuple(METHODS), lags=DEFAULT_LAGS, seeds=DEFAULT_SEEDS,
              reduced: bool = False, overrides: dict | None = None, echo=print,
              study: str = "tiny", lrs: dict[str, float] | None = None,
              deadline: float | None = None) -> list[str]:
  """Runs every (seed, lag, method) not finished yet; returns the run folders.

  Seeds outermost, so a study stopped early has every method and lag for its first seeds.
  All runs of a seed share one warmed-up base model (`<out>/base_models`). lrs: a method's
  train.lr (from `sweep`); others keep the config's.
  """
  todo = [(s, l, m, (lrs or {}).get(m)) for s in seeds for l in lags for m in methods]
  return _run_all(out, todo, reduced=reduced, overrides=overrides, study=study,
                  deadline=deadline, echo=echo)


# --- results -----------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
  method: str
  lag: int
  seed: int
  summary: dict
  metrics: list[dict]
  wall_seconds: float | None = None  # the run's wall time in the study (warm-up, evals, compiles)

  def passk(self, when: str, ks) -> np.ndarray:
    """pass@k for each k from the per-problem correct counts of eval `when` (before / after)."""
    e = self.summary[f"eval_{when}"]
    n = e["samples_per_problem"]
    counts, problems = np.unique(e["correct_per_problem"], return_counts=True)  # each c once
    return np.array([np.dot(problems, [pass_at_k(n, c, k) for c in counts]) / problems.sum() for k in ks])

  def eval_curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(generated answers, the held-out figure `key`): before, every eval during training, after."""
    samples_at = {m["step"]: m["samples_generated"] for m in self.metrics}
    xs, ys = [0], [self.summary["eval_before"][key]]
    for e in self.summary["evals_during"]:
      xs.append(samples_at[e["step"]])
      ys.append(e[key])
    xs.append(self.summary["samples_generated"])
    ys.append(self.summary["eval_after"][key])
    return np.array(xs, float), np.array(ys, float)

  def pass1_curve(self) -> tuple[np.ndarray, np.ndarray]:
    return self.eval_curve("pass@1")

  def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [m for m in self.metrics if key in m]
    return np.array([m["step"] for m in rows]), np.array([m[key] for m in rows], float)


_RUN_NAME = re.compile(r"^(?P<method>.+)_lag(?P<lag>\d+)_seed(?P<seed>\d+)$")


def load_runs(out: str) -> list[RunResult]:
  """Every finished run under `<out>/runs`."""
  results = []
  root = os.path.join(out, "runs")
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    match = _RUN_NAME.match(name)
    path = os.path.join(root, name, "summary.json")
    if not match or not os.path.isfile(path):
      continue
    with open(path) as f:
      summary = json.load(f)
    metrics = read_metrics(os.path.join(root, name))
    wall_path = os.path.join(root, name, "study_wall_seconds.json")
    wall = json.load(open(wall_path)) if os.path.isfile(wall_path) else None
    results.append(RunResult(match["method"], int(match["lag"]), int(match["seed"]), summary,
                             metrics, wall))
  return results


def _group(results):
  groups: dict[tuple[str, int], list[RunResult]] = {}
  for r in results:
    groups.setdefault((r.method, r.lag), []).append(r)
  return groups


def _mean_sd(values) -> tuple[float, float]:
  v = np.asarray(values, float)
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def paired_interval(diffs, level: float = 0.95) -> tuple[float, float, float]:
  """Mean of per-seed paired differences and its Student-t interval at `level` (two-sided).

  With one seed there is no spread to estimate: the interval is (nan, nan).
  """
  d = np.asarray(diffs, float)
  mean = float(d.mean())
  if len(d) < 2:
    return mean, float("nan"), float("nan")
  from scipy import stats  # a dependency of jax
  half = float(stats.t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
  return mean, mean - half, mean + half


def _paired_text(diffs) -> str:
  mean, lo, hi = paired_interval(diffs)
  interval = "no interval from one seed" if np.isnan(lo) else f"95% t-interval [{lo:+.3f}, {hi:+.3f}]"
  return (", ".join(f"{d:+.3f}" for d in diffs) + f"; mean {mean:+.3f}, {interval}"
          f" (OAPL higher in {sum(d > 0 for d in diffs)} of {len(diffs)})")


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
  if len(y) < window or window <= 1:
    return y
  return np.convolve(y, np.ones(window) / window, mode="valid")


def _entropy_window(r: RunResult, first: bool, n: int = 20) -> float:
  _, ent = r.series("entropy")
  return float(ent[:n].mean() if first else ent[-n:].mean())


# --- the report ---------------------------------------------------------------------------------


def _eval_curves(runs, key: str = "pass@1"):
  """(generated answers `[n]`, held-out `key` `[seeds, n]`) over the runs' evaluations."""
  curves = [r.eval_curve(key) for r in runs]
  n = min(len(c[0]) for c in curves)
  return np.mean([c[0][:n] for c in curves], axis=0), np.array([c[1][:n] for c in curves])


def _entropy_curves(runs):
  """(trainer step `[n]`, smoothed entropy `[seeds, n]`)."""
  series = [r.series("entropy") for r in runs]
  n = min(len(s[1]) for s in series)
  window = max(1, min(10, n // 5))
  y = np.array([_smooth(s[1][:n], window) for s in series])
  return series[0][0][:n][n - y.shape[1]:], y  # steps at the end of each averaging window


def _passk_panel(ax, runs_by_method: dict, n_max: int) -> None:
  """pass@k for k = 1..n_max before (the shared base) and after each method's training."""
  import matplotlib.ticker
  ks = np.arange(1, n_max + 1)
  method_colors = dict(zip(METHODS, ["tab:blue", "tab:green", "tab:red"]))
  befores = {r.seed: r.passk("before", ks) for runs in runs_by_method.values() for r in runs}
  if befores:
    b = np.array(list(befores.values()))
    ax.plot(ks, b.mean(0), "k--", label="before (base)")
    ax.fill_between(ks, b.min(0), b.max(0), color="k", alpha=0.1)
  for method, runs in runs_by_method.items():
    if runs:
      a = np.array([r.passk("after", ks) for r in runs])
      ax.plot(ks, a.mean(0), color=method_colors[method], label=METHODS[method][0])
      ax.fill_between(ks, a.min(0), a.max(0), color=method_colors[method], alpha=0.15)
  ax.set(xlabel="k", xscale="log")
  ticks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n_max]
  ax.set_xticks(ticks, [str(k) for k in ticks])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.grid(alpha=0.3)


def plot(results, fig_dir: str) -> dict[str, str]:
  """Writes the figures as PNG (three; five with held-out diversity and entropy); returns {name: path}."""
  import matplotlib  # figures built without pyplot: the caller's backend (a notebook's) is untouched
  from matplotlib.figure import Figure

  def subplots(ncols, width):
    fig = Figure(figsize=(width * ncols, 3.8))
    return fig, fig.subplots(1, ncols, sharey=True, squeeze=False)

  os.makedirs(fig_dir, exist_ok=True)
  groups = _group(results)
  methods = [m for m in METHODS if any(k[0] == m for k in groups)]
  lags = sorted({k[1] for k in groups})
  colors = dict(zip(lags, matplotlib.colormaps["viridis"](np.linspace(0.0, 0.85, len(lags)))))
  paths = {}

  def save(fig, name: str, title: str) -> str:
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(fig_dir, name)
    fig.savefig(path, dpi=110)
    return path

  def per_method(curves, xlabel: str, ylabel: str, marker: str = "-"):
    """One panel per method, a line per lag: `curves(runs)` -> (x `[n]`, y `[seeds, n]`)."""
    fig, axes = subplots(len(methods), 5)
    for ax, method in zip(axes[0], methods):
      for lag in lags:
        runs = groups.get((method, lag), [])
        if runs:
          x, y = curves(runs)
          ax.plot(x, y.mean(0), marker, ms=3, color=colors[lag], label=f"L={lag} ({len(runs)} seeds)")
          ax.fill_between(x, y.min(0), y.max(0), color=colors[lag], alpha=0.15)
      ax.set(title=METHODS[method][0], xlabel=xlabel)
      ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    return fig

  paths["pass1"] = save(per_method(_eval_curves, "generated answers", "held-out pass@1", "o-"),
                        "pass1_vs_samples.png",
                        "pass@1 vs generated answers (mean over seeds; band: min-max)")
  evals = [e for r in results for e in [r.summary["eval_before"], r.summary["eval_after"], *r.summary["evals_during"]]]
  if all("distinct_answers" in e for e in evals):  # tasks with final answers (chain_addition)
    paths["diversity"] = save(
        per_method(lambda runs: _eval_curves(runs, "distinct_answers"), "generated answers",
                   "distinct final answers per problem", "o-"),
        "diversity_vs_samples.png",
        "held-out diversity: distinct final answers among a problem's samples (mean over seeds; band: min-max)")
    paths["eval_entropy"] = save(
        per_method(lambda runs: _eval_curves(runs, "entropy_per_token"), "generated answers",
                   "mean -log pi per sampled token (nats)", "o-"),
        "eval_entropy_vs_samples.png",
        "held-out entropy: pi_theta on its own samples of held-out problems (mean over seeds; band: min-max)")
  paths["entropy"] = save(per_method(_entropy_curves, "trainer step",
                                     "entropy of pi_theta on sampled answers (nats/token)"),
                          "entropy_vs_step.png",
                          "policy entropy vs trainer step (moving average; band: min-max over seeds)")

  n_max = min(r.summary["eval_after"]["samples_per_problem"] for r in results)
  fig, axes = subplots(len(lags), 4.2)
  for ax, lag in zip(axes[0], lags):
    _passk_panel(ax, {m: groups.get((m, lag), []) for m in methods}, n_max)
    ax.set(title=f"L={lag}")
  axes[0][0].set_ylabel("held-out pass@k")
  axes[0][0].legend(fontsize=7, loc="lower right")
  paths["passk"] = save(fig, "passk_before_after.png",
                        f"pass@k (k = 1..{n_max}) before and after training (mean over seeds; band: min-max)")
  return paths


def summarise(results) -> list[dict]:
  """One row per (method, lag): means and seed spread of the final figures."""
  rows = []
  for (method, lag), runs in sorted(_group(results).items(), key=lambda kv: (list(METHODS).index(kv[0][0]), kv[0][1])):
    n = min(r.summary["eval_after"]["samples_per_problem"] for r in runs)
    row = {"method": method, "lag": lag, "seeds": sorted(r.seed for r in runs),
           "pass1_after_by_seed": {r.seed: r.summary["eval_after"]["pass@1"] for r in runs},
           "passn_after_by_seed": {r.seed: r.summary["eval_after"][f"pass@{n}"] for r in runs}}
    for name, values in {
        "pass1_before": [r.summary["eval_before"]["pass@1"] for r in runs],
        "pass1_after": [r.summary["eval_after"]["pass@1"] for r in runs],
        f"pass{n}_before": [r.summary["eval_before"][f"pass@{n}"] for r in runs],
        f"pass{n}_after": [r.summary["eval_after"][f"pass@{n}"] for r in runs],
        "entropy_start": [_entropy_window(r, True) for r in runs],
        "entropy_end": [_entropy_window(r, False) for r in runs],
        "samples": [r.summary["samples_generated"] for r in runs],
        "train_seconds": [r.summary["train_seconds"] for r in runs],
    }.items():
      row[name] = _mean_sd(values)
    for key in (f"maj@{n}", "distinct_answers", "distinct_correct_chains", "entropy_per_token"):
      if all(key in r.summary["eval_before"] and key in r.summary["eval_after"] for r in runs):
        for when in ("before", "after"):
          row[f"{key}_{when}"] = _mean_sd([r.summary[f"eval_{when}"][key] for r in runs])
    row["lr"] = sorted({r.summary["config"]["train"]["lr"] for r in runs})
    ks = np.arange(1, n + 1)
    gaps = np.mean([r.passk("after", ks) - r.passk("before", ks) for r in runs], axis=0)
    row["passk_not_up"] = [int(k) for k, g in zip(ks, gaps) if g < 0]
    row["passk_n"] = n
    rows.append(row)
  return rows


def _fmt(ms, digits=3) -> str:
  m, s = ms
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def findings(rows) -> list[str]:
  """Plain sentences on the paper's three findings, computed from the rows."""
  by = {(r["method"], r["lag"]): r for r in rows}
  lags = sorted({r["lag"] for r in rows})
  out = []
  for oapl_name in ("oapl", "oapl_paper_betas"):
    for lag in lags:
      a, g = by.get((oapl_name, lag)), by.get(("grpo_tis", lag))
      if not (a and g):
        continue
      (ma, _), (mg, _) = a["pass1_after"], g["pass1_after"]
      diff = ma - mg
      verdict = ("OAPL higher" if diff > 0 else "GRPO+IS higher" if diff < 0 else "equal")
      # paired by seed: both runs of a seed start from the same base and see the same prompts
      seeds = sorted(set(a["pass1_after_by_seed"]) & set(g["pass1_after_by_seed"]))
      paired = [a["pass1_after_by_seed"][s] - g["pass1_after_by_seed"][s] for s in seeds]
      out.append(f"* pass@1 after, L={lag}: {METHODS[oapl_name][0]} {ma:.3f} vs GRPO+IS {mg:.3f} -> "
                 f"{verdict} by {abs(diff):.3f}; per seed (OAPL - GRPO+IS, same base): "
                 + _paired_text(paired) + ".")
      n = a["passk_n"]
      if n > 1 and g["passk_n"] == n:
        paired = [a["passn_after_by_seed"][s] - g["passn_after_by_seed"][s] for s in seeds]
        out.append(f"* pass@{n} after, L={lag}: {METHODS[oapl_name][0]} {a[f'pass{n}_after'][0]:.3f} vs "
                   f"GRPO+IS {g[f'pass{n}_after'][0]:.3f}; per seed: " + _paired_text(paired) + ".")
  for r in rows:
    (e0, _), (e1, _) = r["entropy_start"], r["entropy_end"]
    change = (e1 - e0) / e0 if e0 else float("nan")
    out.append(f"* entropy, {METHODS[r['method']][0]}, L={r['lag']}: {e0:.3f} -> {e1:.3f} nats/token "
               f"({change:+.0%}, first vs last 20 steps).")
  for r in rows:
    bad = r["passk_not_up"]
    out.append(f"* pass@k after >= before for every k = 1..{r['passk_n']}, {METHODS[r['method']][0]}, "
               f"L={r['lag']}: " + ("yes." if not bad else f"no, lower at k = {_ranges(bad)}."))
  return out


def paper_setting_findings(results, ks=(1, 2, 4, 8)) -> list[str]:
  """The paper's own comparison: OAPL at a long lag (each L > 1 run) vs GRPO+IS at L = 1,
  pass@k for k = 1..8 (its math table), paired by seed."""
  by = {(r.method, r.lag, r.seed): r for r in results}
  out = []
  for lag in sorted({r.lag for r in results if r.method == "oapl" and r.lag > 1}):
    seeds = sorted(s for (m, l, s) in by if m == "oapl" and l == lag and ("grpo_tis", 1, s) in by)
    if not seeds:
      continue
    pairs = [(by[("oapl", lag, s)], by[("grpo_tis", 1, s)]) for s in seeds]
    n = min(r.summary["eval_after"]["samples_per_problem"] for pair in pairs for r in pair)
    parts = []
    for k in (k for k in ks if k <= n):
      diffs = [float(a.passk("after", [k])[0] - g.passk("after", [k])[0]) for a, g in pairs]
      parts.append(f"pass@{k} " + _paired_text(diffs))
    out.append(f"* the paper's setting, OAPL at L={lag} vs GRPO+IS at L=1 (per seed, OAPL - GRPO+IS): "
               + "; ".join(parts) + ".")
  return out


def first_reaching(r: RunResult, target: float) -> float | None:
  """Answers generated when `r`'s held-out pass@1 (at its evaluations) first reaches `target`."""
  xs, ys = r.pass1_curve()
  hits = np.nonzero(ys >= target - 1e-12)[0]
  return float(xs[hits[0]]) if len(hits) else None


def efficiency_findings(results) -> list[str]:
  """Sample efficiency, per lag and seed: answers until OAPL reaches GRPO+IS's final pass@1,
  and until GRPO+IS reaches OAPL's (at the evaluation points; None: never)."""
  by = {(r.method, r.lag, r.seed): r for r in results}
  out = []
  for lag in sorted({r.lag for r in results}):
    parts, total = [], None
    for seed in sorted({r.seed for r in results}):
      a, g = by.get(("oapl", lag, seed)), by.get(("grpo_tis", lag, seed))
      if not (a and g):
        continue
      fa, fg = a.summary["eval_after"]["pass@1"], g.summary["eval_after"]["pass@1"]
      na, ng = first_reaching(a, fg), first_reaching(g, fa)
      fmt = lambda x: "never" if x is None else f"{x:.0f} answers"  # noqa: E731
      total = a.summary["samples_generated"]
      parts.append(f"seed {seed}: OAPL to GRPO+IS's final {fg:.3f}: {fmt(na)}, "
                   f"GRPO+IS to OAPL's final {fa:.3f}: {fmt(ng)}")
    if parts:
      out.append(f"* sample efficiency, L={lag} (answers generated, read at the evaluations; "
                 f"{total} per run): " + "; ".join(parts) + ".")
  return out


def _extra_tables(out: str, rows) -> list[str]:
  """The lr sweep (if run) and maj@k / diversity / eval entropy (tasks with final answers)."""
  lines = []
  chosen_path = os.path.join(out, "sweep", "chosen.json")
  if os.path.isfile(chosen_path):
    chosen = json.load(open(chosen_path))
    lines += ["## Learning-rate sweep", "",
              f"Each method at each lr, L={chosen['lag']}, seed {chosen['seed']} (not a study "
              "seed); the best final pass@1 picks the method's lr for every run above.", "",
              "| method | " + " | ".join(f"lr {lr}" for lr in next(iter(chosen['pass1_after'].values()))) + " | chosen |",
              "|---|" + "---|" * (len(next(iter(chosen['pass1_after'].values()))) + 1)]
    for method, table in chosen["pass1_after"].items():
      lines.append(f"| {METHODS[method][0]} | " + " | ".join(f"{v:.3f}" for v in table.values())
                   + f" | {chosen['lr'][method]:g} |")
    lines.append("")
  n = rows[0]["passk_n"] if rows else 0
  keys = [k for k in (f"maj@{n}", "distinct_answers", "distinct_correct_chains", "entropy_per_token")
          if all(f"{k}_before" in r for r in rows)]
  if rows and f"maj@{n}" in keys:  # tasks with final answers (chain_addition)
    lines += ["## Held-out votes, diversity and entropy (mean ± sd over seeds; before -> after)", "",
              "| method | L | lr | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for r in rows:
      lines.append(f"| {METHODS[r['method']][0]} | {r['lag']} | {', '.join(f'{x:g}' for x in r['lr'])} | "
                   + " | ".join(f"{_fmt(r[f'{k}_before'], 2)} -> {_fmt(r[f'{k}_after'], 2)}" for k in keys) + " |")
    lines += ["", "maj@k: majority vote over k answers' final answers; distinct_answers / "
              "distinct_correct_chains: per problem among its samples; entropy_per_token: mean "
              "-log pi_theta of its own sampled tokens.", ""]
  return lines


def _ranges(ks) -> str:
  parts, start = [], ks[0]
  for prev, k in zip(ks, ks[1:] + [None]):
    if k != prev + 1:
      parts.append(str(start) if start == prev else f"{start}-{prev}")
      start = k
  return ", ".join(parts)


NOTES_BEGIN, NOTES_END = "<!-- notes: kept when the report is regenerated -->", "<!-- end notes -->"


def write_report(out: str, report: str, *, command: str, study: str = "tiny") -> str:
  """Writes `report` (markdown) and its PNGs (in `<report without .md>/`) from the runs in `out`.

  Text between the notes markers of an existing report is kept, so a hand-written reading of
  the results survives regeneration.
  """
  results = load_runs(out)
  if not results:
    raise FileNotFoundError(f"no finished runs under {out}/runs")
  fig_dir = os.path.splitext(report)[0]
  paths = plot(results, fig_dir)
  rows = summarise(results)
  notes = "_(no notes yet)_"
  if os.path.isfile(report):
    old = open(report).read()
    if NOTES_BEGIN in old and NOTES_END in old:
      notes = old.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip()
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(report)))  # noqa: E731
  first = results[0].summary["config"]
  walls = [r.wall_seconds for r in results if r.wall_seconds]
  wall_seconds = sum(walls) if len(walls) == len(results) else None
  n = rows[0]["passk_n"]
  lines = [
      f"# {STUDIES[study].title}",
      "",
      "Produced by (from the repository root"
      + ("):" if command.startswith("bash ") else f"; `bash {STUDIES[study].launcher}` runs the same):"),
      "",
      f"    {command}",
      "",
      f"{len(results)} runs: methods {', '.join(sorted({r.method for r in results}))}; "
      f"L = {', '.join(map(str, sorted({r.lag for r in results})))}; "
      f"seeds {', '.join(map(str, sorted({r.seed for r in results})))}. "
      f"Each run: {STUDIES[study].about}, "
      f"{first['train']['steps']} trainer steps of {first['rl']['groups_per_step']} groups x "
      f"G={first['rl']['group_size']} fresh answers, lr "
      f"{', '.join(sorted({format(r.summary['config']['train']['lr'], 'g') for r in results}))}, "
      f"pass@k on {first['task']['num_eval']} held-out problems with "
      f"{first['eval']['samples_per_problem']} samples each (unbiased estimator)."
      + (f" Wall time of all runs: {wall_seconds / 60:.0f} min (2-core CPU)." if wall_seconds else ""),
      "",
      "## Final numbers (mean ± sd over seeds)",
      "",
      f"| method | L | pass@1 before | pass@1 after | pass@{n} before | pass@{n} after | entropy first 20 steps | entropy last 20 steps | answers generated | train s |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {METHODS[r['method']][0]} | {r['lag']} | {_fmt(r['pass1_before'])} | {_fmt(r['pass1_after'])} | "
        f"{_fmt(r[f'pass{n}_before'])} | {_fmt(r[f'pass{n}_after'])} | {_fmt(r['entropy_start'])} | "
        f"{_fmt(r['entropy_end'])} | {r['samples'][0]:.0f} | {r['train_seconds'][0]:.0f} |")
  lines += [
      "",
      *_extra_tables(out, rows),
      "## Plots",
      "",
      f"![pass@1 vs generated answers]({rel(paths['pass1'])})",
      "",
      f"![entropy vs trainer step]({rel(paths['entropy'])})",
      "",
      f"![pass@k before and after]({rel(paths['passk'])})",
      "",
      *[line for name, alt in (("diversity", "held-out diversity vs generated answers"),
                               ("eval_entropy", "held-out entropy vs generated answers"))
        if name in paths for line in (f"![{alt}]({rel(paths[name])})", "")],
      "## The paper's findings, checked (computed from the runs)",
      "",
      *findings(rows),
      *paper_setting_findings(results),
      *efficiency_findings(results),
      "",
      "## Reading",
      "",
      NOTES_BEGIN,
      notes,
      NOTES_END,
      "",
  ]
  os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
  with open(report, "w") as f:
    f.write("\n".join(lines))
  return report


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="folder for the runs (resumable)")
  p.add_argument("--report", default=None, help="markdown report to write (default: <out>/lag_study.md)")
  p.add_argument("--study", default="tiny", choices=list(STUDIES), help="the task (STUDIES)")
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--lags", nargs="+", type=int, default=list(DEFAULT_LAGS))
  p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
  p.add_argument("--sweep-lrs", nargs="+", type=float, default=None,
                 help="pick each method's train.lr among these first (on --sweep-seed)")
  p.add_argument("--sweep-lag", type=int, default=10, help="the lag of the sweep's runs")
  p.add_argument("--sweep-seed", type=int, default=100, help="the sweep's seed (not a study seed)")
  p.add_argument("--budget-minutes", type=float, default=None,
                 help="start no run after this many minutes (exit 3: run again to go on)")
  p.add_argument("--reduced", action="store_true", help="CI-sized runs (a few steps each)")
  p.add_argument("--report-only", action="store_true", help="write the report from finished runs")
  args = p.parse_args(argv)
  if any(l < 1 for l in args.lags + [args.sweep_lag]):
    p.error("--lags and --sweep-lag must be >= 1")
  if args.sweep_lrs and args.sweep_seed in args.seeds:
    p.error(f"--sweep-seed={args.sweep_seed} is one of --seeds: the sweep needs a separate seed")
  if args.sweep_lrs and any(lr <= 0 for lr in args.sweep_lrs):
    p.error("--sweep-lrs must be > 0")
  command = "python -m oapl_jax.studies.lag_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
  command_file = os.path.join(args.out, "study_command.txt")
  if args.report_only and os.path.isfile(command_file):  # the command that ran the study
    command = open(command_file).read().strip()
  if not args.report_only:
    os.makedirs(args.out, exist_ok=True)
    with open(command_file, "w") as f:
      f.write(command + "\n")
    deadline = (time.perf_counter() + 60 * args.budget_minutes) if args.budget_minutes is not None else None
    common = dict(methods=args.methods, reduced=args.reduced, study=args.study, deadline=deadline)
    try:
      lrs = (sweep(args.out, lrs=args.sweep_lrs, lag=args.sweep_lag, seed=args.sweep_seed, **common)
             if args.sweep_lrs else None)
      run_study(args.out, lags=args.lags, seeds=args.seeds, lrs=lrs, **common)
    except BudgetSpent as e:
      print(e)
      return 3
    except UserError as e:  # a refused setting, or a signal (checkpoint saved): one line
      print(f"error: {one_line(e)}", file=sys.stderr)
      return e.exit_code
  report = args.report or os.path.join(args.out, "lag_study.md")
  try:
    print(f"report: {write_report(args.out, report, command=command, study=args.study)}")
  except FileNotFoundError as e:  # --report-only before any run finished
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
