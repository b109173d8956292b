"""What the lag study runs: its methods, lags and seeds, its two tasks, and each run's config.

A run is (study, method, lag L, seed): the study's config file with the study's settings, the
method's overrides, `rl.lag = L` and `seed` on top (`study_config`).
"""

from __future__ import annotations

import dataclasses

from oapl_jax import config as config_lib
from oapl_jax.rl.names import beta2_of  # JAX-free
from oapl_jax.studies import search as search_lib

# method name -> (label, config overrides). Everything else is the study's config file.
METHODS: dict[str, tuple[str, dict]] = {
    "oapl": ("OAPL (beta1=1, beta2=0.1)", {"rl.loss": "oapl"}),
    "oapl_paper_betas": ("OAPL, paper betas (beta1=1, beta2=1e-3)",
                         {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2": 1e-3}),
    "grpo_tis": ("GRPO+IS (token TIS, C=2)",
                 {"rl.loss": "grpo", "rl.grpo.is_level": "token", "rl.grpo.is_mode": "truncate",
                  "rl.grpo.is_cap": 2.0}),
    # The asynchronous GRPO+TIS of the paper's comparison (issue 41): PPO's ratio against the
    # trainer's previous step, the truncated IS weight (C = 2) from the lagged sampler to it.
    "grpo_tis_async": ("asynchronous GRPO+TIS (ratio to the previous step, token TIS, C=2)",
                       {"rl.loss": "grpo", "rl.grpo.prox": "previous_step",
                        "rl.grpo.is_level": "token", "rl.grpo.is_mode": "truncate",
                        "rl.grpo.is_cap": 2.0}),
    # OAPL with targets it can reach (docs/algorithm.md "Reachable targets"; studies/reachable.py)
    "oapl_tied": ("OAPL, tied betas (beta1=beta2=0.1)",
                  {"rl.loss": "oapl", "rl.beta1": 0.1, "rl.beta2_rule": "tied"}),
    "oapl_per_token": ("OAPL, per-token beta2 (beta1=1, beta2=16.384/max_new_tokens)",
                       {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2_rule": "per_token",
                        "rl.beta2_per_token": 16.384}),
    # The mixed-task study's step 2 (issue 62; docs/mix_study.md, "Step 2"): each a fixed setting
    # (no search), lr included, beside the study's three. OAPL at the paper's beta1 = 1 with
    # beta2 = 0.1, whose correct answers' targets (R - V_hat) / beta2 reach 8 nats per refresh
    # (tied's: at most log G = 2.08); its control with the paper's per-token beta2
    # (16.384 / sampling.max_new_tokens: 0.356 on the mixed task), whose largest correct-answer
    # target is 2.26 nats, about tied's; GRPO+IS at the chosen clip with the asynchronous
    # GRPO+TIS's lr 3e-4 (the search's near-tie with its chosen 1e-3), so the two GRPO rows
    # differ by their anchor alone.
    "oapl_b1": ("OAPL (beta1=1, beta2=0.1, lr 1e-4)",
                {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2": 0.1, "rl.beta2_rule": "fixed",
                 "train.lr": 1e-4}),
    "oapl_b1_len": ("OAPL (beta1=1, per-token beta2=16.384/max_new_tokens, lr 1e-4)",
                    {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2_rule": "per_token",
                     "rl.beta2_per_token": 16.384, "train.lr": 1e-4}),
    "grpo_tis_lr3e-4": ("GRPO+IS (token TIS, C=2, clip 0.8/1.12, lr 3e-4)",
                        {"rl.loss": "grpo", "rl.grpo.is_level": "token", "rl.grpo.is_mode": "truncate",
                         "rl.grpo.is_cap": 2.0, "rl.grpo.eps_low": 0.8, "rl.grpo.eps_high": 1.12,
                         "train.lr": 3e-4}),
    # S2-7, the registered follow-up to S2-1 (docs/mix_study.md): `oapl_b1` at GRPO's lr 3e-4.
    "oapl_b1_lr3e-4": ("OAPL (beta1=1, beta2=0.1, lr 3e-4)",
                       {"rl.loss": "oapl", "rl.beta1": 1.0, "rl.beta2": 0.1, "rl.beta2_rule": "fixed",
                        "train.lr": 3e-4}),
}
# Step 2 of the mixed-task study (issue 62): each variant's lags (`--method-lags`), in the order
# its runs go (the longest lag first: the prediction is read there first). GRPO+IS at lr 3e-4 and
# L = 1 is the asynchronous GRPO+TIS's run (one algorithm at L = 1), so it has no L = 1 run.
MIX_STEP2_LAGS = {"oapl_b1": (200, 100, 50), "oapl_b1_len": (200, 100, 50),
                  "grpo_tis_lr3e-4": (200, 100, 50, 10)}
# The methods a study runs unless told (`--methods`): the lag studies' three. The others are
# for the reachable-targets experiment and the studies to come (issue 41).
DEFAULT_METHODS = ("oapl", "oapl_paper_betas", "grpo_tis")
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
# 1000 trainer steps at every lag: 10 engine refreshes at L = 100 (20 at L = 50), and every
# method and lag sees the same 128,000 generated answers (issue 30; the first study ran 300).
REASON_FULL = {"rl.groups_per_step": 16, "rl.groups_per_rollout": 16, "task.num_eval": 64,
               "eval.samples_per_problem": 256, "eval.every": 100, "checkpoint.every": 25,
               "train.steps": 1000, "log.progress": False}
# A search run (search.py) on top of REASON_FULL: as long as a study run, but its evaluations
# (the choice reads only the final pass@1) have 64 samples per problem, every 200 steps: an
# eighth of a study run's evaluation answers (5 x 64 against 10 x 256 per problem), the final
# pass@1 still from 4,096 answers.
REASON_SEARCH = {"eval.samples_per_problem": 64, "eval.every": 200}
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
  search: dict = dataclasses.field(default_factory=dict)  # a search run's settings on top of `full`
  seeds: tuple[int, ...] = DEFAULT_SEEDS  # the seeds `launcher` runs (the report counts those done)
  along: tuple[int, ...] = ()  # trainer steps at which the report tabulates pass@1 along the run
  methods: tuple[str, ...] = DEFAULT_METHODS  # the methods it runs unless told (--methods)
  lags: tuple[int, ...] = DEFAULT_LAGS  # its lags unless told (--lags)
  grids: dict | None = None  # its search's grids (search.study_grid; None: the reasoning study's)
  search_lrs: tuple[float, ...] | None = None  # its search's lrs (None: search.SEARCH_LRS)
  # the (OAPL, GRPO) method pairs its report's findings and verdicts compare, paired by seed
  pairs: tuple[tuple[str, str], ...] = (("oapl", "grpo_tis"),)


STUDIES = {
    "tiny": Study("tiny.py", FULL, REDUCED, "Lag study: OAPL vs GRPO+IS at engine lags L on the tiny task",
                  "`configs/tiny.py` (two-digit addition, a 2-layer width-128 model whose base is "
                  "made by a supervised warm-up shared by all runs of a seed)", "launch/lag_study.sh"),
    "reason": Study("reason.py", REASON_FULL, REASON_REDUCED,
                    "Reasoning study: OAPL vs GRPO+IS at engine lags L on chain-of-steps addition",
                    "`configs/reason.py` (5-digit addition answered by a chain of column steps, "
                    "52-53 tokens; a 2-layer width-128 model whose base, shared by all runs of a "
                    "seed, is made by a supervised warm-up ending on demonstrations with dropped "
                    "carries)", "launch/reasoning_study.sh", reduced_config="reason.py:smoke",
                    search=REASON_SEARCH, seeds=(0, 1, 2, 3, 4), along=(100, 300, 500, 1000)),
    # The study on the mixed task (issue 41, point 5): OAPL with targets it can reach against
    # both GRPO variants, out to L = 200 (the paper's code ran 400 at larger batches), every
    # method's settings searched over its own axis x lr 3e-5..1e-3 (search.MIX_GRIDS, 12 points
    # each), the same run settings as the reasoning study. Run (45 runs, seeds 0-2): docs/mix_study.md.
    "mix": Study("mix.py", REASON_FULL, REASON_REDUCED,
                 "Mixed-task study: OAPL (reachable targets) vs GRPO+IS and asynchronous GRPO+TIS "
                 "at engine lags L",
                 "`configs/mix.py` (3-digit +, -, x a digit and x a two-digit number, each a chain "
                 "of column steps with its own rule; the reasoning study's model and RL settings, a "
                 "3000-step warm-up; in the task's calibration a base solved 0.243 of held-out "
                 "problems, pass@256 0.844; the study's own bases are under \"before\")",
                 "launch/mix_study.sh", reduced_config="mix.py:smoke", search=REASON_SEARCH,
                 seeds=(0, 1, 2), along=(100, 300, 500, 1000),
                 methods=("oapl_tied", "grpo_tis", "grpo_tis_async"), lags=(1, 10, 50, 100, 200),
                 grids=search_lib.MIX_GRIDS, search_lrs=search_lib.MIX_SEARCH_LRS,
                 pairs=(("oapl_tied", "grpo_tis"), ("oapl_tied", "grpo_tis_async"))),
}


def method_label(method: str, config: dict) -> str:
  """A method's name in reports, with the settings its runs had (`config`: a summary's config);
  METHODS' label where the config lacks them."""
  rl = config.get("rl", {})
  # a method whose own settings fix the lr (a variant beside a searched method): the lr too
  lr = f", lr {config['train']['lr']:g}" if "train.lr" in METHODS.get(method, ("", {}))[1] and "lr" in config.get("train", {}) else ""
  if method.startswith("oapl") and {"beta1", "beta2"} <= set(rl):
    beta2 = beta2_of(config) if "sampling" in config else rl["beta2"]  # as its rule resolved it
    return f"OAPL (beta1={rl['beta1']:g}, beta2={beta2:.3g}{lr})"
  g = rl.get("grpo", {})
  if method.startswith("grpo_tis") and {"is_cap", "eps_low", "eps_high"} <= set(g):
    name = "async GRPO+TIS" if g.get("prox") == "previous_step" else "GRPO+IS"
    return f"{name} (token TIS, C={g['is_cap']:g}, clip {g['eps_low']:g}/{g['eps_high']:g}{lr})"
  return METHODS[method][0]


def set_dotted(config, dotted: str, value) -> None:
  """Sets the field at dotted path `dotted` ("rl.grpo.is_cap") of `config` to `value`."""
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def study_config(method: str, lag: int, seed: int, *, reduced: bool = False,
                 cache_dir: str | None = None, overrides: dict | None = None, study: str = "tiny",
                 search: bool = False):
  """The study's config file with its settings (a search run's on top when `search`, unless
  `reduced`), the method's, `overrides`, `rl.lag=lag` and `seed`."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; known: {sorted(METHODS)}")
  if study not in STUDIES:
    raise ValueError(f"unknown study {study!r}; known: {sorted(STUDIES)}")
  spec = STUDIES[study]
  c = config_lib.repo_config(spec.reduced_config or spec.config if reduced else spec.config)
  settings = spec.reduced if reduced else {**spec.full, **(spec.search if search else {})}
  for k, v in {**settings, **METHODS[method][1], **(overrides or {})}.items():
    set_dotted(c, k, v)
  c.rl.lag, c.seed = lag, seed
  c.warmup.cache_dir = cache_dir
  return c
