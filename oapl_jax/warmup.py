"""Supervised warm-up that makes the base policy of an embedded task (addition, chain_addition).

Cross-entropy on answer tokens, in two phases: clean demonstrations first (the model learns
the task), then, for the last `warmup.noisy_steps` steps, *noisy* demonstrations (each digit
wrong with probability `warmup.digit_noise`; chain_addition: each carry dropped, `task.demonstration`). The second phase flattens the answer
distribution, so the base model knows the right answer but is calibrated and imperfect: its
pass@1 is about (1 - noise)^digits, and RL with the verifiable reward has errors to fix.

Multi-host: every process trains the same base (the same demonstrations); process 0 decides
whether the cache holds it and renames a new cache into place, behind a barrier. Single-process
runs that need the same uncached base at once (a study's two halves) build it once: the first
holds an flock of `<cache>.lock` while it builds, the others wait for it and then read the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from oapl_jax import distributed
from oapl_jax.errors import UserError
from oapl_jax.workdir import exclusive_flock
from oapl_jax.metrics import say, write_json
from oapl_jax.sampling.rollout import SAMPLING_KEYS


PROGRESS_S = 20.0  # seconds between the warm-up's progress lines (step, loss, elapsed)


def demo_batch(task, tokenizer, rng: np.random.Generator, *, batch_size: int, seq_len: int,
               digit_noise: float) -> dict[str, np.ndarray]:
  """tokens `[B, seq_len]` (bos + prompt + answer, padded), mask `[B, seq_len-1]` on answer targets
  (`demo_answer`: the model's tokens; an environment's are context)."""
  tokens = np.full((batch_size, seq_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((batch_size, seq_len - 1), np.float32)
  for i, problem in enumerate(task.train_problems(rng, batch_size)):
    prompt = tokenizer.encode(problem.prompt, add_bos=True)
    answer, targets = demo_answer(tokenizer, task.demonstration(problem, rng, digit_noise=digit_noise))
    row = (prompt + answer)[:seq_len]
    tokens[i, :len(row)] = row
    mask[i, len(prompt) - 1:len(row) - 1] = targets[:len(row) - len(prompt)]
  return {"tokens": tokens, "mask": mask}


def demo_answer(tokenizer, demo) -> tuple[list[int], list[float]]:
  """A demonstration's answer tokens and which are targets. `demo`: one model turn (a str), or
  a trajectory (tasks/tool_mix.py): model turns (str, each ended by EOS; targets) and, between
  them, an environment's messages (a list of dicts, rendered as a run's are:
  `envs.episodes.env_turn_tokens`; context, not targets)."""
  from oapl_jax.envs.episodes import env_turn_tokens  # noqa: PLC0415
  tokens, targets = [], []
  for part in [demo] if isinstance(demo, str) else demo:
    if isinstance(part, str):
      ids = tokenizer.encode(part) + [tokenizer.eos_id]
    else:
      ids = env_turn_tokens(tokenizer, part, None)
    tokens += ids
    targets += [1.0 if isinstance(part, str) else 0.0] * len(ids)
  return tokens, targets


def run(graphdef, params, task, tokenizer, cfg, *, seq_len: int, seed: int):
  """Trains `params` for `cfg.steps` (>= 1) steps; returns (params, final loss)."""
  if cfg.steps < 1:  # callers skip the warm-up at warmup.steps = 0: there is no final loss
    raise ValueError(f"warmup.run needs warmup.steps >= 1, got {cfg.steps}")
  warm = max(1, cfg.steps // 20)
  sched = optax.warmup_cosine_decay_schedule(cfg.lr / (warm + 1), cfg.lr, warm, max(cfg.steps, warm + 1), cfg.lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(batch["tokens"][:, :-1])  # [B, T-1, V]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
      return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng([seed, 7])
  loss = None
  t0 = last = time.perf_counter()
  say(f"warm-up: {cfg.steps} supervised steps make the base model ({cfg.noisy_steps} on noisy "
      f"demonstrations); a line every {PROGRESS_S:g} s")
  for i in range(cfg.steps):
    noise = cfg.digit_noise if i >= cfg.steps - cfg.noisy_steps else 0.0
    batch = demo_batch(task, tokenizer, rng, batch_size=cfg.batch_size, seq_len=seq_len,
                       digit_noise=noise)
    params, opt_state, loss = step(params, opt_state, batch)
    now = time.perf_counter()
    if now - last >= PROGRESS_S and i + 1 < cfg.steps:  # a first-time user sees it working
      say(f"warm-up: step {i + 1}/{cfg.steps}, loss {float(loss):.3f}, {now - t0:.0f}s")
      last = time.perf_counter()
  return params, float(loss)


# Settings added after bases were first cached, each with the value that gives the bases (and the
# "eval before") made before it: at that value a setting is left out of the keys below, so adding
# it keeps every earlier base's name - a cache, and committed bases (docs/mix_study/paired_check),
# stay found. A new setting in a keyed section (model, task, warmup, sampling, eval, env) goes
# here with that value, unless it changes what is built (then the new names are right).
KEY_NEUTRAL = {"model.base_quant": "none", "sampling.release_weights": False}


def _keyed(section: str, settings: dict) -> dict:
  """`settings` of `section` without those at their `KEY_NEUTRAL` value."""
  return {k: v for k, v in settings.items()
          if f"{section}.{k}" not in KEY_NEUTRAL or KEY_NEUTRAL[f"{section}.{k}"] != v}


def cache_path(config, seq_len: int) -> str | None:
  """`<warmup.cache_dir>/<hash>`, the hash of everything the warmed-up base depends on."""
  if not config.warmup.cache_dir:
    return None
  model = _keyed("model", config.model.to_dict())
  lora = model.pop("lora", None)  # adapters are trained after the warm-up: a LoRA run shares the base
  if lora and lora["rank"] and config.model.dtype != config.model.param_dtype:
    model["base_dtype"] = config.model.dtype  # ... unless it holds the base in another dtype
  key = {"seed": config.seed, "model": model, "task": _keyed("task", config.task.to_dict()),
         "warmup": _keyed("warmup", {k: v for k, v in config.warmup.items()
                                     if k not in ("cache_dir", "cached_only")}),
         "seq_len": seq_len}
  return os.path.join(os.path.abspath(config.warmup.cache_dir), f"seed{config.seed}-{_digest(key)}")


def _digest(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def eval_cache_path(config, seq_len: int) -> str | None:
  """`<base's cache>.eval-<hash>.json`: the base's "eval before", keyed by everything the
  evaluation adds to the base (the seed's held-out draws and sampling keys, `eval` and
  `sampling` settings, how the sampler derives its keys: `rollout.SAMPLING_KEYS`). Runs that share a base and these (a study's methods and lags) share
  the evaluation: it is a function of them alone (the same numbers in every run, checked on
  the reasoning study's runs)."""
  base = cache_path(config, seq_len)
  if base is None:
    return None
  key = {"eval": _keyed("eval", config.eval.to_dict()),
         "sampling": _keyed("sampling", config.sampling.to_dict()), "keys": SAMPLING_KEYS}
  if config.env.name is not None:  # trajectories: the environment's settings too (single answers: keys as before)
    key["env"] = _keyed("env", config.env.to_dict())
  return f"{base}.eval-{_digest(key)}.json"


def cached_eval(config, seq_len: int, evaluate) -> dict:
  """`evaluate()` of the base, read from / written to `eval_cache_path` when the base is a
  (cacheable) warmed-up one (process 0 decides whether the file is there, for all, and writes it)."""
  path = eval_cache_path(config, seq_len) if config.warmup.steps else None
  if path and distributed.broadcast(np.array(os.path.isfile(path))):
    with open(path) as f:
      out = json.load(f)
    say(f"eval before: read from {path}")
    return out
  out = evaluate()
  if path and distributed.is_writer():
    write_json(path, out)  # written aside, then renamed
  return out


@contextlib.contextmanager
def _building(path: str | None):
  """Held while this process builds the base cached at `path`: an exclusive flock of
  `<path>.lock`, waited for while another single-process run builds the same base (multi-host
  runs and runs without a cache: nothing). The kernel drops the flock if the holder dies."""
  if not path or jax.process_count() > 1:
    yield
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with exclusive_flock(f"{path}.lock", on_wait=lambda: say(
      f"warm-up: another run is building this base ({path}); waiting for it")):
    yield


def base_model(config, graphdef, params, task, tokenizer, *, seq_len: int) -> tuple[dict, dict]:
  """The supervised warm-up's (params, info) from `params`; read from / written to
  `warmup.cache_dir` if set."""
  path = cache_path(config, seq_len)
  with _building(path):
    return _cached_or_built(config, graphdef, params, task, tokenizer, path=path, seq_len=seq_len)


def _cached_or_built(config, graphdef, params, task, tokenizer, *, path, seq_len):
  # multi-host: process 0 decides whether the cache is there, for all
  if path and distributed.broadcast(np.array(os.path.isfile(os.path.join(path, "info.json")))):
    params = ocp.StandardCheckpointer().restore(
        os.path.join(path, "params"), jax.tree.map(ocp.utils.to_shape_dtype_struct, params))
    with open(os.path.join(path, "info.json")) as f:
      info = {**json.load(f), "cached": path}
    say(f"warm-up: base model read from {path}")
    return params, info
  if config.warmup.cached_only:
    raise UserError(f"warmup.cached_only: no base model at {path} (its name is the seed and a hash "
                    f"of the model, task and warm-up settings; a base built from other settings has "
                    f"another name); copy the base there, or unset warmup.cached_only to build one")
  t0 = time.perf_counter()
  params, loss = run(graphdef, params, task, tokenizer, config.warmup, seq_len=seq_len, seed=config.seed)
  info = {"seconds": time.perf_counter() - t0, "final_loss": loss, "steps": config.warmup.steps}
  say(f"warm-up: {config.warmup.steps} steps, final loss {loss:.3f}, {info['seconds']:.1f}s")
  if path:  # written aside, then renamed: a concurrent or killed writer never leaves half a cache
    tmp = f"{path}.tmp{int(distributed.broadcast(np.array(os.getpid())))}"  # process 0's pid
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)  # every process (its shards)
    ckptr.wait_until_finished()
    if distributed.is_writer():
      write_json(os.path.join(tmp, "info.json"), info)
      try:
        os.rename(tmp, path)
      except OSError:  # another run cached the same base first
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier("warmup-cache")  # the cache is in place before any process reads it
  return params, info

