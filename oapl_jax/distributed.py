"""Multi-host runs: start-up, who writes, and the few host-side collectives a run needs.

A pod (or a SLURM allocation, or `launch/local_multihost.sh`) runs the same command in every
process; each process drives its own local devices (multi-controller JAX).

Start-up (`initialize`, called by `oapl_jax.main` before anything touches JAX):
  * explicit: `distributed.coordinator_address` / `num_processes` / `process_id` (settings), or
    the environment's `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`;
    settings win over the environment. All three, or none.
  * detected: with none of those set, `jax.distributed.initialize()`'s own cluster detection
    (TPU VMs, SLURM, Open MPI) runs when the environment says the launch may be multi-host
    (`detected_launch`: several TPU workers listed (GKE, xpk), several SLURM tasks, an MPI world
    of several, or TPU chips on this host's PCI bus: a Cloud TPU VM, whose peers JAX finds
    through the metadata server; on a one-host TPU VM that start-up is one process).
  * otherwise: nothing; a single process runs exactly as it always has.
A process that cannot reach the coordinator within `distributed.initialization_timeout`
seconds stops with one line naming the address and the setting (`CoordinatorError`).

Who does what, once started (the rest of the code asks only these functions):
  * `is_writer()`: process 0 writes metrics.jsonl, TensorBoard, summary.json, the progress bar
    and the console lines; every process takes part in orbax checkpointing.
  * `barrier(name)`: all processes wait here (files written by one process, read by all).
  * `allgather(x)`: every process's numpy array `x` (same shape everywhere), stacked
    `[process_count, ...]`: one jitted program over one device per process (many small eager
    collectives at once can deadlock the CPU backend's).
  * `broadcast(x)`: process 0's numpy array on every process.
With one process each is the identity (no JAX collective runs): single-process runs are
unchanged.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import socket
import time

import numpy as np

from oapl_jax.errors import UserError

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}  # setting -> environment variable


class CoordinatorError(UserError):
  """This process could not join the run's coordinator (unreachable, or the others never came)."""


def explicit_settings(section) -> dict:
  """{coordinator_address, num_processes, process_id} from `config.distributed` (or, for each
  one left None, the environment); {} when none is set anywhere. Raises UserError when only
  some are set, naming the missing ones."""
  out, source = {}, {}
  for name, env in ENV.items():
    value = section.get(name) if section is not None else None
    if value is None and os.environ.get(env):
      value, source[name] = os.environ[env], env
    else:
      source[name] = f"config.distributed.{name}"
    if value is not None:
      out[name] = value if name == "coordinator_address" else _int(value, source[name])
  if out and len(out) < len(ENV):
    missing = [f"config.distributed.{n} (or {ENV[n]})" for n in ENV if n not in out]
    raise UserError(f"a multi-process run needs all of coordinator_address, num_processes and "
                    f"process_id; missing: {', '.join(missing)}")
  return out


def processes_asked(section=None) -> int:
  """The process count the settings or the environment give (`explicit_settings`), 1 if none:
  known before JAX starts (a detected launch's count is JAX's to find, and is 1 here)."""
  return explicit_settings(section).get("num_processes", 1)


def _int(value, where: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise UserError(f"{where}={value!r}: not an integer") from None


GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")  # v3 .. v7x


def tpu_chips(pci_devices: str = "/sys/bus/pci/devices") -> int:
  """TPU chips attached to this host over PCI (Google's vendor id and a TPU device id)."""
  chips = 0
  for device in glob.glob(os.path.join(pci_devices, "*")):
    try:
      with open(os.path.join(device, "vendor")) as v, open(os.path.join(device, "device")) as d:
        chips += v.read().strip() == GOOGLE_PCI_VENDOR and d.read().strip() in TPU_PCI_DEVICES
    except OSError:
      continue
  return chips


def detected_launch(environ=None, pci_devices: str = "/sys/bus/pci/devices") -> str | None:
  """The kind of launch the environment shows that may span hosts ("tpu" for listed TPU
  workers, "slurm", "mpi", "tpu-vm" for a Cloud TPU VM's chips), or None."""
  env = os.environ if environ is None else environ
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
    return "tpu"
  if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return "slurm"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return "mpi"
  if tpu_chips(pci_devices) and not env.get("TPU_SKIP_MDS_QUERY"):
    return "tpu-vm"
  return None


def initialize(section=None) -> dict | None:
  """Starts multi-controller JAX if the settings or the environment ask for it (module
  docstring); returns how it started ({"coordinator_address", ...} or {"detected": kind}),
  or None for a plain single-process run. Must run before any JAX computation.

  section: `config.distributed` (None: the environment only).
  """
  explicit = explicit_settings(section)
  timeout = int(section.get("initialization_timeout", 300)) if section is not None else 300
  if explicit.get("num_processes") == 1:
    return None  # one process: nothing to join
  kind = None if explicit else detected_launch()
  if not explicit and kind is None:
    return None
  import jax  # noqa: PLC0415 (only once a multi-host run is asked for)
  where = explicit.get("coordinator_address", f"(detected: {kind})")
  setting = ("config.distributed.coordinator_address / JAX_COORDINATOR_ADDRESS" if explicit
             else f"the {kind} environment")

  def refuse(reason: str):
    return CoordinatorError(
        f"process {explicit.get('process_id', '?')} of {explicit.get('num_processes', '?')} could "
        f"not reach the coordinator at {where} within {timeout}s ({reason}; the address is set by "
        f"{setting}; the wait by config.distributed.initialization_timeout)")

  if explicit:  # XLA aborts the process when its client cannot connect: look first, from here
    remaining = _wait_for_coordinator(explicit["coordinator_address"], explicit["process_id"], timeout)
    if remaining is None:
      raise refuse("nothing answers there" if explicit["process_id"] else "cannot listen there")
    timeout = max(1, int(remaining))
  try:
    jax.distributed.initialize(**explicit, initialization_timeout=timeout)
  except Exception as e:  # XLA's runtime errors (DEADLINE_EXCEEDED, UNAVAILABLE)
    raise refuse(" ".join(str(e).split())[:200]) from None
  return explicit or {"detected": kind}


def _wait_for_coordinator(address: str, process_id: int, timeout: float) -> float | None:
  """Seconds left of `timeout` once the coordinator can be used, or None if it cannot: process
  0 must be able to listen on the address's port (the coordinator runs in it); the others retry
  a TCP connection to it until it answers."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout
  if process_id == 0:
    with socket.socket() as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(("", int(port)))
      except OSError:
        return None
    return timeout
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
        return max(1.0, deadline - time.monotonic())
    except OSError:
      if time.monotonic() >= deadline:
        return None
      time.sleep(0.2)


def check_started(expected: int, setting: str) -> None:
  """Refuses, in one line, a run whose topology (`setting`) spans `expected` processes when this
  process sees another count: on a pod, a process whose distributed system never started."""
  import jax  # noqa: PLC0415
  if jax.process_count() != expected:
    raise CoordinatorError(
        f"{setting} runs {expected} processes (one per host) but this process sees "
        f"{jax.process_count()}: the distributed system did not start. Run the same command on "
        "every host (launch/tpu_pod.sh does), with config.distributed.* or JAX_COORDINATOR_ADDRESS "
        "/ JAX_NUM_PROCESSES / JAX_PROCESS_ID where JAX cannot find its peers itself")


# --- a process that went away ----------------------------------------------------------------

LOST_PROCESS_EXIT = 75  # EX_TEMPFAIL: the run can resume; a scheduler should restart every process
# What the runtime says when another process of the run is gone: its collectives' transport
# (Gloo on CPU: the peer's address) or the coordination service (no heartbeat from task N).
_LOST = (re.compile(r"Connection (?:closed|reset) by peer|Broken pipe"),
         re.compile(r"Task (\d+) heartbeat timeout"), re.compile(r"tasks are unhealthy"))
_PEER = re.compile(r"\[([^\]\s]+)\]:(\d+)")  # Gloo's "[host]:port" of the other side


def lost_process(e: BaseException) -> str | None:
  """One line for an error that says another process of this multi-host run went away
  (killed, preempted, its host lost), naming it where the runtime does; None for other errors
  and in single-process runs. `oapl_jax.main` prints it and exits at once
  (`LOST_PROCESS_EXIT`): a normal exit would wait ~60 s in JAX's shutdown barrier for the
  missing process and then abort with screens of runtime logs."""
  if process_count() <= 1:
    return None
  text = str(e)
  peer, task, unhealthy = (pattern.search(text) for pattern in _LOST)
  if peer:
    where = _PEER.search(text)
    who = f"the process at {where[1]} (port {where[2]})" if where else "a process"
  elif task:
    who = f"process {task[1]}"
  elif unhealthy:
    who = "a process"
  else:
    return None
  return (f"process {process_index()} of {process_count()}: {who} of this run went away (killed, "
          f"preempted or its host lost: see its log); this process stops too. The checkpoints are "
          f"kept: restart the run on every host to resume from the newest")


# --- who does what ---------------------------------------------------------------------------


def process_count() -> int:
  import jax  # noqa: PLC0415
  return jax.process_count()


def process_index() -> int:
  import jax  # noqa: PLC0415
  return jax.process_index()


def is_writer() -> bool:
  """Whether this process writes the run's files and console lines (process 0)."""
  return process_index() == 0


def barrier(name: str) -> None:
  """All processes wait here until every one has reached the barrier `name`."""
  if process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    multihost_utils.sync_global_devices(name)


@functools.cache
def _gather_fn():
  """(mesh, jitted identity to replicated) over the first local device of every process."""
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415
  firsts = {}
  for d in jax.devices():
    firsts.setdefault(d.process_index, d)
  mesh = Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))
  return mesh, jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def allgather(x) -> np.ndarray:
  """`x` (a numpy array of the same shape and dtype on every process) from every process,
  stacked `[process_count, *x.shape]` in process order; one program, one collective."""
  x = np.asarray(x)
  if process_count() == 1:
    return x[None]
  import jax  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415
  mesh, gather = _gather_fn()
  local = mesh.devices.flat[process_index()]
  sharding = NamedSharding(mesh, PartitionSpec("process"))
  stacked = jax.make_array_from_single_device_arrays(
      (process_count(), *x.shape), sharding, [jax.device_put(x[None], local)])
  return np.asarray(gather(stacked).addressable_data(0))


def broadcast(x) -> np.ndarray:
  """Process 0's `x` on every process (same shape and dtype everywhere)."""
  return allgather(x)[0] if process_count() > 1 else np.asarray(x)


def fetch(tree):
  """Every leaf of `tree` (jax arrays, which may span processes) whole, as numpy, on every
  process: one leaf at a time (`multihost_utils.process_allgather`: at most one leaf's full copy
  per device beside the weights), one collective per leaf. One process: `jax.device_get`."""
  import jax  # noqa: PLC0415
  if process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # noqa: PLC0415
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process."""
  return bool(flag) if process_count() == 1 else bool(allgather(np.array(bool(flag))).any())


def total(n: int) -> int:
  """The sum of the int `n` over processes."""
  return totals(n)[0]


def totals(*ns: int) -> list[int]:
  """The sum of each int of `ns` over processes, in one collective."""
  if process_count() == 1:
    return [int(n) for n in ns]
  return [int(x) for x in allgather(np.array([int(n) for n in ns], np.int32)).sum(0)]


def concat_rows(*arrays) -> list[np.ndarray]:
  """Each `[n, ...]` array of this process (the same n everywhere) concatenated over the
  processes in process order (`[process_count * n, ...]`), in one collective. One process:
  the arrays themselves."""
  if process_count() == 1:
    return [np.asarray(a) for a in arrays]
  flat = [np.asarray(a, np.float32).reshape(-1) for a in arrays]
  gathered = allgather(np.concatenate(flat))  # [P, sum of sizes]
  out, start = [], 0
  for a, f in zip(arrays, flat):
    part = gathered[:, start:start + f.size].reshape(-1, *np.shape(a)[1:])
    out.append(part.astype(np.asarray(a).dtype))
    start += f.size
  return out


def gather_groups(values, index, num_groups: int) -> np.ndarray:
  """The whole `[num_groups * G, ...]` array of which this process holds the groups `index`
  (`values` `[len(index) * G, ...]`, group j's G rows are rows index[j] * G ..): each process's
  share, put in place. One process: `values` itself."""
  values, index = np.asarray(values), np.asarray(index, np.int64)
  if process_count() == 1:
    return values
  g = len(values) // max(len(index), 1) if len(index) else 0
  g = int(allgather(np.array(g, np.int32)).max())
  padded = np.zeros((num_groups * g, *values.shape[1:]), values.dtype)
  where = np.full((num_groups,), -1, np.int32)
  where[:len(index)] = index
  padded[:len(values)] = values
  all_values, all_where = allgather(padded), allgather(where)
  out = np.zeros_like(padded)
  for vals, idx in zip(all_values, all_where):
    idx = idx[idx >= 0]
    rows = (idx[:, None] * g + np.arange(g)).ravel()
    out[rows] = vals[:len(rows)]
  return out


# --- host rows in checkpoints ----------------------------------------------------------------


def rows_sharding():
  """Sharding of host rows held as one global array: axis 0 split over the processes (one
  device each), so orbax writes every process's rows (it writes numpy leaves from process 0
  only)."""
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415
  mesh, _ = _gather_fn()
  return NamedSharding(mesh, PartitionSpec("process"))


def rows_to_global(x):
  """This process's rows `[n, ...]` (numpy; the same n on every process) as one global array
  `[process_count * n, ...]`, process p's rows at p * n .."""
  import jax  # noqa: PLC0415
  x = np.asarray(x)
  counts = allgather(np.array(len(x), np.int32))
  if (counts != len(x)).any():
    raise RuntimeError(f"processes hold different numbers of rows ({counts.tolist()}): cannot "
                       "checkpoint them as one array")
  return jax.make_array_from_process_local_data(rows_sharding(), x, (len(x) * process_count(), *x.shape[1:]))


def rows_to_local(x) -> np.ndarray:
  """This process's rows of a global array made by `rows_to_global` (after a restore)."""
  return np.asarray(x.addressable_data(0))
