"""The lagged OAPL loop (Algorithm 1 of the paper): one run's state and its step.

    pi_theta <- pi_old <- base weights; version = 0
    each trainer step s:
        while the buffer holds fewer than `rl.groups_per_step` groups: take the next rollout
            (`rl.groups_per_rollout` groups sampled by the engines holding pi_old, stamped
            with its version) from the source (`rl.mode`: `sources.SOURCES`) into the buffer
        take the oldest groups, one optimizer step on the loss (`rl.loss`: OAPL, or the
            GRPO+IS baseline, whose pi_prox is the trainer's log-probs on the snapshot)
        if (s + 1) % L == 0: pi_old <- pi_theta, version += 1; sync mode empties the buffer

In offline mode (`sources.OfflineSource`, `rl.offline`) rollouts are rounds of stored
answers, and pi_old is refreshed at the end of each round instead; then the run goes on in sync
mode. In async mode a rollout launched before a refresh lands after it, and left-over groups
outlive it: both are used with their own stamps (realised lags >= L: the staleness of an
asynchronous pipeline), unless older than `rl.max_lag`. Data order and sampling keys are
functions of (seed, rollout index), and rollouts are launched at fixed points of the step
sequence, so a run in either mode is exactly reproducible from its seed and resumes exactly
from a checkpoint (which holds a rollout in flight, too).

Multi-host (oapl_jax/distributed.py): every process draws the same global problems and samples
its replicas' share of them (`parallel.Replicas`); its buffer holds its own rows, and a step
takes `rl.groups_per_step / process_count` groups from each, assembled into one global batch
(`step.TrainStep.place_batch`). With `rl.groups_per_rollout` and `rl.groups_per_step` multiples
of the replicas in all, that is the same set of groups a single process with as many replicas
trains on. Metrics and counters are over all processes (`distributed.concat_rows`, `total`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from oapl_jax import distributed, placement, sharding, storage, timing, warmup
from oapl_jax import checkpoint
from oapl_jax.checkpoint import Checkpointer
from oapl_jax.errors import ConfigError
from oapl_jax.eval.evaluate import eval_key, evaluate
from oapl_jax.metrics import say
from oapl_jax.models import build
from oapl_jax.models.build import init_model
from oapl_jax.rl.buffer import GroupBuffer, Rows, stamp
from oapl_jax.rl.logprobs import make_batch
from oapl_jax.rl.sources import SOURCES, Drawn
from oapl_jax.rl.step import make_optimizer, make_train_step, uses_reference
from oapl_jax.sampling import SamplingParams
from oapl_jax.sampling.layout import MergeOnLoad
from oapl_jax.placement import seq_len
from oapl_jax.sampling.parallel import global_row_order
from oapl_jax.sampling.rollout import prompt_keys
from oapl_jax.sampling.sampler import Sampler, make_replicas, make_sampler
from oapl_jax.tasks import make_task


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


def _split(config) -> placement.Split:
  """This process's local devices split between trainer and engines (`placement.split_devices`)."""
  return placement.split_devices(config, len(jax.local_devices()), jax.process_count())


def engine_devices(config) -> list:
  """The engines' local devices, replica after replica (`sampling.tensor` consecutive devices
  each), as `placement.split_devices` places them; fewer than the engines need if this process
  has too few (`parallel.Replicas` then says so)."""
  devices = jax.local_devices()
  return [devices[i] for i in _split(config).engines if i < len(devices)]


def trainer_devices(config) -> list:
  """The trainer's devices (its mesh: `sharding.make_mesh(config.mesh, ...)`), as
  `placement.split_devices` places them: every device of every process when the trainer has
  all of this process's devices; else this process's trainer devices (one process: async)."""
  trainer, local = _split(config).trainer, jax.local_devices()
  if len(trainer) == len(local):
    return jax.devices()
  return [local[i] for i in trainer]


def rollout_problems(config, task, indices: list[int]) -> tuple[list, jax.Array]:
  """(problems, per-prompt sampling keys) of rollouts number `indices`: each
  `rl.groups_per_rollout` fresh training problems, functions of (seed, index) only (a remote
  sampler job's rollout `index` is the sync run's: oapl_jax/rl/remote.py)."""
  problems, keys = [], []
  for index in indices:
    rng = np.random.default_rng([config.seed, 1, index])
    key = jax.random.fold_in(jax.random.key(config.seed), index)
    problems += task.train_problems(rng, config.rl.groups_per_rollout)
    keys.append(prompt_keys(key, config.rl.groups_per_rollout))
  return problems, jnp.concatenate(keys)


def draw_rollouts(config, sampler: Sampler, weights, *, indices: list[int], version: int,
                  snapshot_step: int) -> Drawn:
  """Rollouts number `indices` (consecutive), sampled in one continuous batch: each
  `rl.groups_per_rollout` fresh training problems x G answers, their rows in rollout order.

  weights: the snapshot as `sampler.load(snapshot, version)`, copied from pi_theta at trainer
  step `snapshot_step`. A rollout's problems and its prompts' sampling keys are functions of
  (seed, index) only, and an answer follows its prompt's key whatever is sampled beside it
  (`sampling.rollout`): so the rows of rollout i are the same whether it is drawn alone or in a
  window of several (`rl.window_rollouts`).
  """
  problems, keys = rollout_problems(config, sampler.task, indices)
  scored = sampler.sample(weights, problems, group_size=config.rl.group_size, key=keys)
  rows = make_batch(scored.rollout, scored.rewards, seq_len=seq_len(config),
                    pad_id=sampler.tokenizer.pad_id, count_truncated=config.rl.count_truncated)
  stats = scored.rollout.stats
  return Drawn(stamp(rows, version=version, snapshot_step=snapshot_step),
               int(scored.rollout.lengths.sum()), seconds_sampling=scored.seconds_sampling,
               seconds_rewards=scored.seconds_rewards, env_metrics=scored.env_metrics,
               live_slot_steps=int(stats.get("live_slot_steps", 0)),
               slot_steps=int(stats.get("slot_steps", 0)))


def check_processes(config, n: int) -> int:
  """rl.groups_per_step, once checked against `n` processes (multi-host): whole groups per
  engine replica (over all processes), so every process holds the same number of rows at
  every step."""
  if n == 1:
    return config.rl.groups_per_step
  if config.rl.mode not in ("sync", "remote"):
    raise ConfigError(f"config.rl.mode={config.rl.mode!r}: multi-host runs ({n} processes) "
                      "support rl.mode='sync' or 'remote', for now")
  placement.local_engines(config, n)  # the replicas divide over the processes
  replicas = config.sampling.engines
  for setting in ("rl.groups_per_step", "rl.groups_per_rollout"):
    section, name = setting.split(".")
    value = config[section][name]
    if value % replicas:
      raise ConfigError(f"config.{setting}={value}: must be a multiple of the engine replicas over "
                        f"all processes (sampling.engines={replicas}, in {n} processes)")
  return config.rl.groups_per_step


def lag_histogram(lags: np.ndarray) -> dict[str, int]:
  values, counts = np.unique(lags, return_counts=True)
  return {str(int(v)): int(c) for v, c in zip(values, counts)}


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
  """Whether every float leaf is finite: one program (on a mesh: one set of all-reduces; many
  small eager ones in flight at once can deadlock the CPU backend's collectives)."""
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def check_all_finite(trees: dict) -> None:
  """A checkpoint never holds non-finite weights: non-finite steps are skipped, so this is a bug."""
  for name, tree in trees.items():
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if leaves and not bool(_all_finite(leaves)):
      raise RuntimeError(f"refusing to checkpoint non-finite {name} (a skipped step leaked an update)")


class Run:
  """One training run: pi_theta and its optimizer state, the engines' snapshot pi_old, the
  buffer, the sample source and the counters; `step()` is one step of the lagged loop.

  pi_theta (model.param_dtype), its AdamW state, pi_old (a model.dtype copy) and the GRPO
  reference live sharded on the trainer's mesh (`self.mesh`, over `trainer_devices`; layouts
  and the jitted step: `step.TrainStep`); the engines load pi_old from there. Under model.lora
  those are the adapters, `self.base` is the frozen base (model.dtype) and the engines load the
  base merged with pi_old's adapters.

  `oapl_jax.train.run` drives it; tests and notebooks use its pieces directly.
  """

  def __init__(self, config, workdir: str):
    """config: validated (`oapl_jax.config.validate`; `train.run` does it)."""
    self.config = config
    # first: a setting multi-host runs refuse, before anything is built on the devices
    self.groups_per_step = check_processes(config, jax.process_count()) // jax.process_count()  # this process's share
    storage.makedirs(workdir)
    task, tokenizer = make_task(config)
    if config.model.vocab_size < tokenizer.vocab_size:
      raise ConfigError(
          f"config.model.vocab_size={config.model.vocab_size}: must be >= the tokenizer's "
          f"{tokenizer.vocab_size}")
    self.mesh = sharding.make_mesh(config.mesh, trainer_devices(config))  # the trainer's
    # model.lora: pi_theta is the adapters, over a frozen base held in model.dtype (`set_base`)
    self.lora = build.lora_of(config)
    self.model_cfg, self.engine_graphdef, params = init_model(  # created sharded
        config, mesh=self.mesh, param_dtype=config.model.dtype if self.lora else None)
    self.graphdef = self.engine_graphdef  # the trainer's model (with the adapters under model.lora)
    self.base, self.base_record, self._merged = None, None, (None, None)
    if self.lora:
      self.graphdef, adapters = build.init_adapters(config, mesh=self.mesh)
    self.optimizer = make_optimizer(config.train, config.train.steps)
    sampling = SamplingParams.from_config(config.sampling)  # the engine's and the trainer's
    replicas = make_replicas(config, self.model_cfg, self.engine_graphdef, sampling, engine_devices(config))
    self.sampler = make_sampler(config, replicas, task, tokenizer)
    self.source = SOURCES[config.rl.mode](self, workdir)  # offline: may refuse its file here
    self.train_step = make_train_step(config, self.graphdef, self.optimizer, sampling, self.mesh)
    self.buffer = GroupBuffer(config.rl.group_size)
    self.counters = Counters()
    # for the step's throughput and MFU (oapl_jax/timing.py)
    self.engine_device_count = max(distributed.total(len(engine_devices(config))), 1)
    self.useful_flops = None  # (tokens, pairs) -> a step's useful FLOPs (aot.model_flops): set by train.py; None: no MFU
    self.peak_flops, self.peak_source = timing.device_peak(self.mesh.devices.flat[0], config.log.peak_flops)
    if self.lora:  # a base the warm-up will train is quantised after it (model.base_quant)
      self.set_base(params, quantize=not config.warmup.steps)
      params = adapters
    self.start_from(params)
    self.ckpt = Checkpointer(checkpoint.directory_of(config, workdir), keep=config.checkpoint.keep)

  def set_base(self, params, quantize: bool = True) -> None:
    """model.lora: the frozen base <- `params` in model.dtype (the trainer's shardings; as
    model.base_quant says unless `quantize` is False), and the record a checkpoint is checked
    against: model.path and the weights' sha256."""
    self.base = self.train_step.base_of(params, quantize)
    self.base_record = checkpoint.base_record(self.config, self.base)
    self._merged = (None, None)

  def warm_up(self) -> dict:
    """The supervised warm-up (`warmup.base_model`, cached) of what this run starts from:
    pi_theta, or under model.lora the frozen base. Returns its info."""
    args = (self.sampler.task, self.sampler.tokenizer)
    if self.lora is None:
      self.params, info = warmup.base_model(self.config, self.graphdef, self.params, *args,
                                            seq_len=seq_len(self.config))
    else:
      base, info = warmup.base_model(self.config, self.engine_graphdef, self.base, *args,
                                     seq_len=seq_len(self.config))
      self.set_base(base)
    return info

  def start_from(self, params) -> None:
    """pi_theta <- `params` (placed in the trainer's shardings, in model.param_dtype), a fresh
    optimizer state, pi_old <- a model.dtype copy, and the GRPO reference <- a copy."""
    self.params = self.train_step.place_params(params)  # pi_theta: master weights
    self.opt_state = self.train_step.init_opt_state(self.params)
    self.snapshot = self.train_step.snapshot_of(self.params)  # pi_old, the engines' weights
    self.reference = (self.train_step.place_params(self.params) if uses_reference(self.config)
                      else None)  # frozen: the RL start

  # checkpoints
  def model_meta(self) -> dict:
    """What a checkpoint is checked against: the architecture; with model.lora, the adapters'
    settings and the base's record too (a checkpoint of adapters on another base is refused)."""
    if self.lora is None:
      return self.model_cfg.architecture()
    return {**self.model_cfg.architecture(), "lora": self.lora.record(), "base": self.base_record}

  def _trees(self) -> dict:
    """The device pytrees of the run state, by checkpoint name."""
    trees = {"params": self.params, "opt_state": self.opt_state, "snapshot": self.snapshot}
    if self.reference is not None:
      trees["reference"] = self.reference
    return trees

  def save(self, wait: bool = True) -> None:
    """Checkpoints the run; a rollout in flight is waited for and saved with it. `wait=False`:
    the files are written in the background (`Checkpointer.save`; `close` waits for them)."""
    check_all_finite({k: v for k, v in self._trees().items() if k != "reference"})
    state = {**self._trees(), "buffer": self.buffer.state()}
    meta = {"counters": dataclasses.asdict(self.counters), "model": self.model_meta()}
    pending = self.source.pending()
    if pending is not None:
      state["inflight"], meta["inflight_tokens"] = pending.rows.as_dict(), pending.answer_tokens
    self.ckpt.save(self.counters.step, state, meta, wait=wait)
    self.source.saved()

  def restore_latest(self) -> bool:
    """Restores the newest checkpoint that loads and verifies (damaged ones are skipped with a
    warning); False if there is none. Raises checkpoint.CheckpointError if all are damaged."""
    found = self.ckpt.restore_latest(self._trees(), self.model_meta(), tidy=True)
    if found is None:
      return False
    _, state, meta = found
    self.params, self.opt_state, self.snapshot = state["params"], state["opt_state"], state["snapshot"]
    self.reference = state.get("reference")
    self.buffer.load(state["buffer"])
    self.counters = Counters(**meta["counters"])
    inflight = state.get("inflight")
    self.source.resume(Drawn(Rows.from_dict(inflight), meta["inflight_tokens"]) if inflight else None)
    return True

  # the loop
  def engine_weights(self) -> list:
    """The snapshot on every engine's device, stamped with the version (placed once per snapshot)."""
    return self.sampler.load(self.engine_snapshot(), self.counters.version)

  def release_engine_weights(self) -> None:
    """Lets go of the engines' copy of pi_old and, under model.lora.merge="kept", the merged
    weights (sampling.release_weights): remade, the same, for the next rollout."""
    self.sampler.release()
    self._merged = (None, None)

  def engine_snapshot(self):
    """pi_old as the engines load it: the snapshot, or under model.lora the base merged with
    the snapshot's adapters (merged once per snapshot). model.lora.merge="in_refresh": no
    merged copy, a `layout.MergeOnLoad` of the base and the snapshot, which the engines'
    refresh merges layer by layer (the same weights bit for bit)."""
    if self.lora is None:
      return self.snapshot
    if self._merged[0] is not self.snapshot:
      self._merged = (self.snapshot, self._merge(self.snapshot))
    return self._merged[1]

  def _merge(self, adapters):
    """The base merged with `adapters` as the engines load it (model.lora.merge)."""
    if self.config.model.lora.get("merge", "kept") == "in_refresh":
      return MergeOnLoad(self.base, adapters, self.lora.scale)
    return self.train_step.merged(adapters, self.base)

  def _next_job(self, count: int = 1):
    """Fixes the next `count` rollouts, numbers `counters.rollouts` on (the engines' current
    snapshot and its stamps), as one job that samples them together."""
    c = self.counters
    job = functools.partial(draw_rollouts, self.config, self.sampler, self.engine_weights(),
                            indices=list(range(c.rollouts, c.rollouts + count)), version=c.version,
                            snapshot_step=c.snapshot_step)
    c.rollouts += count
    return job

  def wait(self) -> None:
    """Waits for the rollout in flight, if any (before the engines sample anything else)."""
    self.source.wait()

  def close(self) -> None:
    """Waits for the rollout in flight and stops the rollout thread (async mode), and for the
    checkpoint being written."""
    self.source.close()
    self.ckpt.wait()

  def refresh_engine(self) -> None:
    """pi_old <- pi_theta; version += 1.

    Sync mode empties the buffer (Algorithm 1: each window trains on its own pi_old's groups).
    Async mode drops nothing: left-over groups of the previous pi_old are used next, like the
    rollout in flight, with their own stamps (docs/design.md "Asynchronous mode": stale samples are used), unless their
    realised lag exceeds `rl.max_lag`.
    """
    self.snapshot = self.train_step.snapshot_of(self.params)
    self.counters.version += 1
    self.counters.snapshot_step = self.counters.step
    if self.source.empties_buffer_at_refresh:
      self.counters.groups_dropped += distributed.total(self.buffer.clear())

  def _drop_stale(self) -> None:
    """Drops buffered groups whose realised lag at this step would exceed `rl.max_lag`."""
    max_lag = self.config.rl.max_lag
    if max_lag is not None:
      self.counters.groups_dropped_stale += distributed.total(
          self.buffer.drop_older_than(self.counters.step - max_lag))

  def _fill_buffer(self) -> dict:
    """Takes rollouts until the buffer holds a step's groups; returns what they took: answer
    tokens and slot-steps (over all processes), this process's sampling and reward seconds."""
    taken = dict.fromkeys(("answer_tokens", "live_slot_steps", "slot_steps"), 0)
    taken |= dict.fromkeys(("seconds_sampling", "seconds_rewards"), 0.0)
    self._drop_stale()
    while len(self.buffer) < self.groups_per_step:
      drawn = self.source.next(self._next_job)
      self.buffer.extend(drawn.rows)
      counts = ("answer_tokens", "live_slot_steps", "slot_steps")
      samples, *summed = distributed.totals(drawn.samples, *(getattr(drawn, k) for k in counts))
      self.counters.samples_generated += samples
      for k, n in zip(counts, summed):
        taken[k] += n
      taken["seconds_sampling"] += drawn.seconds_sampling
      taken["seconds_rewards"] += drawn.seconds_rewards
      for k, n in (drawn.env_metrics or {}).items():  # this process's episodes
        taken.setdefault("env", {})[k] = taken.get("env", {}).get(k, 0) + n
      self._drop_stale()  # a rollout that was in flight may land already too old
    return taken

  def _global_rows(self, *arrays) -> list[np.ndarray]:
    """Per-row arrays of this step's batch over all processes, in the order a single process
    with all the replicas holds them (`parallel.global_row_order`); one process: as given."""
    out = distributed.concat_rows(*arrays)
    if jax.process_count() == 1:
      return out
    order = global_row_order(self.groups_per_step, self.config.rl.group_size, jax.process_count(),
                             placement.local_engines(self.config, jax.process_count()))
    return [x[order] for x in out]

  def step(self) -> dict:
    """One trainer step (sampling first if the buffer runs short). Returns its metrics."""
    c, rl = self.counters, self.config.rl
    t0 = time.perf_counter()
    taken = self._fill_buffer()
    answer_tokens = taken["answer_tokens"]
    t1 = time.perf_counter()
    wait_seconds = t1 - t0  # with overlapped sampling: only the wait for it
    rows = self.buffer.take(self.groups_per_step)
    lags = c.step - rows.snapshot_step
    batch, layout = self.train_step.batch_of(rows)
    cost = self.train_step.cost_of(batch)  # what the step computes ({}: the padded step's fixed figures)
    self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, self.snapshot,
                                                     batch, self.reference, self.base)
    m = {**jax.device_get(m), **layout}
    t2 = time.perf_counter()
    c.step += 1
    c.steps_skipped += bool(m["step_skipped"])
    c.nonfinite_in_a_row = c.nonfinite_in_a_row + 1 if m["step_skipped"] else 0
    elapsed = time.perf_counter() - t0
    c.train_seconds += elapsed
    rewards, answer_lengths, lags = self._global_rows(rows.rewards, rows.answer_lengths, lags)
    metrics = {**m, "reward_mean": float(rewards.mean()),
               "answer_length": float(answer_lengths.mean()),
               "lag_mean": float(lags.mean()), "lag_hist": lag_histogram(lags),
               "policy_version": c.version, "rollouts": c.rollouts, "samples_generated": c.samples_generated,
               "groups_dropped": c.groups_dropped, "groups_dropped_stale": c.groups_dropped_stale,
               "steps_skipped": c.steps_skipped,
               "train_seconds": c.train_seconds}
    if answer_tokens:
      metrics["sample_wait_seconds"] = wait_seconds
      if not placement.overlaps_training(self.config):  # overlapped sampling: no rate from the wait
        metrics["sample_tokens_per_s"] = answer_tokens / max(wait_seconds, 1e-9)
    if "env" in taken:  # multi-turn: the episodes sampled for this step, over all processes
      names = sorted(taken["env"])  # the same counters in every process (EpisodeTurns.metrics)
      env = dict(zip(names, distributed.totals(*(taken["env"][k] for k in names))))
      metrics |= {f"env_{k}": v for k, v in env.items()}
      metrics["tool_call_rate"] = env["episodes_calling"] / max(env["episodes"], 1)
    if lags.max() == 0:  # pi_theta == pi_old at this step: the engine/trainer mismatch
      metrics["engine_mismatch_abs"] = m["trainer_vs_sampler_abs"]
    t3 = time.perf_counter()
    if self.source.refresh_due(c.step, rl.lag):  # every rl.lag steps; offline: each round's end
      self.refresh_engine()
    t4 = time.perf_counter()
    # where the time went (oapl_jax/timing.py); train.py adds evaluating and saving
    metrics |= {"seconds_waiting": wait_seconds, "seconds_training": t2 - t1,
                "seconds_refreshing": t4 - t3, "step_seconds": t4 - t0,
                "seconds_sampling": taken["seconds_sampling"], "seconds_rewards": taken["seconds_rewards"]}
    metrics |= timing.rollout_rates(answer_tokens=answer_tokens, seconds_sampling=taken["seconds_sampling"],
                                    engine_devices=self.engine_device_count, live_slot_steps=taken["live_slot_steps"],
                                    slot_steps=taken["slot_steps"])
    positions = cost.get("tokens", self.groups_per_step * jax.process_count() * rl.group_size
                         * (seq_len(self.config) - 1))
    metrics |= timing.train_rates(positions=positions, seconds_training=t2 - t1,
                                  devices=self.mesh.devices.size,
                                  useful_flops=self.useful_flops(**cost) if self.useful_flops else 0.0,
                                  peak_flops=self.peak_flops)
    return metrics

  # looking at the policy
  def sample_answers(self, *, num_problems: int = 4, n: int = 4, params=None, seed: int = 0) -> list[dict]:
    """`n` decoded answers to each of the first held-out problems, with their rewards.

    params: default pi_theta. Returns [{"prompt": str, "answers": [str], "rewards": [float]}].
    """
    self.wait()
    problems = self.sampler.task.eval_problems()[:num_problems]
    weights = self.engine_copy(self.params if params is None else params)
    scored = self.sampler.sample(weights, problems, group_size=n, key=jax.random.key(seed))
    texts = self.sampler.decode(scored.rollout)
    return [{"prompt": p.prompt, "answers": texts[j * n:(j + 1) * n],
             "rewards": [float(r) for r in scored.rewards[j * n:(j + 1) * n]]}
            for j, p in enumerate(problems)]

  def engine_copy(self, params):
    """`params` as the engines compute with them: cast to model.dtype (pi_theta's master
    weights are model.param_dtype); under model.lora, the adapters merged into the base (or,
    model.lora.merge="in_refresh", a `layout.MergeOnLoad` the engines merge as they load it)."""
    if self.lora is not None:
      return self._merge(params)
    if all(x.dtype == self.train_step.dtype for x in jax.tree.leaves(params)):
      return params
    return self.train_step.snapshot_of(params)

  def evaluate(self, params, tag: str) -> dict:
    """pass@k of `params` on the held-out problems (the same draws at every call), printed."""
    self.wait()
    t0 = time.perf_counter()
    out = evaluate(self.sampler, self.engine_copy(params),
                   samples_per_problem=self.config.eval.samples_per_problem, key=eval_key(self.config.seed))
    tools = f", tool_call_rate={out['tool_call_rate']:.3f}" if "tool_call_rate" in out else ""  # multi-turn
    say(f"eval {tag}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items() if k.startswith("pass@"))
        + f"{tools} ({time.perf_counter() - t0:.1f}s)")
    return out
