"""The study's figures (matplotlib, written as PNG): held-out pass@1 (and, on tasks with final
answers, diversity and entropy) against generated answers, policy entropy against trainer step,
and pass@k before and after training. Each is one panel per method (or per lag), the mean over
seeds with a min-max band.

Figures are built without pyplot, so the caller's backend (a notebook's) is untouched.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from oapl_jax.studies.definitions import METHODS, method_label
from oapl_jax.studies.stats import group_runs, seeds_text


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
  """Moving average of `y` over `window` points (only full windows); `y` if too short."""
  if len(y) < window or window <= 1:
    return y
  return np.convolve(y, np.ones(window) / window, mode="valid")


def _eval_curves(runs, key: str = "pass@1", x: str = "samples"):
  """(x `[n]`, held-out `key` `[seeds, n]`) over the runs' evaluations; x: "samples" (generated
  answers) or "refreshes" (`RunResult.eval_curve`)."""
  curves = [r.eval_curve(key, x) for r in runs]
  n = min(len(c[0]) for c in curves)
  return np.mean([c[0][:n] for c in curves], axis=0), np.array([c[1][:n] for c in curves])


def _entropy_curves(runs):
  """(trainer step `[n]`, smoothed entropy `[seeds, n]`)."""
  series = [r.series("entropy") for r in runs]
  n = min(len(s[1]) for s in series)
  window = max(1, min(10, n // 5))
  y = np.array([_smooth(s[1][:n], window) for s in series])
  return series[0][0][:n][n - y.shape[1]:], y  # steps at the end of each averaging window


def _subplots(ncols: int, width: float):
  """A figure of one row of `ncols` panels sharing the y axis; (figure, axes `[1, ncols]`)."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width * ncols, 3.8))
  return fig, fig.subplots(1, ncols, sharey=True, squeeze=False)


def _save(fig, name: str, title: str, *, fig_dir: str) -> str:
  """Titles `fig`, writes it as `<fig_dir>/<name>`; returns the path."""
  fig.suptitle(title)
  fig.tight_layout()
  path = os.path.join(fig_dir, name)
  fig.savefig(path, dpi=110)
  return path


def _per_method(groups, methods, lags, colors, curves, xlabel: str, ylabel: str, marker: str = "-",
                xscale: str = "linear"):
  """One panel per method, a line per lag: `curves(runs)` -> (x `[n]`, y `[seeds, n]`); xscale
  "symlog": logarithmic from 1, linear below (so 0 shows)."""
  fig, axes = _subplots(len(methods), 5)
  for ax, method in zip(axes[0], methods):
    for lag in lags:
      runs = groups.get((method, lag), [])
      if runs:
        x, y = curves(runs)
        ax.plot(x, y.mean(0), marker, ms=3, color=colors[lag], label=f"L={lag} ({seeds_text(len(runs))})")
        ax.fill_between(x, y.min(0), y.max(0), color=colors[lag], alpha=0.15)
    runs = [r for lag in lags for r in groups.get((method, lag), [])]
    ax.set(title=method_label(method, runs[0].summary["config"]) if runs else METHODS[method][0], xlabel=xlabel)
    if xscale == "symlog":
      ax.set_xscale("symlog", linthresh=1)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel(ylabel)
  axes[0][0].legend(fontsize=8)
  return fig


def _passk_panel(ax, runs_by_method: dict, n_max: int) -> None:
  """pass@k for k = 1..n_max before (the shared base) and after each method's training."""
  import matplotlib.ticker
  ks = np.arange(1, n_max + 1)
  # one colour per method, in the order of METHODS (a new method goes last: the others keep theirs)
  palette = ["tab:blue", "tab:green", "tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink",
             "tab:gray", "tab:olive", "tab:cyan"]
  method_colors = {m: palette[i % len(palette)] for i, m in enumerate(METHODS)}
  befores = {r.seed: r.passk("before", ks) for runs in runs_by_method.values() for r in runs}
  if befores:
    b = np.array(list(befores.values()))
    ax.plot(ks, b.mean(0), "k--", label="before (base)")
    ax.fill_between(ks, b.min(0), b.max(0), color="k", alpha=0.1)
  for method, runs in runs_by_method.items():
    if runs:
      a = np.array([r.passk("after", ks) for r in runs])
      ax.plot(ks, a.mean(0), color=method_colors[method], label=method_label(method, runs[0].summary["config"]))
      ax.fill_between(ks, a.min(0), a.max(0), color=method_colors[method], alpha=0.15)
  ax.set(xlabel="k", xscale="log")
  ticks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n_max]
  ax.set_xticks(ticks, [str(k) for k in ticks])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.grid(alpha=0.3)


def _passk_figure(groups, methods, lags, n_max: int):
  """One panel per lag: pass@k before and after, a line per method."""
  fig, axes = _subplots(len(lags), 4.2)
  for ax, lag in zip(axes[0], lags):
    _passk_panel(ax, {m: groups.get((m, lag), []) for m in methods}, n_max)
    ax.set(title=f"L={lag}")
  axes[0][0].set_ylabel("held-out pass@k")
  axes[0][0].legend(fontsize=7, loc="lower right")
  return fig


def plot(results, fig_dir: str) -> dict[str, str]:
  """Writes the figures as PNG (four; six with held-out diversity and entropy); returns {name: path}."""
  import matplotlib
  os.makedirs(fig_dir, exist_ok=True)
  groups = group_runs(results)
  methods = [m for m in METHODS if any(k[0] == m for k in groups)]
  lags = sorted({k[1] for k in groups})
  colors = dict(zip(lags, matplotlib.colormaps["viridis"](np.linspace(0.0, 0.85, len(lags)))))
  per_method = functools.partial(_per_method, groups, methods, lags, colors)
  save = functools.partial(_save, fig_dir=fig_dir)
  paths = {}
  paths["pass1"] = save(per_method(_eval_curves, "generated answers", "held-out pass@1", "o-"),
                        "pass1_vs_samples.png",
                        "pass@1 vs generated answers (mean over seeds; band: min-max)")
  paths["pass1_refreshes"] = save(
      per_method(lambda runs: _eval_curves(runs, "pass@1", "refreshes"), "engine refreshes (trainer steps // L)",
                 "held-out pass@1", "o-", xscale="symlog"),
      "pass1_vs_refreshes.png", "pass@1 vs engine refreshes (mean over seeds; band: min-max; log scale from 1)")
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
  paths["passk"] = save(_passk_figure(groups, methods, lags, n_max), "passk_before_after.png",
                        f"pass@k (k = 1..{n_max}) before and after training (mean over seeds; band: min-max)")
  return paths
