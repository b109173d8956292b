"""Engine replicas: the engines' data axis, sampling as one (`sampling.engines` in the config).

The trainer samples through `Replicas`. With one replica it is `rollout` on one engine. With
N, the prompts are split round-robin over N engines, each with its own weights on its own
devices and driven by its own host thread; the rows come back in prompt order. This is
JetStream's own model of scale-out (its orchestrator takes a list of generate engines).

Each replica holds T = `sampling.tensor` devices, a mesh `("tensor",)` (`layout.engine_mesh`):
replica i takes devices `[i*T, (i+1)*T)` of the list it is given (`rl.loop.engine_devices`
picks them, as `placement.split_devices` says). The decode slots `sampling.max_slots` are a
total, split evenly over the replicas of all processes (`placement.engine_slots`).
`load_params` re-lays pi_theta out for all replicas at once, on device
(`layout.load_weights`).

Why on a CPU host: one XLA process uses its cores poorly for decode-sized work (a process
pinned to one core samples about as fast as one using two), while separate host devices each
run on their own core. `placement.request_host_devices(n)` asks JAX for n CPU devices; it must
run before JAX starts its backends (`oapl_jax.train.run` calls it before anything else touches
JAX).
On TPU / GPU the replicas sit on the local accelerator devices they are given.

Prompt p of the list has the key `fold_in(key, p)` (`rollout.answer_keys`), whichever replica
samples it: answers are deterministic given the key, and the same for any number of replicas
(one replica: exactly a plain `rollout`).

Multi-host (oapl_jax/distributed.py): the replicas of all processes are one data axis
(`sampling.engines` counts them all; each process runs `placement.local_engines` of them). Every
process is handed the same global prompt list; global replica r = process_index x local
replicas + i takes `prompts[r::R]` (R replicas in all), and `rollout`
returns this process's rows only (`local_prompts`: which prompts, in order), each prompt with its
global key. So N processes
x k replicas sample exactly what one process with N x k replicas samples: the same code path,
`first` = 0 and `total` = the local count on one process.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.sampling.engine import Engine, EngineParams
from oapl_jax.sampling.layout import engine_mesh, load_weights
from oapl_jax.sampling.rollout import Rollout, prompt_keys, rollout


class Replicas:
  """`num` engines built by `make_engine(mesh)`, replica i on the mesh of devices
  `[i * tensor, (i + 1) * tensor)` of `devices` (default: the local devices)."""

  def __init__(self, make_engine, num: int = 1, devices=None, tensor: int = 1, *,
               first: int = 0, total: int | None = None):
    self.first = first  # global index of this process's first replica
    self.total = num if total is None else total  # replicas over all processes
    devices = list(devices or jax.local_devices())
    need = num * tensor
    if need > len(devices):
      setting = f"sampling.engines={num}" + (f" x sampling.tensor={tensor}" if tensor > 1 else "")
      raise ConfigError(
          f"{setting} needs {need} devices, JAX has {len(devices)} ({devices}). On "
          f"CPU, start the process with XLA_FLAGS=--xla_force_host_platform_device_count={need}, "
          f"or call oapl_jax.placement.request_host_devices({need}) before any JAX "
          f"operation (python -m oapl_jax.main does this).")
    self.devices = devices[:need]
    self.meshes = [engine_mesh(self.devices[i * tensor:(i + 1) * tensor]) for i in range(num)]
    self.engines: list[Engine] = []
    for mesh in self.meshes:
      with jax.default_device(mesh.devices.flat[0]):
        self.engines.append(make_engine(mesh))

  def __len__(self) -> int:
    return len(self.engines)

  @property
  def engine(self) -> Engine:
    """The first replica (all are alike)."""
    return self.engines[0]

  def load_params(self, params, version: int = -1) -> list[EngineParams]:
    """`params` (pi_theta's `nnx.State`, in any dtype and sharding) in every replica's layout on
    its devices, stamped `version`: one re-layout on device for all (`layout.load_weights`)."""
    return load_weights(params, version, self.engine.layout, self.meshes, self.global_groups())

  def global_groups(self) -> list[list] | None:
    """Every process's replica device groups (multi-host: the same list on every process, so
    the refresh is one program everywhere), assuming alike hosts; None with one process."""
    if jax.process_count() == 1:
      return None
    local = jax.local_devices()
    where = [[local.index(d) for d in mesh.devices.flat] for mesh in self.meshes]
    by_process = {}
    for d in jax.devices():
      by_process.setdefault(d.process_index, []).append(d)
    return [[by_process[p][j] for j in group] for p in sorted(by_process) for group in where]

  def replica_ids(self) -> list[int]:
    """Global indices of this process's replicas."""
    return [self.first + i for i in range(len(self.engines))]

  def local_prompts(self, num_prompts: int) -> np.ndarray:
    """Indices (ascending) of the prompts of a `num_prompts` list that this process's replicas
    sample; all of them on one process."""
    return process_share(num_prompts, self.total, self.first, len(self.engines))

  def rollout(self, weights, prompts: list[list[int]], *, group_size: int, key: jax.Array,
              **kwargs) -> Rollout:
    """`rollout` over the replicas; rows in the order of `prompts` (multi-host: of this
    process's share of them, `local_prompts`).

    weights: from `load_params`, or bare params (loaded here, version -1).
    kwargs: the rest of `rollout`'s arguments (max_new_tokens, eos_id, pad_id, ...);
    `answer_limits`, if given, is split with the prompts.
    """
    if not isinstance(weights, list):
      weights = self.load_params(weights)
    n, total = len(self.engines), self.total
    limits = kwargs.pop("answer_limits", None)
    turns = kwargs.pop("turns", None)
    ids = self.replica_ids()
    key = prompt_keys(key, len(prompts))  # of the whole list (global: alike on every process)
    results: list[Rollout | None] = [None] * n
    errors: list[BaseException] = []

    def work(i):
      try:
        with jax.default_device(self.meshes[i].devices.flat[0]):
          r = ids[i]
          results[i] = rollout(self.engines[i], weights[i], prompts[r::total], group_size=group_size,
                               key=key[r::total],
                               answer_limits=None if limits is None else list(limits)[r::total],
                               turns=None if turns is None else _ReplicaTurns(turns, r, total),
                               **kwargs)
      except BaseException as e:  # re-raised in the caller's thread
        errors.append(e)

    if n == 1:
      work(0)  # in the caller's thread
    else:
      threads = [threading.Thread(target=work, args=(i,)) for i in range(n) if prompts[ids[i]::total]]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
    if errors:
      raise errors[0]
    done = [(r, res) for r, res in zip(ids, results) if res is not None]
    if not done:  # multi-host, fewer prompts than replicas: this process has none
      empty = np.zeros((0, 1), np.int32)
      return Rollout([], group_size, empty, empty.astype(np.float32), empty[:, 0], empty[:, 0],
                     empty[:, 0])
    return _merge([res for _, res in done], [r for r, _ in done], total, prompts,
                  self.local_prompts(len(prompts)), group_size, kwargs["pad_id"])


class _ReplicaTurns:
  """A replica's view of `rollout`'s `turns`: its j-th prompt is prompt r + j * total of the list."""

  def __init__(self, turns, replica: int, total: int):
    self.turns, self.replica, self.total = turns, replica, total
    self.insert_width, self.workers = turns.insert_width, turns.workers

  def respond(self, prompt: int, sample: int, turn):
    return self.turns.respond(self.replica + prompt * self.total, sample, turn)


def process_share(num_prompts: int, total: int, first: int, count: int) -> np.ndarray:
  """Indices (ascending) of the prompts of a `num_prompts` list that replicas first ..
  first + count - 1 of `total` sample (replica r takes prompts r, r + total, ...)."""
  return np.sort(np.concatenate([np.arange(r, num_prompts, total) for r in range(first, first + count)]))


def global_row_order(groups_per_process: int, group_size: int, processes: int,
                     local_replicas: int) -> np.ndarray:
  """Where the rows of one step's global batch are, in the processes' rows laid end to end
  (process 0's, then process 1's, ...): entry q is the row that sits at place q of the batch a
  single process with all the replicas would train on.

  Each process holds its replicas' share of whole windows of R = processes x local_replicas
  consecutive groups (`rl.loop`: the buffer takes whole windows), in order: its local group j
  is window j // k, replica p * k + j % k of it (k = local_replicas)."""
  k, total = local_replicas, processes * local_replicas
  if groups_per_process % k:
    raise ValueError(f"{groups_per_process} groups per process is not a whole number of windows "
                     f"of {k} local replicas")
  src = np.empty(groups_per_process * processes, np.int64)
  for p in range(processes):
    for j in range(groups_per_process):
      src[(j // k) * total + p * k + j % k] = p * groups_per_process + j
  return (src[:, None] * group_size + np.arange(group_size)).ravel()


def _merge(parts: list[Rollout], ids: list[int], total: int, prompts, local: np.ndarray, g: int,
           pad_id: int) -> Rollout:
  """One `Rollout` of the prompts `local` (indices into `prompts`) from the replicas' (replica
  `ids[i]` held prompts ids[i], ids[i] + total, ...)."""
  width = max(r.answers.shape[1] for r in parts)
  # global replica r's j-th prompt is prompt r + j * total, at place p of `local`: rows p*G ..
  rows = np.concatenate([(np.searchsorted(local, r + total * np.arange(len(res.prompts)))[:, None] * g
                          + np.arange(g)).ravel() for r, res in zip(ids, parts)])
  pad = lambda x, value: np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)  # noqa: E731
  merged = {}
  for name, value in (("answers", pad_id), ("logprobs", 0.0), ("lengths", None),
                      ("finish", None), ("versions", None)):
    stacked = np.concatenate([getattr(r, name) if value is None else pad(getattr(r, name), value)
                              for r in parts])
    merged[name] = np.empty_like(stacked)
    merged[name][rows] = stacked
  if parts[0].model is not None:  # multi-turn: the model's tokens flagged (0 on padding)
    stacked = np.concatenate([pad(r.model, 0) for r in parts])
    merged["model"] = np.empty_like(stacked)
    merged["model"][rows] = stacked
  stats = {k: sum(r.stats[k] for r in parts) for k in parts[0].stats}
  return Rollout([prompts[j] for j in local], g, stats=stats, **merged)
