"""The settings search before a study, as pure functions: each method's grid of points (a point
is a dict of config overrides), the name of a point's run, the order the runs go in, the
screening at the later lags, and the choice of each method's setting from the finished runs'
final pass@1.

Screening (`top_k`; the joint search's is SCREEN_TOP_K): every point runs at the first lag; at
the later lags only each method's top_k points by their first-lag pass@1 run (`screened`), so
which runs come after the first lag is known only once the first lag's runs have finished. The
choice is then the best mean over the lags among those top_k points. top_k None: every point at
every lag.

A grid is an ordered tuple of axes; an axis moves one or more settings together ("clip" moves
rl.grpo.eps_low and eps_high) through its values, the first value being the configs' current
one. Values are listed in the order they are tried, so the current setting runs first.
"""

from __future__ import annotations

import dataclasses
import itertools

from oapl_jax.studies import layout


@dataclasses.dataclass(frozen=True)
class Axis:
  """One axis of a grid: `tag` names it in run folders and the report, `settings` are the dotted
  config settings it moves, `values` one tuple per point (as many entries as `settings`)."""
  tag: str
  settings: tuple[str, ...]
  values: tuple[tuple[float, ...], ...]


def lr_axis(lrs) -> Axis:
  """train.lr over `lrs` (in the order given: the first runs first)."""
  return Axis("lr", ("train.lr",), tuple((float(lr),) for lr in lrs))


# OAPL: the paper searched beta1 in {1, 5} and beta2 in {1e-2, 1e-3}; 0.1 is the configs' beta2
# (docs/design.md "Tiny-task betas"). beta2 is the main axis (how far one refresh can move the
# policy), so it is first: its values at the current beta1 and lr run before the others.
OAPL_BETA2 = Axis("b2", ("rl.beta2",), ((0.1,), (1e-2,), (1e-3,)))
OAPL_BETA1 = Axis("b1", ("rl.beta1",), ((1.0,), (5.0,)))
# GRPO+IS: the truncation cap C is inert in this loop (the engine samples with the snapshot
# itself, so the IS weights pi_prox / pi_sampler stay within ~3e-6 of 1: any C >= 1.5 gives the
# same run; docs/algorithm.md). What bounds GRPO+IS's step against a lagged pi_prox is its PPO
# clip, so its search moves the clip range [1 - eps_low, 1 + eps_high] instead, eps_high kept at
# 1.4 x eps_low as the configs' clip-higher 0.2 / 0.28. Six values, so GRPO+IS gets as many runs
# as OAPL's 2 x 3 betas.
GRPO_CLIP = Axis("clip", ("rl.grpo.eps_low", "rl.grpo.eps_high"),
                 ((0.2, 0.28), (0.1, 0.14), (0.4, 0.56), (0.05, 0.07), (0.6, 0.84), (0.8, 1.12)))
SEARCH_LRS = (1e-4, 3e-4, 1e-3)  # every method's lr axis
# The mixed-task study's searches (issue 41, point 5), three points each besides the lr:
# OAPL with tied betas over beta1 = beta2 (rl.beta2_rule="tied": every target reachable; 0.1
# the reachable-targets experiment's); GRPO+IS over three of the clips above (the reasoning
# study chose 0.8/1.12); the asynchronous GRPO+TIS over its truncation cap C, the lever of its
# off-policy correction (its PPO ratio is to the step's own start, 1 at a single optimizer step
# per batch, so its clip is inert there).
TIED_BETA = Axis("beta", ("rl.beta1",), ((0.1,), (0.03,), (0.3,)))
GRPO_CLIP_3 = Axis("clip", GRPO_CLIP.settings, (GRPO_CLIP.values[5], GRPO_CLIP.values[0], GRPO_CLIP.values[2]))
TIS_CAP = Axis("C", ("rl.grpo.is_cap",), ((2.0,), (1.5,), (4.0,)))
# The lr axis of the mixed-task study, out to the edges the reasoning study's search stopped at
# (its OAPL chose its lowest lr, 1e-4): 3e-5 .. 1e-3.
MIX_SEARCH_LRS = (3e-5, 1e-4, 3e-4, 1e-3)
# Each method's axes before its lr (study_grid appends the lr axis), per study.
REASON_GRIDS = {"oapl": (OAPL_BETA2, OAPL_BETA1), "grpo_tis": (GRPO_CLIP,)}
MIX_GRIDS = {"oapl_tied": (TIED_BETA,), "grpo_tis": (GRPO_CLIP_3,), "grpo_tis_async": (TIS_CAP,)}
# The lr each method's search tries first: the 300-step study's choices for oapl and grpo_tis,
# the reasoning study's for the others.
CURRENT_LR = {"oapl": 3e-4, "grpo_tis": 1e-3, "oapl_tied": 1e-4, "grpo_tis_async": 3e-4}
SEARCH_LAGS = (100, 50)  # the search's lags, in the order they run
SEARCH_SEED = 100  # not a study seed
# The joint search's screening: at the second lag (L = 50) only each method's 6 best points by
# their L = 100 final pass@1 run (ties: the point that ran first), a third of its 18 and the
# same number for both methods, so their budgets stay equal: 2 x (18 + 6) = 48 runs instead of
# 72 (issue 30, "make it cheaper where the code allows"). A point's L = 50 run can only change
# the choice among points that are already near the top at L = 100.
SCREEN_TOP_K = 6


def _current_first(values, current) -> tuple:
  """`values` with `current` moved to the front (the others keep their order)."""
  return tuple(sorted(values, key=lambda v: v != current))


def study_grid(methods, grids=None, lrs=None) -> dict[str, tuple[Axis, ...]]:
  """The joint search for `methods`: each one's axes in `grids` (REASON_GRIDS when None) x the
  lr axis over `lrs` (SEARCH_LRS when None), its current lr first. The reasoning study's (issue
  30): OAPL over beta2 x beta1 x lr (18 points), GRPO+IS over its clip x lr (18 points)."""
  grids = REASON_GRIDS if grids is None else grids
  unknown = [m for m in methods if m not in grids]
  if unknown:
    raise ValueError(f"no search grid for {unknown}; the search has one for {sorted(grids)}")
  lrs = SEARCH_LRS if lrs is None else lrs
  return {m: grids[m] + (lr_axis(_current_first(lrs, CURRENT_LR[m])),) for m in methods}


def lr_grid(methods, lrs) -> dict[str, tuple[Axis, ...]]:
  """A learning-rate sweep: every method over `lrs` only."""
  return {m: (lr_axis(lrs),) for m in methods}


def points(axes) -> list[tuple[int, ...]]:
  """Every point of a grid as its value indices, one per axis, in the order they run: the later
  axes' current values first (so the first axis is swept at the current setting of the others)."""
  grid = itertools.product(*(range(len(a.values)) for a in axes))
  return sorted(grid, key=lambda idx: tuple(reversed(idx)))


def overrides(axes, idx) -> dict[str, float]:
  """The config overrides of point `idx` (value indices) of grid `axes`."""
  return {s: v for a, i in zip(axes, idx) for s, v in zip(a.settings, a.values[i])}


def label(axes, idx) -> str:
  """A point's name in its run folder: "b2-0.1_b1-1_lr-0.0003" (a lone lr axis: "lr0.0003", as
  the lr sweep has always named its runs)."""
  if [a.tag for a in axes] == ["lr"]:
    return f"lr{axes[0].values[idx[0]][0]:g}"
  return "_".join(f"{a.tag}-{a.values[i][0]:g}" for a, i in zip(axes, idx))


def beyond(axes, idx, tag: str, value: float) -> tuple[tuple[Axis, ...], tuple[int, ...]]:
  """Point `idx` of grid `axes` with its axis tagged `tag` moved to `value`, a value outside the
  grid (an edge check after the search): (the axes with `value` appended to that axis, the new
  point's indices), so `overrides` and `label` name it as they would a grid point. ValueError for
  an unknown tag, an axis moving several settings, or a value already in the grid."""
  tags = [a.tag for a in axes]
  if tag not in tags:
    raise ValueError(f"no axis {tag!r} in this grid (axes: {', '.join(tags)})")
  k = tags.index(tag)
  if len(axes[k].settings) != 1:
    raise ValueError(f"axis {tag!r} moves {len(axes[k].settings)} settings together; only a "
                     "one-setting axis can be moved past its edge")
  if (value,) in axes[k].values:
    raise ValueError(f"{tag}={value:g} is already in the grid: its runs are the search's")
  moved = dataclasses.replace(axes[k], values=axes[k].values + ((float(value),),))
  return axes[:k] + (moved,) + axes[k + 1:], idx[:k] + (len(axes[k].values),) + idx[k + 1:]


def describe(axes, idx, skip=()) -> str:
  """A point for people: "beta2=0.1, beta1=1, lr=0.0003" (axes tagged in `skip` left out)."""
  return ", ".join(f"{s.rsplit('.', 1)[-1]}={v:g}" for a, i in zip(axes, idx) if a.tag not in skip
                   for s, v in zip(a.settings, a.values[i]))


def _alternate(per_method) -> list:
  """The methods' lists merged point by point (A1, B1, A2, B2, ...; a shorter list ends first)."""
  return [x for row in itertools.zip_longest(*per_method) for x in row if x is not None]


def screened(grid: dict, lags, scores: dict, top_k: int | None) -> dict[str, list[tuple[int, ...]]] | None:
  """Each method's points that run at the lags after the first: its `top_k` points by their
  first-lag final pass@1, best first (ties: the point that runs first); every point (in `points`
  order) when `top_k` is None or there is one lag. None while a first-lag score is missing (the
  later lags' runs are not known yet).

  scores: {(method, lag, point): final pass@1}.
  """
  if top_k is None or len(lags) < 2:
    return {m: points(axes) for m, axes in grid.items()}
  kept = {}
  for method, axes in grid.items():
    pts = points(axes)
    if any((method, lags[0], p) not in scores for p in pts):
      return None
    ranked = sorted(range(len(pts)), key=lambda i: (-scores[(method, lags[0], pts[i])], i))
    kept[method] = [pts[i] for i in ranked[:top_k]]
  return kept


def planned_runs(axes, lags, top_k: int | None) -> int:
  """How many search runs a method with grid `axes` has: every point at the first lag, then
  `top_k` of them (all if None) at each later lag."""
  n = len(points(axes))
  return n + (len(lags) - 1) * (n if top_k is None else min(top_k, n))


def run_order(grid: dict, lags, scores: dict | None = None,
              top_k: int | None = None) -> list[tuple[int, str, tuple[int, ...]]]:
  """(lag, method, point) of every search run known so far, most informative first: lag by lag
  in `lags` order, the methods alternating point by point; at the first lag each method's
  points in `points` order, at the later ones its `screened` points (best first). The later
  lags' runs are left out while `screened` is None (a first-lag score missing from `scores`)."""
  first = [[(lags[0], m, idx) for idx in points(axes)] for m, axes in grid.items()]
  kept = screened(grid, lags, scores or {}, top_k)
  if kept is None:
    return _alternate(first)
  return _alternate(first) + [x for lag in lags[1:] for x in _alternate(
      [[(lag, m, idx) for idx in kept[m]] for m in grid])]


def choose(grid: dict, lags, scores: dict, top_k: int | None = None) -> dict[str, tuple[int, ...]] | None:
  """Each method's point with the best final pass@1 averaged over `lags`, among its `screened`
  points (every point when `top_k` is None; ties: the point that runs first at the first lag,
  i.e. nearer the current setting); None until each of those has a score at every lag.

  scores: {(method, lag, point): final pass@1}.
  """
  kept = screened(grid, lags, scores, top_k)
  if kept is None:
    return None
  chosen = {}
  for method, axes in grid.items():
    pts = [p for p in points(axes) if p in kept[method]]
    if any((method, lag, p) not in scores for p in pts for lag in lags):
      return None
    means = [sum(scores[(method, lag, p)] for lag in lags) / len(lags) for p in pts]
    chosen[method] = pts[max(range(len(pts)), key=lambda i: (means[i], -i))]
  return chosen


def plan_json(grid: dict, lags, seed: int, top_k: int | None = None) -> dict:
  """The search's plan as written to `search.json`: its lags (in run order), seed, grids and
  screening (`screen_top_k`: None, every point at every lag)."""
  return {"lags": list(lags), "seed": seed,
          "grid": {m: [dataclasses.asdict(a) for a in axes] for m, axes in grid.items()},
          "screen_top_k": top_k}


def merge_plans(old: dict | None, new: dict) -> dict:
  """The search plan `new` (`plan_json`) added to `old` (None: none yet): one search (the same
  seed, lags and screening) whose methods were searched by separate commands (e.g. step 2's
  stages, one method each) has every method's grid; a method's grid is never replaced by
  another. ValueError if they are not one search."""
  if old is None:
    return new
  for key in ("seed", "lags", "screen_top_k"):
    if old.get(key) != new.get(key):
      raise ValueError(f"another search's plan: {key} {new.get(key)} here, {old.get(key)} there")
  for m, axes in new["grid"].items():
    if m in old["grid"] and old["grid"][m] != axes:
      raise ValueError(f"another search's plan: {m}'s grid differs")
  return {**old, "grid": {**old["grid"], **new["grid"]}}


def plan_top_k(plan: dict) -> int | None:
  """A plan's screening (`plan_json`); None for a plan written before screening existed (every
  point at every lag)."""
  return plan.get("screen_top_k")


def grid_from_plan(plan: dict) -> dict[str, tuple[Axis, ...]]:
  """The grids of a `plan_json`."""
  return {m: tuple(Axis(a["tag"], tuple(a["settings"]), tuple(map(tuple, a["values"])))
                   for a in axes) for m, axes in plan["grid"].items()}


def search_scores(plan: dict, compact_results: dict) -> dict:
  """{(method, lag, point indices): final pass@1} of the finished search runs among
  `compact_results` ({run name: compact result}) for `plan`."""
  grid, scores = grid_from_plan(plan), {}
  for lag in plan["lags"]:
    for method, axes in grid.items():
      for idx in points(axes):
        name = layout.run_name(method, lag, plan["seed"], label(axes, idx))
        if name in compact_results:
          scores[(method, lag, idx)] = compact_results[name]["summary"]["eval_after"]["pass@1"]
  return scores


def outside_scores(plan: dict, compact_results: dict) -> dict:
  """{(method, lag, point label): final pass@1} of the finished runs among `compact_results` on
  the search's seed and lags that are not points of its grid: the edge checks (`beyond`)."""
  grid = grid_from_plan(plan)
  inside = {label(axes, idx) for axes in grid.values() for idx in points(axes)}
  scores = {}
  for name, result in compact_results.items():
    method, lag, seed, point = layout.parse_run_name(name) or (None, None, None, None)
    if method in grid and seed == plan["seed"] and lag in plan["lags"] and point and point not in inside:
      scores[(method, lag, point)] = result["summary"]["eval_after"]["pass@1"]
  return scores
