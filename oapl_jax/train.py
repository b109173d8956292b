"""The lagged OAPL loop (Algorithm 1 of the paper), in sync or async mode (`rl.mode`).

    pi_theta <- pi_old <- base weights; version = 0
    each trainer step s:
        while the buffer holds fewer than `rl.groups_per_step` groups: take the next rollout
            (`rl.groups_per_rollout` groups sampled by the engines holding pi_old, stamped
            with its version) into the buffer
            sync:  the rollout is sampled here and now
            async: it was launched when the previous one was taken, and sampled in a
                   background thread while the trainer trained; the next one is launched now
        take the oldest groups, one optimizer step on the loss (`rl.loss`: OAPL, or the
            GRPO+IS baseline, whose pi_prox is the trainer's log-probs on the snapshot)
        if (s + 1) % L == 0: pi_old <- pi_theta, version += 1, empty the buffer

In async mode a rollout launched before a refresh lands after it and is used, with its own
stamps (realised lags >= L: the staleness of an asynchronous pipeline, never dropped).
Data order and sampling keys are functions of (seed, rollout index), and rollouts are launched
at fixed points of the step sequence, so a run in either mode is exactly reproducible from its
seed and resumes exactly from a checkpoint (which holds a rollout in flight, too).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import auto as tqdm  # a widget in notebooks, a text bar in terminals
from flax import nnx

from oapl_jax import config as config_lib
from oapl_jax import warmup
from oapl_jax.checkpoint import Checkpointer
from oapl_jax.errors import UserError
from oapl_jax.eval.evaluate import decode_answers, evaluate, score_rollout
from oapl_jax.metrics import MetricsLog
from oapl_jax.models import ModelConfig, Transformer, from_hf
from oapl_jax.rl import losses
from oapl_jax.rl.buffer import GroupBuffer, stamp
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import Engine, SamplingParams
from oapl_jax.sampling.parallel import Replicas, request_host_devices
from oapl_jax.tasks import make_task
from oapl_jax.workdir import Interrupted, StopSignals, WorkdirLock


class NonFiniteSteps(UserError):
  """Too many trainer steps in a row had a non-finite loss or gradient norm."""

  exit_code = 1


# --- building blocks -------------------------------------------------------------------------


def init_model(config):
  """(model_cfg, graphdef, params): loaded from `model.path`, else initialised from config.seed."""
  model_cfg = ModelConfig.from_config(config.model)
  if config.model.path is None:
    model = Transformer(model_cfg, rngs=nnx.Rngs(params=config.seed))
  else:
    model = from_hf(config.model.path, dtype=config.model.param_dtype)
    _check_same_architecture(model_cfg, model.cfg, config.model.path)
  graphdef, params = nnx.split(model, nnx.Param)
  return model_cfg, graphdef, params


def _check_same_architecture(expected: ModelConfig, loaded: ModelConfig, path: str) -> None:
  """Refuses a checkpoint whose architecture differs from config.model's fields."""
  skip = {"param_dtype", "dtype", "max_position_embeddings"}
  diffs = [f"config.model.{f.name}={getattr(expected, f.name)!r} but {path} has {getattr(loaded, f.name)!r}"
           for f in dataclasses.fields(ModelConfig)
           if f.name not in skip and getattr(expected, f.name) != getattr(loaded, f.name)]
  if diffs:
    raise config_lib.ConfigError("checkpoint of another model:\n  " + "\n  ".join(diffs))


def make_optimizer(t, total_steps: int) -> optax.GradientTransformation:
  """AdamW with grad-norm clipping and a cosine schedule with linear warm-up."""
  warm = int(round(t.warmup_ratio * total_steps))
  if warm == 0:
    schedule = optax.cosine_decay_schedule(t.lr, total_steps, alpha=t.min_lr_ratio)
  else:  # linear from lr/(warm+1) (the first step is never a zero-lr step), then cosine
    schedule = optax.warmup_cosine_decay_schedule(
        t.lr / (warm + 1), t.lr, warm, max(total_steps, warm + 1), t.lr * t.min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay))


def seq_len(config) -> int:
  return config.sampling.max_prompt_len + config.sampling.max_new_tokens


def make_engine(config, model_cfg, graphdef) -> Engine:
  s = config.sampling
  return Engine(graphdef, model_cfg, SamplingParams.from_config(s), max_slots=s.max_slots,
                max_prefill_length=s.max_prompt_len, max_len=seq_len(config),
                steps_per_call=s.steps_per_call, attn_chunk=s.attn_chunk,
                cache_bucket=s.cache_bucket, max_prefill_batch=s.max_prefill_batch,
                min_decode_width=s.min_decode_width)


def devices_wanted(config) -> int:
  """Local devices a run uses: one per engine, plus the trainer's own in async mode."""
  return config.sampling.engines + (config.rl.mode == "async")


def make_engines(config, model_cfg, graphdef) -> Replicas:
  """`sampling.engines` replicas of `make_engine`, one per local device: the first ones, or in
  async mode the ones after the trainer's device 0 (shared with it if there are too few)."""
  devices = jax.local_devices()
  if config.rl.mode == "async" and len(devices) > config.sampling.engines:
    devices = devices[1:]
  return Replicas(lambda: make_engine(config, model_cfg, graphdef), config.sampling.engines, devices)


def loss_kwargs(config) -> dict:
  """The settings the configured loss (`config.rl.loss`) takes, read from the config."""
  rl = config.rl
  if rl.loss == "oapl":
    return {"beta1": rl.beta1, "beta2": rl.beta2}
  g = rl.grpo
  return {"adv_norm": g.adv_norm, "adv_eps": g.adv_eps, "eps_low": g.eps_low,
          "eps_high": g.eps_high, "is_level": g.is_level, "is_mode": g.is_mode,
          "is_cap": g.is_cap, "norm": g.norm, "kl_coef": g.kl_coef,
          "max_tokens": config.sampling.max_new_tokens}


def uses_reference(config) -> bool:
  """Whether the run keeps a frozen reference policy (GRPO's KL penalty)."""
  return config.rl.loss == "grpo" and config.rl.grpo.kl_coef > 0


def _token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of `[B, T]` x over tokens where mask > 0 (masked entries may be inf)."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(mask.sum(), 1.0)


def make_train_step(config, graphdef, optimizer):
  """Jitted (params, opt_state, snapshot, batch, reference) -> (params, opt_state, metrics).

  batch: tokens `[B, T]`, mask / sampler_logprobs `[B, T-1]`, rewards `[B]`, B = whole groups.
  `reference` is the frozen reference policy (GRPO with a KL penalty) or None.
  Gradient accumulation splits B into `train.grad_accum` micro-batches of whole groups; the
  loss is the full-batch one: every micro-batch divides by the full batch's count / accum
  (OAPL: of counted answers, so truncated answers left out by `rl.count_truncated=False` are
  out of the mean; GRPO token-mean: of tokens).
  A step whose loss, gradient norm or update is not finite leaves params and optimizer state
  unchanged (metric `step_skipped`).
  """
  rl = config.rl
  sampling = SamplingParams.from_config(config.sampling)
  loss_impl = functools.partial(losses.LOSSES[rl.loss], group_size=rl.group_size, **loss_kwargs(config))
  accum = config.train.grad_accum
  # GRPO's pi_prox is always the trainer's log-probs on the snapshot; OAPL's pi_old only if asked.
  needs_snapshot = rl.loss == "grpo" or rl.old_logprobs == "snapshot"

  def frozen_logprobs(params, tokens):
    return jax.lax.stop_gradient(token_logprobs(nnx.merge(graphdef, params), tokens, sampling)[0])

  def micro_loss(params, snapshot, reference, mb, num_tokens, num_answers):
    logp, ent = token_logprobs(nnx.merge(graphdef, params), mb["tokens"], sampling)  # [b, T-1]
    mask, sampler = mb["mask"], mb["sampler_logprobs"]
    m = {}
    snap = None
    if needs_snapshot:
      snap = frozen_logprobs(snapshot, mb["tokens"])
      m["snapshot_vs_sampler_abs"] = _token_mean(jnp.abs(snap - sampler), mask)
    if rl.loss == "oapl":
      old = snap if rl.old_logprobs == "snapshot" else sampler
      loss, loss_metrics = loss_impl(logp, old, mask, mb["rewards"], num_answers=num_answers)
    else:
      ref = None if reference is None else frozen_logprobs(reference, mb["tokens"])
      loss, loss_metrics = loss_impl(logp, snap, sampler, mask, mb["rewards"], ref_logprobs=ref,
                                     num_tokens=num_tokens)
    m.update(loss_metrics, entropy=_token_mean(ent, mask),
             trainer_vs_sampler_abs=_token_mean(jnp.abs(logp - sampler), mask))
    return loss, m

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, snapshot, batch, reference=None):
    num_tokens = batch["mask"].sum() / accum  # per micro-batch share of the full batch's tokens
    num_answers = (batch["mask"].sum(axis=1) > 0).sum() / accum  # ... and of its counted answers
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(grads, mb):
      (loss, m), g = grad_fn(params, snapshot, reference, mb, num_tokens, num_answers)
      return jax.tree.map(jnp.add, grads, g), (loss, m)

    grads, (loss, m) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    grads = jax.tree.map(lambda g: g / accum, grads)
    new_updates, new_opt_state = optimizer.update(grads, opt_state, params)
    grad_norm = optax.global_norm(grads)
    # A step whose loss, gradient or update is not finite is skipped: params and optimizer
    # state stay as they were (the run counts these and stops after train.max_nonfinite_steps).
    finite = (jnp.isfinite(loss).all() & jnp.isfinite(grad_norm)
              & jnp.isfinite(optax.global_norm(new_updates)))
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, optax.apply_updates(params, new_updates), params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    reduce = {"is_weight_min": jnp.min, "is_weight_max": jnp.max}
    metrics = {"loss": loss.mean(), "grad_norm": grad_norm, "step_skipped": 1.0 - finite,
               **{k: reduce.get(k, jnp.mean)(v) for k, v in m.items()}}
    return params, opt_state, metrics

  return train_step


# --- run state -------------------------------------------------------------------------------


@dataclasses.dataclass
class Counters:
  """Host-side counters saved with each checkpoint."""

  step: int = 0  # trainer steps taken
  version: int = 0  # engine refreshes so far
  snapshot_step: int = 0  # trainer step at which the engine's weights were copied
  rollouts: int = 0  # rollout calls so far (seeds the data order and sampling keys)
  samples_generated: int = 0  # answers sampled for training
  groups_dropped: int = 0  # sync mode: groups emptied from the buffer at refreshes, unused
  groups_dropped_stale: int = 0  # groups dropped for a realised lag above rl.max_lag
  steps_skipped: int = 0  # trainer steps whose loss / gradient was not finite (no update)
  nonfinite_in_a_row: int = 0  # the current run of such steps (train.max_nonfinite_steps)
  train_seconds: float = 0.0  # wall time of the RL loop (sampling + training)


@dataclasses.dataclass
class Sampled:
  """One rollout's training rows, stamped with the weights that sampled them (`rl.buffer.stamp`)."""

  rows: dict
  tokens: int  # answer tokens generated


def sample_groups(config, engines: Replicas, weights, task, tokenizer, *, index: int, version: int,
                  snapshot_step: int) -> Sampled:
  """Rollout number `index`: `rl.groups_per_rollout` fresh training prompts x G answers.

  weights: the snapshot as `engines.load_params(snapshot, version=version)`, copied from pi_theta
  at trainer step `snapshot_step`. Prompts and sampling keys are functions of (seed, index).
  """
  rng = np.random.default_rng([config.seed, 1, index])
  key = jax.random.fold_in(jax.random.key(config.seed), index)
  problems = task.train_problems(rng, config.rl.groups_per_rollout)
  prompts = [tokenizer.encode(p.prompt, add_bos=True) for p in problems]
  ro = engines.rollout(weights, prompts, group_size=config.rl.group_size,
                       max_new_tokens=config.sampling.max_new_tokens, eos_id=tokenizer.eos_id,
                       pad_id=tokenizer.pad_id, key=key)
  rewards = score_rollout(task, tokenizer, problems, ro)
  batch = make_batch(ro, rewards, seq_len=seq_len(config), pad_id=tokenizer.pad_id,
                     count_truncated=config.rl.count_truncated)
  return Sampled(stamp(batch, version=version, snapshot_step=snapshot_step), int(ro.lengths.sum()))


def _copy(tree):
  """A copy with its own buffers (the train step donates pi_theta's)."""
  return jax.tree.map(jnp.copy, tree)


def lag_histogram(lags: np.ndarray) -> dict[str, int]:
  values, counts = np.unique(lags, return_counts=True)
  return {str(int(v)): int(c) for v, c in zip(values, counts)}


class Run:
  """Everything one training run holds; `run()` drives it. Tests use its pieces directly."""

  def __init__(self, config, workdir: str):
    config_lib.validate(config)
    request_host_devices(devices_wanted(config))  # on CPU, if JAX has not started yet
    self.config = config
    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    self.task, self.tokenizer = make_task(config)
    if config.model.vocab_size < self.tokenizer.vocab_size:
      raise config_lib.ConfigError(
          f"config.model.vocab_size={config.model.vocab_size}: must be >= the tokenizer's "
          f"{self.tokenizer.vocab_size}")
    self.model_cfg, self.graphdef, params = init_model(config)
    self.optimizer = make_optimizer(config.train, config.train.steps)
    self.engines = make_engines(config, self.model_cfg, self.graphdef)
    self._engine_weights = (None, None, None)  # (snapshot, version, its copies on the engines)
    # async mode: the next rollout runs in this thread while the trainer trains
    self._pool = futures.ThreadPoolExecutor(1, "rollout") if config.rl.mode == "async" else None
    self._inflight: futures.Future | None = None  # the rollout launched and not yet consumed
    self.train_step = make_train_step(config, self.graphdef, self.optimizer)
    self.buffer = GroupBuffer(config.rl.group_size)
    self.counters = Counters()
    self.params = params
    self.opt_state = self.optimizer.init(params)
    self.snapshot = _copy(params)
    self.reference = _copy(params) if uses_reference(config) else None  # frozen: the RL start
    self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)

  # checkpoints
  def model_meta(self) -> dict:
    return dataclasses.asdict(self.model_cfg)

  def save(self) -> None:
    """Checkpoints the run; a rollout in flight is waited for and saved with it."""
    _check_all_finite({"params": self.params, "opt_state": self.opt_state, "snapshot": self.snapshot})
    state = {"params": self.params, "opt_state": self.opt_state, "snapshot": self.snapshot,
             "buffer": self.buffer.state()}
    if self.reference is not None:
      state["reference"] = self.reference
    meta = {"counters": dataclasses.asdict(self.counters), "model": self.model_meta()}
    if self._inflight is not None:
      sampled = self._inflight.result()
      state["inflight"], meta["inflight_tokens"] = sampled.rows, sampled.tokens
    self.ckpt.save(self.counters.step, state, meta)

  def restore_latest(self) -> bool:
    """Restores the newest checkpoint that loads and verifies (damaged ones are skipped with a
    warning); False if there is none. Raises checkpoint.CheckpointError if all are damaged."""
    target = {"params": self.params, "opt_state": self.opt_state, "snapshot": self.snapshot}
    if self.reference is not None:
      target["reference"] = self.reference
    found = self.ckpt.restore_latest(target, self.model_meta())
    if found is None:
      return False
    _, state, meta = found
    self.params, self.opt_state, self.snapshot = state["params"], state["opt_state"], state["snapshot"]
    self.reference = state.get("reference")
    self.buffer.load(state["buffer"])
    self.counters = Counters(**meta["counters"])
    self._inflight = None
    if state.get("inflight"):
      self._inflight = _done(Sampled({k: np.asarray(v) for k, v in state["inflight"].items()},
                                     meta["inflight_tokens"]))
    return True

  # the loop
  def engine_weights(self) -> list:
    """The snapshot on every engine's device, stamped with the version (placed once per snapshot)."""
    snapshot, version, weights = self._engine_weights
    if snapshot is not self.snapshot or version != self.counters.version:
      weights = self.engines.load_params(self.snapshot, version=self.counters.version)
      self._engine_weights = (self.snapshot, self.counters.version, weights)
    return weights

  def _launch(self) -> futures.Future:
    """Starts rollout number `counters.rollouts` with the engines' current snapshot: in the
    background in async mode (it samples while the trainer trains), else here and now."""
    c = self.counters
    job = functools.partial(sample_groups, self.config, self.engines, self.engine_weights(),
                            self.task, self.tokenizer, index=c.rollouts, version=c.version,
                            snapshot_step=c.snapshot_step)
    c.rollouts += 1
    return _done(job()) if self._pool is None else self._pool.submit(job)

  def settle(self) -> None:
    """Waits for the rollout in flight, if any (before the engines sample anything else)."""
    if self._inflight is not None:
      self._inflight.result()

  def close(self) -> None:
    """Waits for the rollout in flight and stops the rollout thread (async mode)."""
    self.settle()
    if self._pool is not None:
      self._pool.shutdown()

  def refresh_engine(self) -> None:
    """pi_old <- pi_theta; version += 1.

    Sync mode empties the buffer (Algorithm 1: each window trains on its own pi_old's groups).
    Async mode drops nothing: left-over groups of the previous pi_old are used next, like the
    rollout in flight, with their own stamps (oapl.md: stale samples are used), unless their
    realised lag exceeds `rl.max_lag`.
    """
    self.snapshot = _copy(self.params)
    self.counters.version += 1
    self.counters.snapshot_step = self.counters.step
    if self._pool is None:
      self.counters.groups_dropped += self.buffer.clear()

  def _drop_stale(self) -> None:
    """Drops buffered groups whose realised lag at this step would exceed `rl.max_lag`."""
    max_lag = self.config.rl.max_lag
    if max_lag is not None:
      self.counters.groups_dropped_stale += self.buffer.drop_older_than(self.counters.step - max_lag)

  def step(self) -> dict:
    """One trainer step (sampling first if the buffer runs short). Returns its metrics."""
    c, rl = self.counters, self.config.rl
    t0 = time.perf_counter()
    sampled_tokens = 0
    self._drop_stale()
    while len(self.buffer) < rl.groups_per_step:
      sampled = (self._inflight or self._launch()).result()
      # async: the next rollout starts now, with the snapshot of this moment (a fixed point of
      # the step sequence, so runs stay reproducible); it lands at a later step, maybe after a
      # refresh, and is used then with its own stamps
      self._inflight = None if self._pool is None else self._launch()
      self.buffer.extend(sampled.rows)
      c.samples_generated += len(sampled.rows["rewards"])
      sampled_tokens += sampled.tokens
      self._drop_stale()  # a rollout that was in flight may land already too old
    sample_seconds = time.perf_counter() - t0  # async: only the wait for a rollout in flight
    batch = self.buffer.take(rl.groups_per_step)
    lags = c.step - batch["snapshot_step"]
    device_batch = {k: batch[k] for k in ("tokens", "mask", "sampler_logprobs", "rewards")}
    self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, self.snapshot, device_batch,
                                                     self.reference)
    m = jax.device_get(m)
    c.step += 1
    if m["step_skipped"]:
      c.steps_skipped += 1
      c.nonfinite_in_a_row += 1
    else:
      c.nonfinite_in_a_row = 0
    elapsed = time.perf_counter() - t0
    c.train_seconds += elapsed
    metrics = {**m, "reward_mean": float(batch["rewards"].mean()),
               "answer_length": float(batch["answer_lengths"].mean()),
               "lag_mean": float(lags.mean()), "lag_hist": lag_histogram(lags),
               "policy_version": c.version, "samples_generated": c.samples_generated,
               "groups_dropped": c.groups_dropped, "groups_dropped_stale": c.groups_dropped_stale,
               "steps_skipped": c.steps_skipped, "step_seconds": elapsed,
               "train_seconds": c.train_seconds}
    if sampled_tokens:
      metrics["sample_wait_seconds"] = sample_seconds
      if self._pool is None:  # in async mode sampling overlaps training: no rate from the wait
        metrics["sample_tokens_per_s"] = sampled_tokens / max(sample_seconds, 1e-9)
    if lags.max() == 0:  # pi_theta == pi_old at this step: the engine/trainer mismatch
      metrics["engine_mismatch_abs"] = m["trainer_vs_sampler_abs"]
    if c.step % rl.lag == 0:
      self.refresh_engine()
    return metrics

  def sample_answers(self, *, num_problems: int = 4, n: int = 4, params=None, seed: int = 0) -> list[dict]:
    """`n` decoded answers to each of the first held-out problems, with their rewards.

    params: default pi_theta. Returns [{"prompt": str, "answers": [str], "rewards": [float]}].
    """
    self.settle()
    problems = self.task.eval_problems()[:num_problems]
    prompts = [self.tokenizer.encode(p.prompt, add_bos=True) for p in problems]
    ro = self.engines.rollout(self.params if params is None else params, prompts, group_size=n,
                              max_new_tokens=self.config.sampling.max_new_tokens,
                              eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                              key=jax.random.key(seed))
    texts = decode_answers(self.tokenizer, ro)
    rewards = score_rollout(self.task, self.tokenizer, problems, ro)
    return [{"prompt": p.prompt, "answers": texts[j * n:(j + 1) * n],
             "rewards": [float(r) for r in rewards[j * n:(j + 1) * n]]}
            for j, p in enumerate(problems)]

  def evaluate(self, params, tag: str) -> dict:
    self.settle()
    key = jax.random.fold_in(jax.random.key(self.config.seed), 1_000_003)  # same draws before/after
    t0 = time.perf_counter()
    out = evaluate(self.engines, params, self.task, self.tokenizer,
                   samples_per_problem=self.config.eval.samples_per_problem,
                   max_new_tokens=self.config.sampling.max_new_tokens, key=key)
    _say(f"eval {tag}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items() if k.startswith("pass@"))
         + f" ({time.perf_counter() - t0:.1f}s)")
    return out


def _check_all_finite(trees: dict) -> None:
  """A checkpoint never holds non-finite weights: non-finite steps are skipped, so this is a bug."""
  for name, tree in trees.items():
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if leaves and not bool(jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))):
      raise RuntimeError(f"refusing to checkpoint non-finite {name} (a skipped step leaked an update)")


def _done(result) -> futures.Future:
  """A future that already holds `result`."""
  f = futures.Future()
  f.set_result(result)
  return f


def _say(msg: str) -> None:
  """A progress line on the console that does not break the progress bar."""
  tqdm.tqdm.write(msg)
  logging.info(msg)


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def _warmup_cache_path(config) -> str | None:
  """`<warmup.cache_dir>/<hash>`, the hash of everything the warmed-up base depends on."""
  if not config.warmup.cache_dir:
    return None
  key = {"seed": config.seed, "model": config.model.to_dict(), "task": config.task.to_dict(),
         "warmup": {k: v for k, v in config.warmup.items() if k != "cache_dir"},
         "seq_len": seq_len(config)}
  digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
  return os.path.join(os.path.abspath(config.warmup.cache_dir), f"seed{config.seed}-{digest}")


def warm_up(r: Run, config) -> tuple[dict, dict]:
  """The supervised warm-up's (params, info); read from / written to `warmup.cache_dir` if set."""
  path = _warmup_cache_path(config)
  if path and os.path.isfile(os.path.join(path, "info.json")):
    params = ocp.StandardCheckpointer().restore(
        os.path.join(path, "params"), jax.tree.map(ocp.utils.to_shape_dtype_struct, r.params))
    with open(os.path.join(path, "info.json")) as f:
      info = {**json.load(f), "cached": path}
    _say(f"warm-up: base model read from {path}")
    return params, info
  t0 = time.perf_counter()
  params, loss = warmup.run(r.graphdef, r.params, r.task, r.tokenizer, config.warmup,
                            seq_len=seq_len(config), seed=config.seed)
  info = {"seconds": time.perf_counter() - t0, "final_loss": loss, "steps": config.warmup.steps}
  _say(f"warm-up: {config.warmup.steps} steps, final loss {loss:.3f}, {info['seconds']:.1f}s")
  if path:  # written aside, then renamed: a concurrent or killed writer never leaves half a cache
    tmp = f"{path}.tmp{os.getpid()}"
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)
    ckptr.wait_until_finished()
    _write_json(os.path.join(tmp, "info.json"), info)
    try:
      os.rename(tmp, path)
    except OSError:  # another run cached the same base first
      shutil.rmtree(tmp, ignore_errors=True)
  return params, info


def run(config, workdir: str) -> dict:
  """Warm-up -> eval before -> RL (OAPL or the GRPO baseline) -> eval after.

  Resumes from the last checkpoint in workdir; holds the workdir's lock for the whole run
  (a second run there is refused); on SIGTERM / SIGINT during RL it finishes the step, saves
  a checkpoint and raises `Interrupted` (the command line exits 128 + the signal number).
  """
  config_lib.validate(config)  # a bad setting is refused before the workdir is touched
  with WorkdirLock(workdir), StopSignals() as stop:
    return _run(config, workdir, stop)


def _start(r: Run, config, workdir: str) -> tuple[dict, dict]:
  """Resumes from the last checkpoint, or warms up, evaluates the base and saves step 0.

  Returns (eval_before, warmup_info)."""
  before_path = os.path.join(workdir, "eval_before.json")
  if r.restore_latest():
    _say(f"resumed from step {r.counters.step} in {r.ckpt.directory}")
    with open(before_path) as f:
      saved = json.load(f)
    return saved["eval"], saved["warmup"]
  warmup_info = {}
  if config.warmup.steps:
    r.params, warmup_info = warm_up(r, config)
  r.opt_state = r.optimizer.init(r.params)
  r.snapshot = _copy(r.params)
  if r.reference is not None:
    r.reference = _copy(r.params)
  eval_before = r.evaluate(r.params, "before")
  _write_json(before_path, {"eval": eval_before, "warmup": warmup_info})
  r.save()
  return eval_before, warmup_info


def _check_finite_steps(r: Run, config) -> None:
  """Stops the run after `train.max_nonfinite_steps` skipped (non-finite) steps in a row."""
  c = r.counters
  if c.nonfinite_in_a_row >= config.train.max_nonfinite_steps:
    r.close()
    raise NonFiniteSteps(
        f"{c.nonfinite_in_a_row} trainer steps in a row (up to step {c.step}) had a non-finite loss "
        f"or gradient norm and were skipped (train.max_nonfinite_steps="
        f"{config.train.max_nonfinite_steps}); the checkpoints hold the last finite weights. "
        f"Lower train.lr (now {config.train.lr}) or check the rewards.")


def _stop(r: Run, stop: StopSignals, saved: bool) -> None:
  """After a SIGTERM / SIGINT: a checkpoint of this step (if not just written), then `Interrupted`."""
  if not saved:
    r.save()
  r.close()
  name = signal.Signals(stop.requested).name
  raise Interrupted(stop.requested, f"stopped by {name} at step {r.counters.step}: checkpoint "
                    f"saved in {r.ckpt.directory}; run the same command again to resume")


def _run(config, workdir: str, stop: StopSignals) -> dict:
  r = Run(config, workdir)
  eval_before, warmup_info = _start(r, config, workdir)
  metrics_log = MetricsLog(workdir, resume_step=r.counters.step)
  bar = tqdm.tqdm(total=config.train.steps, initial=r.counters.step, disable=not config.log.progress,
                  desc=config.rl.loss, unit="step")
  evals = []
  with stop.deferring():  # a signal here ends the run after the current step, with a checkpoint
    while r.counters.step < config.train.steps:
      m = r.step()
      s = r.counters.step
      if config.eval.every and s % config.eval.every == 0 and s < config.train.steps:
        m["eval"] = r.evaluate(r.params, f"step {s}")
        evals.append({"step": s, **m["eval"]})
      if s % config.log.every == 0:
        metrics_log.write(s, m)
      bar.set_postfix(reward=f"{m['reward_mean']:.3f}", loss=f"{m['loss']:.4f}", lag=f"{m['lag_mean']:.1f}")
      bar.update(1)
      _check_finite_steps(r, config)
      saved = s % config.checkpoint.every == 0 or s == config.train.steps
      if saved:
        r.save()
      if stop.requested:
        bar.close()
        metrics_log.close()
        _stop(r, stop, saved)
  bar.close()
  metrics_log.close()

  eval_after = r.evaluate(r.params, "after")
  r.close()
  summary = {
      "eval_before": eval_before, "eval_after": eval_after, "evals_during": evals,
      "train_seconds": r.counters.train_seconds, "samples_generated": r.counters.samples_generated,
      "trainer_steps": r.counters.step, "policy_versions": r.counters.version,
      "steps_skipped": r.counters.steps_skipped, "warmup": warmup_info, "config": config.to_dict(),
  }
  _write_json(os.path.join(workdir, "summary.json"), summary)
  return summary
