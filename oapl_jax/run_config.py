"""A run's config in its workdir: what a resume (or an evaluation) may change, and what not.

A run saves every setting as `<workdir>/config.json` (`save`: with its first checkpoint, and
again at each resume). The same command on that workdir is then compared with it (`check`,
before anything is written there): a setting that changes what the run *is* (its task, model
and base, its objective: the loss and its settings, the sampling distribution pi_old's
log-probs are taken in) is refused in one line naming each such setting with both values, and
nothing in the workdir is touched; a setting that may change (how long it trains and with which
optimiser schedule, the lag, logging, evaluation, checkpoints, layout) is said, one line each.
`evaluate`, `export` and `generate --workdir` refuse only a change of task, model or base
(`WORKDIR` below): they read the checkpoint's weights, and may sample or count differently.

`RULES` is the one list; docs/api.md "What a resume may change" documents it. A workdir without
config.json (a run from before it existed) is compared with its summary.json's config, if any.
"""

from __future__ import annotations

import copy
import json
import os

from oapl_jax import storage
from oapl_jax.errors import UserError
from oapl_jax.workdir import Layout, check_output_folder, check_writable

WORKDIR = "refused"  # what the checkpoints are: refused at a resume and by evaluate/export/generate
RUN = "refused at a resume"  # what the training means: refused at a resume
SAID = "said"  # may change at a resume: one line each
QUIET = "quiet"  # neither compared nor said

_PI_OLD = "the sampling distribution: the log-probs of pi_old the loss is written in"

# setting or section -> (rule, why); the longest entry a setting is or lies under decides.
RULES = {
    "task": (WORKDIR, "the problems and the reward the checkpoints were trained on"),
    "seed": (RUN, "the data order, the sampling keys and the held-out draws derive from it"),
    "model": (WORKDIR, "the architecture, dtypes and adapters the checkpoints hold"),
    "model.path": (SAID, "where the base's weights are read from (the architecture, and a LoRA "
                   "base's sha256, are still checked against the checkpoint)"),
    "model.attention_kernel": (SAID, "how attention is computed, not what"),
    "model.exact_rounding": (SAID, "where intermediate results are rounded, not the model"),
    "model.lora.init_from": (RUN, "the adapters the run started from (its checkpoints hold them "
                             "since; evaluate and export read those)"),
    "model.lora.init_from_check_name": (QUIET, "a check made at the start, not what the run is"),
    "model.lora.merge": (SAID, "where the engines' weights are merged, not what they are (the "
                         "same bit for bit)"),
    "warmup": (WORKDIR, "the base model RL started from"),
    "warmup.cache_dir": (QUIET, "where the base is cached, not what it is"),
    "warmup.cached_only": (QUIET, "whether the base may be built, not what it is"),
    "sampling": (SAID, "how the engines are laid out and batched, not what they sample"),
    "sampling.temperature": (RUN, _PI_OLD),
    "sampling.top_p": (RUN, _PI_OLD),
    "sampling.top_k": (RUN, _PI_OLD),
    "sampling.max_new_tokens": (RUN, "the answers' length cap (the rows' shape, what is truncated)"),
    "sampling.max_prompt_len": (RUN, "the rows' shape the buffer in the checkpoint holds"),
    "rl": (RUN, "the objective: the loss and its settings (rl.loss, beta1, beta2 and its rule, "
           "group size, GRPO's clip and IS, old log-probs)"),
    "rl.mode": (RUN, "the checkpoint's buffer and rollout in flight are this mode's"),
    "rl.offline": (RUN, "the rounds of stored answers the run trains on"),
    "rl.lag": (SAID, "L acts as a step size: pi_old is refreshed every rl.lag steps from here on"),
    "rl.max_lag": (SAID, "which stale groups are dropped from here on"),
    "rl.groups_per_step": (SAID, "the batch of each step from here on"),
    "rl.groups_per_rollout": (SAID, "how many groups a rollout samples from here on"),
    "rl.window_rollouts": (SAID, "how rollouts are batched on the engines, not what they sample"),
    "rl.remote": (SAID, "how sampler jobs are run, not what they sample"),
    "train": (SAID, "the optimiser and its settings from here on"),
    "train.steps": (SAID, "how long the run trains, and the lr schedule's length (its decay is "
                    "stretched or shortened from here on)"),
    "train.lr": (SAID, "the lr schedule's peak from here on"),
    "env": (RUN, "the environment the trajectories are sampled in: their tools and limits"),
    "env.workers": (SAID, "how many environment turns run at once, not what they answer"),
    "eval": (SAID, "how often the policy is evaluated"),
    "eval.samples_per_problem": (RUN, "eval before was taken with it: before and after compare "
                                 "at the same n"),
    "checkpoint": (SAID, "how often and where checkpoints are kept"),
    "log": (SAID, "what is logged"),
    "mesh": (SAID, "how the trainer's devices are laid out, not what it computes"),
    "sharding": (SAID, "how weights lie on the devices"),
    "distributed": (QUIET, "each process's own"),
}


class ConfigChanged(UserError):
  """The command's config changes what the workdir's run is (a setting `RULES` refuses)."""


def rule_of(name: str) -> tuple[str, str]:
  """(rule, why) of the setting `name` ("rl.beta2"); an unlisted section's setting is SAID."""
  return RULES.get(_entry(name), (SAID, "not listed in oapl_jax/run_config.py RULES"))


def _entry(name: str) -> str | None:
  """The entry of RULES that decides `name`: the longest it is or lies under."""
  parts = name.split(".")
  return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in RULES), None)


def _order(name: str) -> int:
  """Where `name`'s entry sits in RULES: the task and the model are named first."""
  return list(RULES).index(_entry(name)) if _entry(name) else len(RULES)


def _plain(config) -> dict:
  """A config (ConfigDict or dict) as JSON reads it back: tuples are lists."""
  d = config.to_dict() if hasattr(config, "to_dict") else config
  return json.loads(json.dumps(d, default=str))


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    name = f"{prefix}{k}"
    if isinstance(v, dict) and v:
      out |= _flat(v, name + ".")
    else:
      out[name] = v
  return out


def saved(workdir: str) -> dict | None:
  """The config the run in `workdir` saved (config.json, else summary.json's), None if none."""
  layout = Layout(workdir)
  for path, key in ((layout.config, None), (layout.summary, "config")):
    try:
      got = json.loads(storage.read_text(path))
    except FileNotFoundError:
      continue
    except (OSError, ValueError):  # unreadable: nothing to compare with
      continue
    got = got.get(key) if key and isinstance(got, dict) else got
    if isinstance(got, dict):
      return got
  return None


def differences(config, run: dict) -> list[tuple[str, object, object]]:
  """(setting, new value, the run's value) of every setting both have that differs; a task
  of another name differs in `task.name` only (its other settings are another task's)."""
  new, old = _flat(_plain(config)), _flat(run)
  out = []
  for name in sorted(set(new) & set(old)):
    if new[name] != old[name]:
      out.append((name, new[name], old[name]))
  if new.get("task.name") != old.get("task.name"):
    out = [d for d in out if not d[0].startswith("task.") or d[0] == "task.name"]
  return out


def check(config, workdir: str, *, command: str = "resume") -> list[str]:
  """Compares `config` with the run saved in `workdir`: raises ConfigChanged (one line) for a
  setting that changes what the run is (`command="resume"`: WORKDIR and RUN rules; anything else,
  an evaluation or export: WORKDIR only); returns the lines to say for the others (a resume;
  none for other commands). Nothing is written."""
  run = saved(workdir)
  if run is None:
    return []
  refused_rules = (WORKDIR, RUN) if command == "resume" else (WORKDIR,)
  refused, said = [], []
  for name, value, was in sorted(differences(config, run), key=lambda d: _order(d[0])):
    rule, why = rule_of(name)
    if rule in refused_rules:
      refused.append(f"config.{name}={value!r} (the run's: {was!r})")
    elif rule != QUIET and command == "resume":
      said.append(f"config.{name}={value!r} (the run's: {was!r}): changed at this resume; {why}")
  if refused:
    shown = ", ".join(refused[:6]) + (f" and {len(refused) - 6} more" if len(refused) > 6 else "")
    what = "resume it" if command == "resume" else command
    raise ConfigChanged(
        f"--workdir={workdir} holds a run of another config: {shown}; these change what the run "
        f"is (docs/api.md \"What a resume may change\"): to {what}, give the run's settings "
        f"(saved in {Layout(workdir).config}), or use another --workdir")
  return said


def save(config, workdir: str) -> None:
  """Writes `config` as the run's `config.json` (at once: a reader never sees half a file)."""
  storage.write_text(Layout(workdir).config, json.dumps(_plain(config), indent=2))


def default_warmup_cache(config, workdir: str | None, processes: int = 1):
  """`config`, or a copy of it with `warmup.cache_dir` set to the run's own cache (the saved
  config's cache_dir, else `<workdir>/warmup_cache`) where a LoRA run has a warm-up and no
  cache: its frozen base is then read there by `evaluate`, `export` and a resume instead of
  warmed up again (minutes). A local workdir of one process only."""
  if (not workdir or config.warmup.cache_dir or not config.warmup.steps or not config.model.lora.rank
      or processes != 1 or storage.is_remote(workdir)):
    return config
  run = saved(workdir) or {}
  theirs = (run.get("warmup") or {}).get("cache_dir")
  config = copy.deepcopy(config)  # the caller's config is left as it was
  config.warmup.cache_dir = theirs if theirs and os.path.isdir(theirs) else Layout(workdir).warmup_cache
  return config


def prepare(config, workdir: str, processes: int = 1):
  """Before a run touches its workdir: refuses (one line) a workdir it cannot write in or a
  config that changes what the saved run is (`check`); returns (the config to run, with the
  run's own warm-up cache: `default_warmup_cache`; the lines to say of the settings this resume
  changes)."""
  check_cache_dir(config)
  said = check(config, workdir)
  check_writable(workdir)
  return default_warmup_cache(config, workdir, processes), said


def checked(config, workdir: str):
  """For a command that reads a run's checkpoints (evaluate, export, generate --workdir): refuses
  (one line) a config of another task, model or base than the run's; returns the config with
  the run's own warm-up cache (`default_warmup_cache`)."""
  check(config, workdir, command="read its checkpoints")
  return default_warmup_cache(config, workdir)


def check_cache_dir(config) -> None:
  """Refuses (one line) a `warmup.cache_dir` that is a file or refuses writes, before any work
  (and before the workdir gets its first folder)."""
  if config.warmup.cache_dir and config.warmup.steps:
    check_output_folder("config.warmup.cache_dir", config.warmup.cache_dir)
