"""Where a run's training rollouts come from, chosen once from `rl.mode` (`SOURCES`).

A source hands the loop its next rollout (`next`), given `make_job`: a function that fixes the
next rollouts' indices (`make_job(count)`: `count` of them, default one), weights and stamps at
the moment it is called (so the loop decides what is sampled and when) and returns the job
that samples them, together. Sources differ in when jobs run:

* `SyncSource` ("sync"): the job runs here and now, while the trainer waits; with
  `rl.window_rollouts` = k > 1 it samples k steps' rollouts in one continuous batch (slots
  refilled as answers end, across the k steps' problems) and the buffer holds the rest on the
  host for the next k - 1 steps. Every rollout's rows are what k = 1 samples (`draw_rollouts`).
* `AsyncSource` ("async"): the job for the next rollout is launched the moment the previous
  one is taken, and samples in a background thread while the trainer trains; a checkpoint
  holds it (`pending`, `resume`).
* `OfflineSource` ("offline"): rounds of stored answers (`rl.offline`), each file sampled once
  by pi_old and trained on for several epochs (`rl.offline`'s module docstring), then sync.
* `RemoteSource` ("remote"): rollout files written by sampler jobs beside the trainer
  (`python -m oapl_jax.sample`; oapl_jax/rl/remote.py), taken in order, each once.

Each source is made as `SOURCES[mode](run, workdir)` and says when the engines' snapshot is
refreshed (`refresh_due`): every `rl.lag` steps online, at the end of each round offline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from concurrent import futures
from typing import Callable

import jax
import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax import checkpoint, distributed, placement, storage
from oapl_jax.metrics import say
from oapl_jax.placement import seq_len
from oapl_jax.rl import offline, remote
from oapl_jax.rl.buffer import Rows, stamp
from oapl_jax.sampling.parallel import process_share
from oapl_jax.workdir import Interrupted, Layout


@dataclasses.dataclass
class Drawn:
  """One rollout's training rows, stamped with the weights that sampled them (`buffer.stamp`)."""

  rows: Rows
  answer_tokens: int  # answer tokens generated for it
  samples: int | None = None  # answers generated for it; None = one per row (stored answers: 0)
  # how it was made (oapl_jax/timing.py): the engines' and the rewards' seconds, slot-steps
  seconds_sampling: float = 0.0
  seconds_rewards: float = 0.0
  live_slot_steps: int = 0
  slot_steps: int = 0
  env_metrics: dict | None = None  # multi-turn: the episodes' outcomes (`EpisodeTurns.metrics`)

  def __post_init__(self):
    if self.samples is None:
      self.samples = len(self.rows)


Job = Callable[[], Drawn]
MakeJob = Callable[..., Job]  # make_job(count=1): the job of the next `count` rollouts


class SyncSource:
  """Samples when the loop asks, while the trainer waits: the rollouts up to the end of the
  current window of `rl.window_rollouts` (k) rollouts, in one call.

  Rollout i is step i's (sync mode checks groups_per_rollout == groups_per_step when k > 1, and
  that k divides rl.lag, so a window never spans a refresh and every rollout of it is sampled
  by the pi_old that k = 1 would use). A run resumed inside a window (its checkpoint holds the
  buffer with the window's rest) carries on as it was; a run on a checkpoint written without
  the rest draws only to the window's end.
  """

  empties_buffer_at_refresh = True  # Algorithm 1: each window trains on its own pi_old's groups

  def __init__(self, run, workdir: str | None = None):
    del workdir  # samples through the loop's jobs only
    self._run = run
    self.window = run.config.rl.window_rollouts

  def refresh_due(self, step: int, lag: int) -> bool:
    """Whether pi_old <- pi_theta after trainer step `step` (steps taken): every rl.lag steps."""
    return step % lag == 0

  def next(self, make_job: MakeJob) -> Drawn:
    drawn = make_job(self.window - self._run.counters.rollouts % self.window)()
    if self._run.config.sampling.get("release_weights", False):
      self._run.release_engine_weights()  # none held while the trainer steps
    return drawn

  def pending(self) -> Drawn | None:
    """The rollout in flight (waited for), for checkpoints; sync mode has none."""
    return None

  def resume(self, drawn: Drawn | None) -> None:
    if drawn is not None:
      raise ValueError(f"a {self._run.config.rl.mode} run has no rollout in flight to resume")

  def saved(self) -> None:
    """After each checkpoint (remote mode removes the rollout files it is done with)."""

  def wait(self) -> None:
    """Waits for the rollout in flight, if any (before the engines sample anything else)."""

  def close(self) -> None:
    pass


class AsyncSource:
  """Samples the next rollout in a background thread while the trainer trains (on devices of
  its own: `placement.OVERLAPPING_MODES`)."""

  empties_buffer_at_refresh = False  # stale groups are used (docs/design.md "Asynchronous mode"), unless rl.max_lag drops them

  def __init__(self, run=None, workdir: str | None = None):
    del run, workdir
    self._pool = futures.ThreadPoolExecutor(1, "rollout")
    self._inflight: futures.Future | None = None  # launched and not yet taken

  refresh_due = SyncSource.refresh_due

  def next(self, make_job: MakeJob) -> Drawn:
    # The next rollout starts now, with the weights of this moment (a fixed point of the step
    # sequence, so runs stay reproducible); it lands at a later step, maybe after a refresh,
    # and is used then with its own stamps.
    drawn = (self._inflight or self._pool.submit(make_job())).result()
    self._inflight = self._pool.submit(make_job())
    return drawn

  def pending(self) -> Drawn | None:
    return None if self._inflight is None else self._inflight.result()

  saved = SyncSource.saved

  def resume(self, drawn: Drawn | None) -> None:
    self._inflight = None
    if drawn is not None:
      self._inflight = futures.Future()
      self._inflight.set_result(drawn)

  def wait(self) -> None:
    if self._inflight is not None:
      self._inflight.result()

  def close(self) -> None:
    """Waits for the rollout in flight and stops the thread."""
    self.wait()
    self._pool.shutdown()


class OfflineSource:
  """Rounds of stored answers, then online (sync) for the rest of the run (`rl.offline`).

  Offline step s trains on the groups `offline.Schedule.batch` names in round s // round_steps's
  file (read, or sampled by pi_old and written, at the round's first step, and checked against
  pi_old: `offline.check_logprobs`); positions are functions of (seed, step), so a resumed run
  reads the same batches and there is no state to checkpoint. From step `schedule.steps` on,
  rollouts come from a `SyncSource`.
  """

  empties_buffer_at_refresh = True  # a round's batches are whole steps: nothing is left over

  def __init__(self, run, workdir: str):
    self._run, self._dir = run, Layout(workdir).offline
    self._online = SyncSource(run)  # rl.window_rollouts is 1 outside sync mode (config.validate)
    config = run.config
    off = config.rl.offline
    if jax.process_count() > 1:
      raise ConfigError(f"config.rl.mode='offline': runs in one process (this is one of "
                        f"{jax.process_count()}): its round files are read and written unguarded")
    self._first = None
    if off.path is not None:  # refused now, before any warm-up, if it is not this run's
      self._first = offline.read(off.path)
      offline.check_matches(self._first, config, run.model_cfg.architecture())
      offline.check_problems(self._first, run.sampler.tokenizer)
      if offline.SPAN_ARRAY in self._first.arrays and off.rounds > 1 and config.env.name is None:
        raise ConfigError(f"config.rl.offline.rounds={off.rounds}: {off.path} holds multi-turn "
                          "trajectories (imported traces), and a later round would be sampled by "
                          "the run as single answers (config.env.name is None); use 1, or set the "
                          "environment that later rounds are sampled in (docs/agents.md)")
    groups = self._first.groups if self._first else off.problems
    if groups < config.rl.groups_per_step:
      raise ConfigError(f"config.rl.groups_per_step={config.rl.groups_per_step}: more than the "
                        f"{groups} groups of a round's file ({off.path or 'rl.offline.problems'})")
    self.schedule = offline.Schedule(groups, config.rl.groups_per_step, off.epochs, off.rounds)
    if config.rl.max_lag is not None and config.rl.max_lag < self.schedule.round_steps - 1:
      raise ConfigError(f"config.rl.max_lag={config.rl.max_lag}: an offline round trains "
                        f"{self.schedule.round_steps} steps on one pi_old's answers (lags up to "
                        f"{self.schedule.round_steps - 1}); use None or at least that")
    self._loaded: tuple[int, offline.OfflineData] | None = None  # (round index, its file)
    self._recompute = None

  def refresh_due(self, step: int, lag: int) -> bool:
    """At the end of each round; after the rounds, every rl.lag steps."""
    sched = self.schedule
    if step <= sched.steps:
      return step % sched.round_steps == 0
    return (step - sched.steps) % lag == 0

  def next(self, make_job: MakeJob) -> Drawn:
    run = self._run
    c, config = run.counters, run.config
    if c.step >= self.schedule.steps:
      return self._online.next(make_job)
    round_index, groups = self.schedule.batch(config.seed, c.step)
    data = self._round(round_index)
    # A file this run sampled counts as generated at its round's first step, whether it was
    # sampled now or before a kill and read back (the checkpoint's counters decide, once).
    ours = os.path.abspath(os.path.dirname(data.path)) == os.path.abspath(self._dir)
    first = c.step % self.schedule.round_steps == 0
    tokens, samples = ((len(data.arrays["answer_tokens"]), len(data.arrays["rewards"]))
                       if ours and first else (0, 0))
    rows = data.rows(groups, seq_len=seq_len(config), pad_id=run.sampler.tokenizer.pad_id,
                     count_truncated=config.rl.count_truncated)
    # Checked to be pi_old's samples: stamped as the engines' snapshot of this round's start.
    rows = dataclasses.replace(rows, version=np.full(len(rows), c.version, np.int32),
                               snapshot_step=np.full(len(rows), c.snapshot_step, np.int32))
    return Drawn(rows, tokens, samples)

  def _round(self, round_index: int) -> offline.OfflineData:
    """The file of round `round_index` (0-based), checked against pi_old (sampled into the
    workdir's offline/ folder first if it is not there)."""
    if self._loaded is not None and self._loaded[0] == round_index:
      return self._loaded[1]
    run, config = self._run, self._run.config
    if round_index == 0 and self._first is not None:
      data = self._first
    else:
      path = os.path.join(self._dir, f"round_{round_index + 1}.npz")
      if not os.path.exists(path):
        self._sample(round_index, path)
      data = offline.read(path)
    offline.check_matches(data, config, run.model_cfg.architecture())
    offline.check_problems(data, run.sampler.tokenizer)
    if self._recompute is None:  # the engines' model (without adapters): pi_old's full weights
      self._recompute = offline.logprob_fn(config, run.engine_graphdef, run.mesh)
    pi_old = self._pi_old()
    if not data.has_logprobs:  # imported traces without the sampler's log-probs (docs/agents.md)
      tokens = offline.fill_logprobs(data, self._recompute, pi_old, seq_len=seq_len(config),
                                     pad_id=run.sampler.tokenizer.pad_id)
      say(f"offline round {round_index + 1}: {data.groups} groups from {data.path} "
          f"({data.header['policy'].get('source')}, stored without log-probs: pi_old is "
          f"this run's pi_old (version {run.counters.version}: the base in round 1) rescoring the "
          f"{tokens} model tokens)")
      self._loaded = (round_index, data)
      return data
    gap = offline.check_logprobs(data, config, self._recompute, pi_old,
                                 seq_len=seq_len(config), pad_id=run.sampler.tokenizer.pad_id,
                                 what=f"this run's pi_old (version {run.counters.version})")
    say(f"offline round {round_index + 1}: {data.groups} groups from {data.path} "
        f"(sampler: {data.header['policy'].get('source')}; log-prob check {gap:.2g}/token)")
    self._loaded = (round_index, data)
    return data

  def _pi_old(self):
    """pi_old's full weights, which round files are rescored with: the snapshot, or under
    model.lora the base merged with the snapshot's adapters (as the engines sample them)."""
    run = self._run
    return run.snapshot if run.lora is None else run.train_step.merged(run.snapshot, run.base)

  def _sample(self, round_index: int, path: str) -> None:
    """Samples round `round_index`'s file with pi_old into `path` (under model.lora its policy
    names the adapters, as `oapl_jax.generate` does)."""
    run, c = self._run, self._run.counters
    problems = (offline.round_one_problems(run.config, run.sampler.task) if round_index == 0
                else self._problems_of_round_one())
    policy = {"version": c.version, "snapshot_step": c.snapshot_step,
              "source": f"pi_old of the run in {os.path.dirname(self._dir)} at step {c.step}"}
    if run.lora is not None:
      policy["adapters"] = {**run.lora.record(), "sha256": checkpoint.tree_digest(run.snapshot),
                            "base": run.base_record}
    header, arrays, _ = offline.sample_round(
        run.config, run.sampler, run.engine_weights(), problems, round_index=round_index,
        policy=policy, model_meta=run.model_cfg.architecture())
    offline.write(path, header, arrays)

  def _problems_of_round_one(self):
    if self._first is not None:
      return self._first.problems
    return offline.read(os.path.join(self._dir, "round_1.npz")).problems

  def pending(self) -> Drawn | None:
    return self._online.pending()

  saved = SyncSource.saved

  def resume(self, drawn: Drawn | None) -> None:
    self._online.resume(drawn)

  def wait(self) -> None:
    self._online.wait()

  def close(self) -> None:
    self._online.close()


class RemoteSource:
  """Rollouts written by sampler jobs beside the trainer (`rl.remote`; oapl_jax/rl/remote.py
  has the protocol): publishes pi_old at each refresh, takes rollout files in index order,
  each once, and waits (saying so) while the next is not written.

  Free mode: a file is sampled by whichever snapshot its sampler held (the newest when it
  started), used with its own stamps, dropped and counted if older than `rl.max_lag` (as in
  async mode). `rl.remote.reproducible`: rollout i must be sampled by version i // rl.lag
  (one rollout per step), so the run is the sync run, bit for bit, whatever the samplers.

  A trainer of several processes: each reads every rollout file whole and trains on its share
  of the groups, those a sync run's engine replicas on this process would sample
  (`parallel.process_share`), so the step's global batch is the file's groups in order
  (`parallel.global_row_order`). Whether a file is there, reads and passes its checks is agreed
  over the processes (one collective) before any acts on it; process 0 alone writes (the
  snapshot, gathered from every process; the status; a set-aside file).
  """

  def __init__(self, run, workdir: str):
    config = run.config
    if run.lora is not None and jax.process_count() > 1:  # not built: refused before anything is published
      raise ConfigError(f"config.model.lora.rank={config.model.lora.rank}: remote mode publishes adapters for a "
                        f"trainer of one process only (this one has {jax.process_count()}): the base's sha256 that "
                        "sampler jobs check is taken over the processes' shards, which a sampler job cannot "
                        "reproduce (docs/remote.md)")
    self._run, self._rc = run, config.rl.remote
    self.root = Layout(workdir).remote
    self.empties_buffer_at_refresh = bool(self._rc.reproducible)
    self._writer = distributed.is_writer()
    n = jax.process_count()
    k = placement.local_engines(config, n) if n > 1 else 1
    self._mine = process_share(config.rl.groups_per_rollout, n * k, jax.process_index() * k, k)
    self._published: int | None = None
    self._saved_at = None  # counters.rollouts at the previous checkpoint: files below it are done with
    self._checked: set[tuple[str, int]] = set()  # (sampler, version) pairs whose log-probs were rescored
    self._rejected: dict[int, int] = {}  # rollout index -> files of it set aside
    self._recompute = None
    self._settings = remote.served_settings(config, run.model_cfg.architecture())
    self._signal: int | None = None  # a SIGTERM / SIGINT that came while waiting for a rollout
    self._announce()

  def _announce(self) -> None:
    """At the start (resumed or not), before any snapshot: the status names the settings a
    sampler job must share (samplers that differ are refused at their start) and this run's
    train.steps, and a `done` written by a finished run is cleared if this start extends it
    (train.steps raised): its sampler jobs must not read the old `done` and stop."""
    if not self._writer:
      return
    old = remote.read_status(self.root) or {"next_rollout": 0, "version": 0, "step": 0}
    done = bool(old.get("done")) and int(old.get("step", 0)) >= self._run.config.train.steps
    remote.write_status(self.root, {**old, "done": done, "steps": int(self._run.config.train.steps),
                                    "settings": self._settings, "reproducible": bool(self._rc.reproducible)})

  refresh_due = SyncSource.refresh_due

  def _publish(self) -> None:
    """Publishes the engines' snapshot (once per version) and removes the ones no sampler needs."""
    c = self._run.counters
    if self._published == c.version:
      return
    weights = distributed.fetch(self._run.snapshot)  # multi-host: a collective, whole on every process
    if self._writer:
      if c.version not in remote.published_versions(self.root):  # a resumed run may have published it
        remote.publish_snapshot(self.root, weights, version=c.version, snapshot_step=c.snapshot_step,
                                model_meta=self._run.model_meta())
      remote.remove_old_snapshots(self.root, c.version - self._rc.keep_snapshots + 1)
    self._published = c.version

  def _status(self, done: bool) -> None:
    c = self._run.counters
    if self._writer:
      remote.write_status(self.root, {"next_rollout": c.rollouts, "version": c.version, "step": c.step,
                                      "done": done, "reproducible": bool(self._rc.reproducible),
                                      "steps": int(self._run.config.train.steps), "settings": self._settings})

  def next(self, make_job: MakeJob) -> Drawn:
    del make_job  # sampled by the sampler jobs
    run, c, rc = self._run, self._run.counters, self._rc
    self._publish()
    self._status(done=False)
    index, path = c.rollouts, remote.rollout_path(self.root, c.rollouts)
    waited, said = time.perf_counter(), 0.0
    with self._noting_signals():
      while (data := self._take(index, path)) is None:
        if distributed.any_process(self._signal is not None):  # every process stops here, together
          self._stop_waiting(index)
        waiting = time.perf_counter() - waited
        if waiting >= said:
          why = remote.waiting_on(self.root, index, rc.claim_timeout_s) if self._writer else ""
          say(f"step {c.step + 1}: waiting for rollout {index} ({waiting:.0f}s): {why}")
          said = max(2 * said, rc.say_every_s)
        time.sleep(rc.poll_s)
    policy, g = data.header["policy"], data.group_size
    rows = data.rows(self._mine, seq_len=seq_len(run.config), pad_id=run.sampler.tokenizer.pad_id,
                     count_truncated=run.config.rl.count_truncated)
    offsets = data.arrays["answer_offsets"]
    answers = (self._mine[:, None] * g + np.arange(g)).ravel()
    c.rollouts += 1
    return Drawn(stamp(rows, version=int(policy["version"]), snapshot_step=int(policy["snapshot_step"])),
                 int((offsets[answers + 1] - offsets[answers]).sum()))

  @contextlib.contextmanager
  def _noting_signals(self):
    """While the trainer waits for a rollout, a SIGTERM / SIGINT also sets `_signal`, after the
    run's own handler has taken it (`workdir.StopSignals`: "stopping after this step"; a second
    signal still stops at once): the step it would stop after cannot end without a rollout,
    and a scheduler's one SIGTERM must stop the run before its SIGKILL (`_stop_waiting`)."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def note(signum, frame):
      self._signal = self._signal or signum
      handler = previous[signum]
      if callable(handler):  # the run's (a notebook's own code may have set none: then we stop)
        handler(signum, frame)

    for s in previous:
      signal.signal(s, note)
    try:
      yield
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)

  def _stop_waiting(self, index: int) -> None:
    """A signal came while waiting for rollout `index`: a checkpoint of the steps taken (if the
    newest is not of this step), and `Interrupted` (the command exits 128 + the signal number,
    as after a step: oapl_jax/workdir.py `StopSignals`). Nothing of the rollout is lost: its
    index is the checkpoint's next, and a sampler's file of it is taken after the resume."""
    run, signum = self._run, self._signal or signal.SIGTERM
    run.ckpt.wait()
    if run.ckpt.latest_step() != run.counters.step:
      run.save()
    run.close()
    name = signal.Signals(signum).name
    raise Interrupted(signum, f"stopped by {name} at step {run.counters.step}, waiting for rollout {index} "
                      f"from the sampler jobs: checkpoint saved in {run.ckpt.directory}; run the same "
                      "command again to resume")

  def _take(self, index: int, path: str) -> "offline.OfflineData | None":
    """Rollout `index`'s file, checked; None if it is not written yet, or (with one line) if it
    is damaged or not this run's rollout: then it is set aside, to be sampled again.
    Multi-host: every step of it agreed over the processes, so all take the same file or none."""
    if distributed.any_process(not storage.exists(path)):  # seen by every process first
      return None
    data, error = None, None
    try:
      data = self._read(index, path)
    except offline.OfflineFileError as e:
      error = e
      if not self._writer:  # process 0 says the line; this one's own reason goes to its log
        print(f"process {jax.process_index()}: {e}", flush=True)
    failed = distributed.allgather(np.array(error is not None))
    if not failed.any():
      if distributed.any_process((_fingerprint(data) != distributed.broadcast(_fingerprint(data))).any()):
        return None  # replaced while the processes read it (a sampler's late copy): read again
      try:
        self._check_logprobs(data, data.header.get("policy") or {})  # a collective
        return data
      except offline.OfflineFileError as e:
        error = e
    if not failed[0] and failed.any():  # process 0 read it well: it cannot say another's reason
      error = f"process {int(np.argmax(failed))} of the trainer could not read or check it (its log says why)"
    self._set_aside(index, path, error)
    return None

  def _read(self, index: int, path: str) -> offline.OfflineData:
    """Rollout `index`'s file, if it opens and is this run's (`OfflineFileError` otherwise)."""
    run, config = self._run, self._run.config
    data = offline.read(path)
    offline.check_matches(data, config, run.model_meta())
    offline.check_problems(data, run.sampler.tokenizer)
    h, policy = data.header, data.header.get("policy") or {}
    if (h.get("rollout"), h.get("seed"), data.groups) != (index, config.seed, config.rl.groups_per_rollout):
      raise offline.OfflineFileError(
          f"offline file {path}: rollout {h.get('rollout')} of seed {h.get('seed')} with {data.groups} groups; "
          f"this run's rollout {index} of seed {config.seed} has rl.groups_per_rollout={config.rl.groups_per_rollout}")
    want = remote.version_of(index, config.rl.lag)
    if self._rc.reproducible and policy.get("version") != want:
      raise offline.OfflineFileError(
          f"offline file {path}: sampled by snapshot version {policy.get('version')}; "
          f"rl.remote.reproducible takes rollout {index} from version {want} (a sampler job not in reproducible mode?)")
    return data

  def _set_aside(self, index: int, path: str, why) -> None:
    """Refuses rollout `index`'s file: kept as `.rejected` and its claim dropped, so a sampler
    samples it again; the run stops after `rl.remote.max_rejections` files of one rollout."""
    self._rejected[index] = self._rejected.get(index, 0) + 1
    if self._rejected[index] >= self._rc.max_rejections:
      raise offline.OfflineFileError(f"rollout {index} refused {self._rejected[index]} times "
                                     f"(rl.remote.max_rejections); the last: {why}") from None
    say(f"rollout {index} set aside, to be sampled again: {why}")
    if self._writer:
      if storage.exists(path):  # kept for a look, under a name no reader takes
        storage.write_bytes(path + ".rejected", storage.read_bytes(path))
        storage.remove(path)
      remote.release(self.root, index)
    distributed.barrier(f"remote_set_aside_{index}_{self._rejected[index]}")  # gone before anyone looks again

  def _check_logprobs(self, data, policy: dict) -> None:
    """Each sampler's first rollout of the engines' current version: `rl.offline.check_rows` of
    its rows rescored with pi_old by the trainer's kernel (as offline mode checks a round's file),
    so a sampler job with other weights or another engine is refused. Older versions' files are
    not checked: the trainer no longer holds their pi_old."""
    run = self._run
    key = (str(policy.get("source")), int(policy.get("version", -1)))
    if key[1] != run.counters.version or key in self._checked or not run.config.rl.offline.check_rows:
      return
    if self._recompute is None:  # the engines' model: under model.lora, the base with pi_old merged
      self._recompute = offline.logprob_fn(run.config, run.engine_graphdef, run.mesh)
    offline.check_logprobs(data, run.config, self._recompute, run.engine_snapshot(), seq_len=seq_len(run.config),
                           pad_id=run.sampler.tokenizer.pad_id,
                           what=f"this run's pi_old (version {run.counters.version})")
    self._checked.add(key)

  def saved(self) -> None:
    """After a checkpoint: the rollout files the checkpoint before it had used are removed."""
    if self._saved_at is not None and self._writer:
      for index in remote.written_rollouts(self.root):
        if index < self._saved_at:
          storage.remove(remote.rollout_path(self.root, index))
          remote.release(self.root, index)
    self._saved_at = self._run.counters.rollouts

  pending, resume, wait = SyncSource.pending, SyncSource.resume, SyncSource.wait  # nothing in flight here

  def close(self) -> None:
    """Marks the run done once it has taken its last step: its sampler jobs stop."""
    if self._run.counters.step >= self._run.config.train.steps:
      self._status(done=True)


def _fingerprint(data: offline.OfflineData) -> np.ndarray:
  """A file's contents as 32 bytes (its sha256, checked by `offline.read`), for processes to
  agree they read the same file."""
  return np.frombuffer(bytes.fromhex(data.sha256), np.uint8)


SOURCES = {"sync": SyncSource, "async": AsyncSource, "offline": OfflineSource,
           "remote": RemoteSource}  # rl.mode -> source class
