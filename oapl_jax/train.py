"""`run(config, workdir)`: warm-up -> eval before -> the lagged RL loop -> eval after.

The loop's parts live in `oapl_jax/rl/` (`loop.Run`: the run state and one step of
Algorithm 1; `step`: the jitted train step; `sources`: where rollouts come from); this file
drives them: it resumes or starts a run, logs, checkpoints, stops cleanly on a signal or on
non-finite steps, evaluates and writes `summary.json`.

Multi-host (oapl_jax/distributed.py): every process runs this; process 0 holds the workdir
lock and writes metrics.jsonl, TensorBoard, eval_before.json, summary.json and the progress
bar; every process checkpoints (orbax) and all stop at the same step on a signal.
"""

from __future__ import annotations

import contextlib
import signal
import time

from tqdm import auto as tqdm  # a widget in notebooks, a text bar in terminals

import jax

from oapl_jax import config as config_lib
from oapl_jax import checkpoint, distributed, placement, run_config, storage, warmup
from oapl_jax import plan as plan_lib
from oapl_jax.checkpoint import SaveFailed, storage_failure
from oapl_jax.errors import UserError
from oapl_jax.metrics import ConsoleNotes, DeadModelWatch, MetricsLog, read_json, read_metrics, say, write_json
from oapl_jax.placement import seq_len
from oapl_jax.rl.names import run_lines
from oapl_jax.rl.loop import Run
from oapl_jax.aot import model_flops
from oapl_jax.timing import Profiler
from oapl_jax.topology import LOCAL, TOPOLOGIES
from oapl_jax.workdir import Interrupted, Layout, StopSignals, WorkdirLock, check_usable

__all__ = ["NonFiniteSteps", "Run", "run", "run_validated"]


class NonFiniteSteps(UserError):
  """Too many trainer steps in a row had a non-finite loss or gradient norm."""
  exit_code = 1


def run(config, workdir: str) -> dict:
  """Warm-up -> eval before -> RL (OAPL or the GRPO baseline) -> eval after.

  Resumes from the last checkpoint in workdir; holds the workdir's lock for the whole run
  (a second run there is refused); on SIGTERM / SIGINT during RL it finishes the step, saves
  a checkpoint and raises `Interrupted` (the command line exits 128 + the signal number).
  A run whose memory plan (oapl_jax/plan.py) does not fit the devices is refused first
  (`plan.PlanError`, naming the setting to change), where the device memory is known.
  """
  config_lib.validate(config)  # a bad setting is refused before the workdir is touched
  return run_validated(config, workdir)


def run_validated(config, workdir: str) -> dict:
  """`run` of a config its caller has validated (`python -m oapl_jax.main` does, before it
  imports this module, so that a refused setting is one line on a quiet console)."""
  check_usable(workdir)
  if storage.is_remote(workdir) and config.rl.mode == "offline":
    raise UserError(f"--workdir={workdir}: config.rl.mode='offline' writes its round files on a "
                    "local or shared disk; give a local --workdir")
  processes = distributed.processes_asked(config.distributed)  # before JAX starts
  config, changed = run_config.prepare(config, workdir, processes)  # another run's workdir: one line
  placement.request_host_devices(placement.devices_wanted(config, processes))  # on CPU
  if config.mesh.topology not in (None, LOCAL):  # a pod's processes must have found each other
    distributed.check_started(TOPOLOGIES[config.mesh.topology].processes,
                              f"config.mesh.topology={config.mesh.topology}")
  say(f"jax {jax.__version__}, devices {jax.devices()}"  # process 0's console only
      + (f", process {jax.process_index()} of {jax.process_count()}" if jax.process_count() > 1 else ""))
  for line in (*run_lines(config), *changed): say(line)  # noqa: E701 (loss, environment, settings this resume changes)
  plan_lib.check(config)  # before anything is allocated
  lock = (WorkdirLock(workdir, config.checkpoint.lock_lease_s, config.checkpoint.lock_wait_s)
          if distributed.is_writer() else contextlib.nullcontext())
  try:
    with lock, StopSignals() as stop:  # multi-host: process 0 holds the lock for all
      return _run(config, workdir, stop)
  except OSError as e:  # a metrics or summary file the storage refused (checkpoints: SaveFailed)
    why = storage_failure(e)
    if why is None:
      raise
    newest = checkpoint.newest_step(checkpoint.directory_of(config, workdir))
    raise SaveFailed(f"{e.filename or workdir}: {why}; the checkpoints written are kept (newest: step "
                     f"{newest}); fix the storage and run the same command again to resume from "
                     "there") from e


def _start(r: Run, config, workdir: str) -> tuple[dict, dict]:
  """Resumes from the last checkpoint, or warms up, evaluates the base and saves step 0; returns
  (eval_before, warmup_info)."""
  before_path, warmup_info = Layout(workdir).eval_before, {}
  if config.warmup.steps and r.lora:  # the frozen base first: a checkpoint is checked against it
    warmup_info = r.warm_up()
  if r.restore_latest():
    say(f"resumed from step {r.counters.step} in {r.ckpt.directory}")
    saved = read_json(before_path)
    run_config.save(config, workdir) if distributed.is_writer() else None  # compared at the next resume
    return saved["eval"], saved["warmup"]
  if config.warmup.steps and not r.lora:
    warmup_info = r.warm_up()
  r.start_from(r.params)  # optimizer state, snapshot and reference of the warmed-up base
  eval_before = warmup.cached_eval(config, seq_len(config), lambda: r.evaluate(r.params, "before"))
  if distributed.is_writer():
    write_json(before_path, {"eval": eval_before, "warmup": warmup_info})
    run_config.save(config, workdir)  # before any checkpoint: a resume is compared with it
  r.save()  # every process; the file above exists before any checkpoint does
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
  writer = distributed.is_writer()  # multi-host: process 0 writes metrics and the bar
  metrics_log = (MetricsLog(workdir, resume_step=r.counters.step, tensorboard=config.log.tensorboard)
                 if writer else None)
  r.useful_flops = lambda **cost: model_flops(config, **cost)["useful"]  # a step's MFU (oapl_jax/timing.py)
  bar = tqdm.tqdm(total=config.train.steps, initial=r.counters.step,
                  disable=not (config.log.progress and writer), desc=config.rl.loss, unit="step")
  # evaluations of a resumed run's earlier steps come back from its metrics (each is logged)
  evals = [{"step": row["step"], **row["eval"]} for row in read_metrics(workdir)
           if "eval" in row] if writer and r.counters.step > 0 else []
  notes = ConsoleNotes(config, r.counters.groups_dropped_stale)  # skipped steps, stale groups, a dead model
  profiler = Profiler(config_lib.profile_range(config.log.profile_steps or ""), workdir)
  mark, seconds_saving = time.perf_counter(), 0.0  # a step: previous metrics to its own (timing.py)
  with stop.deferring(), contextlib.closing(bar), contextlib.closing(profiler):  # a signal: stop after this step, with a checkpoint
    while r.counters.step < config.train.steps:
      seconds_profiling = profiler.before_step(r.counters.step + 1)
      m = r.step()
      s = r.counters.step
      for line in notes.update(s, m):
        say(line)
      t = time.perf_counter()
      if config.eval.every and s % config.eval.every == 0 and s < config.train.steps:
        m["eval"] = {k: v for k, v in r.evaluate(r.params, f"step {s}").items() if k != "answer_ids"}  # no per-answer lists
        evals.append({"step": s, **m["eval"]})
      seconds_evaluating, t = time.perf_counter() - t, time.perf_counter()
      if profiler.after_step(s):
        say(f"profile of steps {config.log.profile_steps}: {storage.join(workdir, 'profile')}")
      now = time.perf_counter()
      m |= {"seconds_evaluating": seconds_evaluating, "seconds_saving": seconds_saving,
            "seconds_profiling": seconds_profiling + now - t, "step_seconds": now - mark}
      if (s % config.log.every == 0 or "eval" in m) and writer:  # an evaluation is always logged
        metrics_log.write(s, m)
      mark = time.perf_counter()
      bar.set_postfix(reward=f"{m['reward_mean']:.3f}", loss=f"{m['loss']:.4f}", lag=f"{m['lag_mean']:.1f}",
                      **({"out_of_reach": f"{m['target_out_of_reach']:.2f}"} if "target_out_of_reach" in m else {}),
                      wait=f"{m['seconds_waiting'] / max(m['step_seconds'], 1e-9):.0%}")
      bar.update(1)
      _check_finite_steps(r, config)
      saved = s % config.checkpoint.every == 0 or s == config.train.steps
      t = time.perf_counter()
      r.save(wait=False) if saved else None  # written while the next steps train
      seconds_saving = time.perf_counter() - t
      if distributed.any_process(stop.requested):  # multi-host: every process stops here
        stop.requested = stop.requested or signal.SIGTERM
        bar.close()
        if writer:
          metrics_log.close()
        _stop(r, stop, saved)
  bar.close()
  if writer:
    metrics_log.close()

  eval_after = r.evaluate(r.params, "after")
  r.close()
  summary = {
      "eval_before": eval_before, "eval_after": eval_after, "evals_during": evals,
      "train_seconds": r.counters.train_seconds, "samples_generated": r.counters.samples_generated,
      "trainer_steps": r.counters.step, "policy_versions": r.counters.version, "steps_skipped": r.counters.steps_skipped,
      "groups_dropped_stale": r.counters.groups_dropped_stale, "warmup": warmup_info, "config": config.to_dict(),
  }
  if distributed.is_writer():
    write_json(Layout(workdir).summary, summary)
  return summary
