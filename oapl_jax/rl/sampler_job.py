"""A sampler job of remote mode (`python -m oapl_jax.sample`): samples rollouts for a trainer
with the pi_old it publishes, into the workdir they share (oapl_jax/rl/remote.py has the files
and the protocol).

`serve` runs until the trainer marks its run done (or `max_rollouts` are written, or nothing
was there to do for `max_idle_s`): it looks at the trainer's status, claims the next rollout
that needs sampling, loads the snapshot it is to be sampled with (the newest; in reproducible
mode version index // rl.lag), samples it with the engines on this job's devices at full
slots, and writes it whole. A damaged snapshot is never loaded: one line, and the job keeps the
snapshot it holds (in reproducible mode, where no other will do, it waits).

Under model.lora a snapshot is the adapters alone: the job builds the frozen base once, as the
trainer does (`policies.frozen_base`: model.path or the seed's init, warmed up, from the warm-up
cache when it is there), refuses snapshots of another base (`remote.OtherBase`: one line, the job
stops) and merges each new version's adapters into it (`lora.merged`) before sampling.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from oapl_jax import checkpoint, storage
from oapl_jax.errors import UserError
from oapl_jax.metrics import say
from oapl_jax.models import build
from oapl_jax.models import lora as lora_lib
from oapl_jax.models.build import abstract_model
from oapl_jax.policies import frozen_base
from oapl_jax.rl import offline, remote
from oapl_jax.rl.loop import rollout_problems
from oapl_jax.sampling import SamplingParams
from oapl_jax.sampling.sampler import make_replicas, make_sampler
from oapl_jax.tasks import make_task
from oapl_jax.workdir import Layout


@dataclasses.dataclass
class Loaded:
  version: int
  snapshot_step: int
  weights: list  # in the engines' layout (`Sampler.load`)


class SamplerJob:
  """One sampler job's engines, its claims and the snapshot it holds."""

  def __init__(self, config, workdir: str):
    self.config, self.rc = config, config.rl.remote
    self.workdir, self.root = workdir, Layout(workdir).remote
    self.task, tokenizer = make_task(config)
    self.model_cfg, graphdef, self.abstract = abstract_model(config, dtype=jnp.dtype(config.model.dtype))
    self.meta = self.model_cfg.architecture()
    self.settings = remote.served_settings(config, self.meta)
    remote.check_serves(self.root, self.settings, remote.read_status(self.root))  # before the engines are built
    self.lora, self.base = build.lora_of(config), None
    if self.lora is not None:  # snapshots are adapters: the base, once, and what they are checked against
      self.base, self.meta, self.abstract = self._lora_base()
      self._merge = jax.jit(lambda base, adapters: lora_lib.merged(base, adapters, self.lora.scale))
    replicas = make_replicas(config, self.model_cfg, graphdef, SamplingParams.from_config(config.sampling))
    self.sampler = make_sampler(config, replicas, self.task, tokenizer)
    self.owner = remote.owner_id()
    self.loaded: Loaded | None = None
    self.damaged: set[int] = set()  # versions whose file failed its checks
    self._said: set = set()
    self.full = False  # every rollout this job may sample is written or claimed (`_pick`)

  def _lora_base(self):
    """model.lora: (the frozen base, the model meta snapshots must carry: the adapters' settings
    and the base's {path, sha256}, as the trainer's `Run.model_meta`; the adapters' abstract in
    model.dtype, the snapshot's)."""
    config = self.config
    t0 = time.perf_counter()
    _, base = frozen_base(config)
    record = checkpoint.base_record(config, base)
    say(f"sampler: frozen base built in {time.perf_counter() - t0:.1f}s (model.path={config.model.path!r}, "
        f"sha256 {record['sha256'][:16]}...); snapshots are adapters merged into it")
    meta = {**self.meta, "lora": self.lora.record(), "base": record}
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(config.model.dtype), sharding=device),
                            build.lora_abstract(config)[1])
    return base, meta, abstract

  def _once(self, key, text: str) -> None:
    if key not in self._said:
      self._said.add(key)
      say(text)

  def _pick(self, first: int, versions: list[int]) -> tuple[int, int] | None:
    """(rollout index, snapshot version) claimed for sampling now, or None. `self.full`: whether
    every rollout it may sample (rl.remote.ahead from the trainer's next) is written or claimed."""
    rc = self.rc
    self.full, taken = False, 0
    for index in range(first, first + rc.ahead):
      if storage.exists(remote.rollout_path(self.root, index)) or remote.claimed(self.root, index, rc.claim_timeout_s):
        taken += 1
        self.full = taken == rc.ahead
        continue
      if rc.reproducible:
        version = remote.version_of(index, self.config.rl.lag)
        if version not in versions:  # not published yet (or damaged: no other will do)
          return None
      else:
        version = max(versions)
      if remote.claim(self.root, index, self.owner, rc.claim_timeout_s):
        return index, version
    return None

  def _load(self, version: int) -> bool:
    """Holds snapshot `version` (loaded on the engines); False, with one line, if it is damaged."""
    if self.loaded is not None and self.loaded.version == version:
      return True
    t0 = time.perf_counter()
    try:  # another base (model.lora) is `remote.OtherBase`: not caught, the job stops
      params, header = remote.read_snapshot(remote.snapshot_path(self.root, version), self.abstract, self.meta)
    except remote.SnapshotError as e:
      self.damaged.add(version)
      keep = f"keeping version {self.loaded.version}" if self.loaded else "no snapshot held yet"
      say(f"sampler: {e}; {keep}")
      return False
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    params = jax.device_put(params)
    if self.base is not None:  # the adapters into the base: the weights the trainer's engines sample
      params = jax.block_until_ready(self._merge(self.base, params))
    seconds = time.perf_counter() - t0
    self.loaded = Loaded(version, int(header["snapshot_step"]), self.sampler.load(params, version))
    what = "adapters, read and merged" if self.base is not None else "read"
    say(f"sampler: loaded pi_old version {version} (trainer step {header['snapshot_step']}): "
        f"{size / 2**20:.2f} MiB of {what} in {seconds:.2f}s")
    return True

  def sample(self, index: int) -> dict:
    """Samples rollout `index` with the held snapshot and writes its file (its claim is the
    caller's: `serve` holds it)."""
    config, held = self.config, self.loaded
    t0 = time.perf_counter()
    problems, keys = rollout_problems(config, self.task, [index])
    scored = self.sampler.sample(held.weights, problems, group_size=config.rl.group_size, key=keys)
    header = {**offline.expected_header(config, self.meta), "rollout": index, "seed": int(config.seed),
              "policy": {"version": held.version, "snapshot_step": held.snapshot_step,
                         "source": f"sampler job {self.owner}"},
              "problems": [dataclasses.asdict(p) for p in problems]}
    offline.write(remote.rollout_path(self.root, index), header, offline.arrays_of(scored.rollout, scored.rewards))
    return {"rollout": index, "version": held.version, "reward_mean": float(scored.rewards.mean()),
            "answer_tokens": int(scored.rollout.lengths.sum()), "seconds": time.perf_counter() - t0}

  def _run_over(self, status: dict | None) -> bool:
    """Whether the trainer's run is done for this job: `done`, unless this job's train.steps is
    beyond the steps the trainer ended at (a finished run being extended: its resumed trainer
    clears `done` when it starts; until then this job waits for it)."""
    if status is None or not status.get("done"):
      return False
    ended_at = int(status.get("steps", status.get("step", 0)))
    if self.config.train.steps <= ended_at:
      return True
    self._once(("extend", ended_at), f"sampler: the trainer's run ended at train.steps={ended_at}; this job's "
               f"train.steps={self.config.train.steps}: waiting for the trainer to resume and extend it")
    return False

  def _trainer_seen(self, status: dict | None) -> bool:
    """Whether a trainer ever ran in this workdir: its status, its lock or a snapshot."""
    return (status is not None or storage.exists(Layout(self.workdir).lock)
            or bool(remote.published_versions(self.root)))

  def serve(self, *, max_rollouts: int | None = None, max_idle_s: float = 3600.0,
            wait_for_trainer_s: float = 600.0) -> dict:
    """Samples rollouts until the run is done; returns what this job wrote. `NoTrainer` (one
    line) if no trainer has started in the workdir within `wait_for_trainer_s` (said at once)."""
    written, tokens, idle_since = [], 0, time.perf_counter()
    started, seen = time.perf_counter(), False
    why = "the trainer marked its run done"
    while True:
      status = remote.read_status(self.root)
      remote.check_serves(self.root, self.settings, status)  # a trainer resumed with other settings too
      if not seen and not (seen := self._trainer_seen(status)):
        if time.perf_counter() - started > wait_for_trainer_s:
          raise NoTrainer(f"no trainer in --workdir={self.workdir} after {wait_for_trainer_s:.0f}s "
                          "(no run.lock, remote/trainer.json or snapshot; --wait_for_trainer_s): give the "
                          "trainer's --workdir, and start the trainer")
        self._once("no trainer", f"sampler: no trainer in --workdir={self.workdir} yet (no run.lock, "
                   f"remote/trainer.json or snapshot): waiting up to {wait_for_trainer_s:.0f}s for one to start "
                   "(--wait_for_trainer_s)")
        time.sleep(self.rc.poll_s)
        continue
      if self._run_over(status):
        break
      if max_rollouts is not None and len(written) >= max_rollouts:
        why = f"{max_rollouts} rollouts written (--max_rollouts)"
        break
      if time.perf_counter() - idle_since > max_idle_s:
        why = f"nothing to sample for {max_idle_s:.0f}s (--max_idle_s): is the trainer running?"
        break
      versions = [v for v in remote.published_versions(self.root) if v not in self.damaged]
      if self.loaded is not None and self.loaded.version not in versions:
        versions.append(self.loaded.version)  # held in memory: usable though its file is gone or damaged
      first = status["next_rollout"] if status else 0
      picked = self._pick(first, versions) if versions else None
      if not versions:
        self._once("first", f"sampler: waiting for the trainer's first snapshot in {self.root}")
      if picked is None:
        if versions and self.full:  # healthy, ahead of the trainer: said once, so silence is not a hang
          self._once("ahead", f"sampler: rollouts {first}-{first + self.rc.ahead - 1} are all written or being "
                     f"sampled (rl.remote.ahead={self.rc.ahead}): waiting for the trainer to take them "
                     "(said once; the samplers are ahead of the trainer)")
        time.sleep(self.rc.poll_s)
        continue
      index, version = picked
      # the claim renewed while the snapshot loads and the rollout samples, and released however
      # this ends (written, an error, SIGTERM, Ctrl-C): a stopping sampler gives it back at once
      with remote.holding(self.root, index, self.owner, self.rc.claim_timeout_s):
        out = self.sample(index) if self._load(version) else None
      if out is None:
        continue
      written.append(index)
      tokens += out["answer_tokens"]
      idle_since = time.perf_counter()
      say(f"sampler: rollout {index} (version {version}): reward mean {out['reward_mean']:.3f}, "
          f"{out['answer_tokens']} answer tokens in {out['seconds']:.1f}s")
    say(f"sampler: stopping: {why}")
    return {"rollouts": written, "answer_tokens": tokens, "stopped": why}


class NoTrainer(UserError):
  """A sampler job on a workdir where no trainer has started."""
