"""Multi-host runs (oapl_jax/distributed.py, launch/local_multihost.sh) with local processes.

Several processes on 127.0.0.1 take the code path of a pod: `jax.distributed` started from the
environment or the settings, gloo collectives between CPU processes. The checks:
* start-up: settings / environment / detection; an unreachable coordinator is one line;
* N processes x k replicas sample exactly what one process with N x k replicas samples (rows
  bit for bit), and their train step on the global batch gives the same numbers;
* a 2-process x 4-device train step (fsdp over all 8 devices) equals the 1-process 8-device
  step;
* end to end (`launch/local_multihost.sh 2 configs/tiny.py:smoke`): one metrics.jsonl and
  summary.json, the single-process (sampling.engines=2) losses and rollouts; a run stopped by
  SIGTERM mid-run and resumed with the same command ends with the same losses and weights (a
  small run in CI, the smoke run with `-m slow`).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import distributed
from oapl_jax.sampling.parallel import global_row_order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch", "local_multihost.sh")
DETECTION_VARS = ("TPU_WORKER_HOSTNAMES", "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                  *distributed.ENV.values())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in DETECTION_VARS and k != "XLA_FLAGS"}
  return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": REPO,
          **extra}


def _start(script: str, n: int, devices: int, *args: str) -> list[subprocess.Popen]:
  """`script` in n processes of one multi-host run (the environment's JAX_* variables; n = 0:
  one plain process, nothing set)."""
  port = _free_port()
  launch = [{}] if n == 0 else [
      {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n),
       "JAX_PROCESS_ID": str(i)} for i in range(n)]
  return [subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=_env(devices, **extra)) for extra in launch]


def _outputs(procs: list[subprocess.Popen], timeout: int = 900) -> list[str]:
  """The processes' stdouts, after checking that every one exited 0."""
  outs = [p.communicate(timeout=timeout) for p in procs]
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}: {out[-2000:]}{err[-4000:]}"
  return [out for out, _ in outs]


# --- start-up ----------------------------------------------------------------------------------


def test_settings_come_from_the_config_then_the_environment(monkeypatch):
  for var in DETECTION_VARS:
    monkeypatch.delenv(var, raising=False)
  c = config_lib.from_file("configs/tiny.py:smoke")
  assert distributed.explicit_settings(c.distributed) == {}
  assert distributed.initialize(c.distributed) is None  # one process, nothing set: nothing done
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.explicit_settings(c.distributed) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
  c.distributed.process_id = 2  # a setting wins over the environment
  assert distributed.explicit_settings(c.distributed)["process_id"] == 2
  monkeypatch.delenv("JAX_NUM_PROCESSES")
  with pytest.raises(distributed.UserError, match="missing: config.distributed.num_processes"):
    distributed.explicit_settings(c.distributed)


def test_multi_host_launches_are_detected_from_the_environment():
  assert distributed.detected_launch({}) is None
  assert distributed.detected_launch({"TPU_WORKER_HOSTNAMES": "w0"}) is None  # one TPU host
  assert distributed.detected_launch({"TPU_WORKER_HOSTNAMES": "w0,w1"}) == "tpu"
  assert distributed.detected_launch({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
  assert distributed.detected_launch({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}) == "slurm"
  assert distributed.detected_launch({"OMPI_COMM_WORLD_SIZE": "8"}) == "mpi"


def _pci(root, *devices):
  """A fake /sys/bus/pci/devices: one folder per (vendor, device) pair."""
  for i, (vendor, device) in enumerate(devices):
    d = root / f"0000:00:{i:02x}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  return str(root)


def test_a_cloud_tpu_vm_is_detected_by_its_tpu_chips(tmp_path):
  """A gcloud-made TPU VM lists no workers in its environment (JAX finds them through the
  metadata server): its TPU chips on the PCI bus say to start jax.distributed; Google's network
  card (same vendor, another device id) or another vendor's device does not."""
  v5p = _pci(tmp_path / "v5p", *[("0x1ae0", "0x0062")] * 4, ("0x1ae0", "0x0042"))
  assert distributed.tpu_chips(v5p) == 4
  assert distributed.detected_launch({}, pci_devices=v5p) == "tpu-vm"
  assert distributed.detected_launch({"TPU_SKIP_MDS_QUERY": "1"}, pci_devices=v5p) is None
  other = _pci(tmp_path / "gpu", ("0x10de", "0x2330"), ("0x1ae0", "0x0042"))
  assert distributed.tpu_chips(other) == 0 and distributed.detected_launch({}, pci_devices=other) is None
  assert distributed.tpu_chips(str(tmp_path / "none")) == 0


def test_a_pod_topology_with_one_process_is_one_line():
  """A v5p-64 run whose process sees no peers (the distributed system did not start) stops
  before its first step with one line, instead of training one host's share as the whole."""
  code = ("from oapl_jax import distributed\n"
          "try:\n  distributed.check_started(8, 'config.mesh.topology=v5p-64')\n"
          "except distributed.CoordinatorError as e:\n  print(e)\n"
          "distributed.check_started(1, 'config.mesh.topology=v5p-8')\nprint('one host: fine')")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True,
                       env=_env(1), timeout=120, check=True).stdout
  assert out.splitlines() == [
      "config.mesh.topology=v5p-64 runs 8 processes (one per host) but this process sees 1: the "
      "distributed system did not start. Run the same command on every host (launch/tpu_pod.sh "
      "does), with config.distributed.* or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
      "JAX_PROCESS_ID where JAX cannot find its peers itself", "one host: fine"]


@pytest.mark.parametrize("setting, value, needle", [
    ("coordinator_address", "localhost", "must be host:port"),
    ("num_processes", 0, "must be None or an int >= 1"),
    ("process_id", 2, "must be below distributed.num_processes=2"),
    ("initialization_timeout", 0, "must be an int >= 1"),
])
def test_distributed_settings_are_validated(setting, value, needle):
  c = config_lib.from_file("configs/tiny.py:smoke")
  c.distributed.num_processes = 2
  c.distributed[setting] = value
  with pytest.raises(config_lib.ConfigError, match=needle) as e:
    config_lib.validate(c)
  assert f"config.distributed.{setting}=" in str(e.value)


def test_unreachable_coordinator_is_one_line_naming_address_and_setting(tmp_path):
  port = _free_port()  # nothing listens there
  t0 = time.perf_counter()
  out = subprocess.run(
      [sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke",
       f"--workdir={tmp_path}", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       "--config.distributed.num_processes=2", "--config.distributed.process_id=1",
       "--config.distributed.initialization_timeout=2"],
      cwd=REPO, text=True, capture_output=True, env=_env(1), timeout=120)
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert f"127.0.0.1:{port}" in errors[0] and "config.distributed.coordinator_address" in errors[0]
  assert "within 2s" in errors[0]
  assert time.perf_counter() - t0 < 60


def test_async_mode_over_two_processes_is_refused_in_one_line(tmp_path):
  """rl.mode='async' is single-host for now: both processes stop at start-up with the one
  line naming the setting, before anything is built on the devices."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke", f"--workdir={tmp_path}",
       "--config.rl.mode=async", "--config.sampling.engines=2",
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
      cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(2))
      for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert errors == ["error: config.rl.mode='async': multi-host runs (2 processes) support "
                      "rl.mode='sync' or 'remote', for now"], err[-3000:]


@pytest.mark.parametrize("lost", [1, pytest.param(0, marks=pytest.mark.slow)],  # CI: one of them
                         ids=["process_1_lost", "process_0_lost"])
def test_a_lost_process_stops_the_other_at_once_in_one_line(tmp_path, lost):
  """kill -9 of one process mid-RL (a host lost without a launcher to stop the rest): the
  other stops within seconds, with one line naming the process that went away and exit code
  75, not a runtime traceback and an abort after JAX's ~60 s shutdown barrier. When process 0
  (the coordinator) is the one lost, jaxlib's coordination agent (a C++ thread) logs the loss in
  its own lines first; ours is still the last line, and the exit is ours."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke", f"--workdir={tmp_path}",
       "--config.train.steps=40", "--config.log.progress=False", "--config.sampling.engines=2",
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
      cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(1))
      for i in range(2)]
  metrics, t0 = tmp_path / "metrics.jsonl", time.time()
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # mid-RL
    assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
    assert time.time() - t0 < 600, "timed out"
    time.sleep(0.1)
  procs[lost].kill()
  t0 = time.time()
  survivor = procs[1 - lost]
  _, err = survivor.communicate(timeout=300)
  took = time.time() - t0
  procs[lost].communicate()
  assert survivor.returncode == distributed.LOST_PROCESS_EXIT, err[-3000:]
  *before, line = err.strip().splitlines()
  assert "Traceback" not in err and not [b for b in before if b.startswith("error:")], err[-3000:]
  if lost == 0:  # the coordinator's host: jaxlib's coordination agent logs it (a C++ thread) before our line
    assert before and re.match(r"[IWEF]\d{4} ", before[0]), err[-3000:]
  else:
    assert before == [], err[-3000:]
  assert line.startswith(f"error: process {1 - lost} of 2: the process at 127.0.0.1 (port "), line
  assert "went away" in line and "restart the run on every host" in line, line
  assert took < 45, took  # bounded: not JAX's shutdown barrier (~60 s) and its abort


# --- prompts drawn globally, sampled locally -------------------------------------------------

ROLLOUT = textwrap.dedent("""
    import sys, numpy as np
    from oapl_jax import distributed
    distributed.initialize(None)  # from the environment (the launcher's JAX_* variables)
    import jax
    from oapl_jax import config as config_lib
    from oapl_jax.eval.evaluate import eval_key, evaluate
    from oapl_jax.rl.loop import Run, draw_rollouts
    from oapl_jax.rl.step import Batch
    c = config_lib.from_file("configs/tiny.py:smoke")
    c.sampling.engines = int(sys.argv[2])
    r = Run(c, sys.argv[1])
    drawn = draw_rollouts(c, r.sampler, r.engine_weights(), indices=[0], version=0, snapshot_step=0)
    r.buffer.extend(drawn.rows)
    rows = r.buffer.take(r.groups_per_step)
    new, _, m = r.train_step(r.params, r.opt_state, r.snapshot, Batch.from_rows(rows), r.reference)
    ev = evaluate(r.sampler, r.engine_copy(new), samples_per_problem=4, key=eval_key(0))
    np.savez(f"{sys.argv[1]}/rows_{jax.process_index()}.npz", **drawn.rows.as_dict())
    if jax.process_index() == 0:
      print("METRICS", repr({k: float(v) for k, v in jax.device_get(m).items()}))
      print("EVAL", repr(ev["correct_per_problem"]), ev["mean_answer_tokens"])
""")


def test_two_processes_sample_and_step_exactly_as_one_process_with_two_engines(tmp_path):
  """2 processes x 1 engine vs 1 process x 2 engines (sampling.engines=2 both: the replicas over
  all processes; smoke config, random weights): the rollout's rows are bit for bit the same, so
  is the train step on them, and evaluation."""
  multi, single = tmp_path / "multi", tmp_path / "single"
  multi.mkdir()
  single.mkdir()
  runs = _start(ROLLOUT, 2, 1, str(multi), "2"), _start(ROLLOUT, 0, 2, str(single), "2")
  out, want = (_outputs(procs)[0] for procs in runs)
  lines = lambda text, tag: [line for line in text.splitlines() if line.startswith(tag)]  # noqa: E731
  assert lines(out, "METRICS") == lines(want, "METRICS") and lines(out, "METRICS")
  assert lines(out, "EVAL") == lines(want, "EVAL") and lines(out, "EVAL")
  parts = [np.load(multi / f"rows_{i}.npz") for i in range(2)]
  ref = np.load(single / "rows_0.npz")
  c = config_lib.from_file("configs/tiny.py:smoke")
  groups = c.rl.groups_per_rollout
  order = global_row_order(groups // 2, c.rl.group_size, 2, 1)
  for name in ref.files:
    joined = np.concatenate([p[name] for p in parts])
    np.testing.assert_array_equal(joined[order], ref[name], err_msg=name)
  assert len(parts[0]["rewards"]) == len(ref["rewards"]) // 2  # each process sampled its share


# --- the sharded train step across processes ---------------------------------------------------

STEP8 = textwrap.dedent("""
    import sys, numpy as np
    from oapl_jax import distributed
    distributed.initialize(None)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    sys.path.insert(0, "tests")
    from test_mesh_train import COMMON
    exec(COMMON)
    assert jax.device_count() == 8, jax.devices()
    c = config(1, 8, 1)
    c.sampling.engines = 2  # one engine replica per process (or two in one process)
    c.rl.group_size, c.rl.groups_per_step = int(sys.argv[3]), 32 // int(sys.argv[3])
    if sys.argv[4:] == ["packed"]:  # rows of 2T, 8 per micro-batch: 4 on each process
      c.train.packing, c.train.pack_rows, c.train.pack_budget = True, 8, 2 * seq_len(c)
    # argv[2] "interleaved": the mesh's fsdp axis alternates processes, as a TPU slice's may
    # (v5p-64's runs over processes 0, 2, 4, 6, 0, ...): process p's rows are not rows p*n on.
    devices = jax.devices()
    if sys.argv[2] == "interleaved":
      devices = [devices[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    mesh = sharding.make_mesh(c.mesh, devices)
    _, graphdef, params = init_model(c, mesh=mesh)
    _, _, other = init_model(_reseeded(c), mesh=mesh)
    step = make_train_step(c, graphdef, make_optimizer(c.train, c.train.steps),
                           SamplingParams.from_config(c.sampling), mesh)
    params = step.place_params(jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, params, other))
    snapshot = step.snapshot_of(other)
    b = batch(c)
    n, p, g = jax.process_count(), jax.process_index(), c.rl.group_size
    # this process's share: its replica's groups p, p + n, ... (one engine per process)
    rows = np.concatenate([np.arange(j * g, (j + 1) * g) for j in range(p, c.rl.groups_per_step, n)])
    mine = jax.tree.map(lambda x: x[rows], b)
    if c.train.packing:  # each process packs its own answers (`TrainStep.batch_of`)
      from oapl_jax.rl.buffer import Rows
      k = len(rows)
      mine, layout = step.batch_of(Rows(**vars(mine), answer_lengths=mine.mask.sum(1).astype(np.int64),
                                        version=np.zeros(k, np.int32), snapshot_step=np.zeros(k, np.int32)))
      print("LAYOUT", layout, step.cost_of(mine), flush=True)
    new_params, _, metrics = step(params, step.init_opt_state(params), snapshot, mine)
    with jax.set_mesh(mesh):
      whole = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))(new_params)
    if p == 0:
      leaves = [np.asarray(x) for x in jax.tree.leaves(whole)]
      np.savez(sys.argv[1], *leaves, **{k: np.asarray(v) for k, v in metrics.items()})
      print("OK")
""")


@pytest.mark.parametrize("order, group_size", [pytest.param("plain", 4, marks=pytest.mark.slow),
                                               ("interleaved", 8)])  # CI: the harder case
def test_two_processes_of_four_devices_step_like_one_process_of_eight(tmp_path, order, group_size):
  """fsdp over 8 devices in 2 processes (each with half the batch) == fsdp 8 in one process.
  "interleaved": the processes' devices alternate on the fsdp axis and a group of 8 rows spans
  two devices (4 rows each), so rows placed by process number would mix groups: V_hat and the
  residuals over the wrong answers."""
  args = (order, str(group_size))
  runs = (_start(STEP8, 2, 4, str(tmp_path / "multi.npz"), *args),
          _start(STEP8, 0, 8, str(tmp_path / "single.npz"), *args))
  for procs in runs:
    _outputs(procs)
  got, want = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  assert sorted(got.files) == sorted(want.files)
  assert abs(float(want["loss"])) > 1e-3 and float(got["step_skipped"]) == 0.0
  for name in want.files:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_two_processes_packing_their_own_answers_step_like_one_padded_process(tmp_path):
  """train.packing over 2 processes of 4 devices (interleaved on the fsdp axis, groups of 8):
  each process packs its own 16 answers into its 4 rows of each micro-batch; the step equals
  the padded step of one process of 8 devices on the same 32 answers to float32 rounding
  (rtol 2e-5, as tests/test_packing.py: attention blocks and log-prob tiles fall elsewhere in
  a packed row). Answers mapped to another process's rows, or groups out of the global order,
  change the loss far beyond that."""
  runs = (_start(STEP8, 2, 4, str(tmp_path / "multi.npz"), "interleaved", "8", "packed"),
          _start(STEP8, 0, 8, str(tmp_path / "single.npz"), "interleaved", "8"))
  out = _outputs(runs[0])
  _outputs(runs[1])
  got, want = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  assert sorted(got.files) == sorted(want.files)
  assert abs(float(want["loss"])) > 1e-3 and float(got["step_skipped"]) == 0.0
  layouts = [line for text in out for line in text.splitlines() if line.startswith("LAYOUT")]
  assert len(layouts) == 2 and layouts[0] == layouts[1]  # the step's figures agree over processes
  assert "'micro_batches': 2" in layouts[0]  # both micro-batches run: neither process fits in one
  for name in want.files:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)


# --- end to end through launch/local_multihost.sh ----------------------------------------------

SMALL = ["--config.warmup.steps=10", "--config.warmup.noisy_steps=4", "--config.train.steps=4"]


def _launch(n: int, workdir, *overrides, timeout: int = 900) -> subprocess.Popen:
  return subprocess.Popen(["bash", LAUNCH, str(n), "configs/tiny.py:smoke", f"--workdir={workdir}",
                           *overrides], cwd=REPO, env=_env(1, PYTHON=sys.executable), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _single_run(workdir, *overrides) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke",
                           f"--workdir={workdir}", "--config.sampling.engines=2", *overrides],
                          cwd=REPO, env=_env(2), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, timeout: int = 900) -> str:
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-5000:]
  return out


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _saved(workdir, step: int, item: str) -> list[np.ndarray]:
  """The arrays of `item` ("params", "buffer") in checkpoint `step`, as numpy (any run)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  tree = ocp.PyTreeCheckpointer().metadata(path)
  tree = getattr(tree, "item_metadata", tree)
  target = {item: _zeros(tree[item])}
  restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
  import jax  # noqa: PLC0415
  return jax.tree.leaves(restored[item])


def _zeros(meta):
  import jax  # noqa: PLC0415
  return jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta,
                      is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def _check_same_run(multi, single, steps: int, starts: int = 1) -> float:
  """Process 0 alone writes (metrics.jsonl holds each step once; only process 0's log has the
  console lines and the summary), the same per-step losses and metrics; returns the largest
  loss difference. starts: how often the run was started (each start opens its own TensorBoard
  events file, named by the start's time)."""
  logs = [open(os.path.join(multi, "logs", f"process_{i}.log")).read() for i in range(2)]
  assert "eval after:" in logs[0] and '"trainer_steps"' in logs[0]
  assert "eval after:" not in logs[1] and '"trainer_steps"' not in logs[1], logs[1][-2000:]
  assert os.path.isfile(os.path.join(multi, "summary.json"))
  assert not [f for f in os.listdir(multi) if f.endswith(".tmp")]
  written = [f for _, _, files in os.walk(multi) for f in files]  # the whole workdir tree
  for name, count in (("metrics.jsonl", 1), ("summary.json", 1), ("eval_before.json", 1),
                      ("events.out.tfevents", starts)):
    assert sum(f.startswith(name) for f in written) == count, (name, sorted(written))
  got, want = _metrics(multi), _metrics(single)
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, steps + 1))
  worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
  assert worst <= 1e-5, (got, want)
  for a, b in zip(got, want):
    for key in ("reward_mean", "answer_length", "lag_hist", "samples_generated", "policy_version"):
      assert a[key] == b[key], (key, a, b)
  summary = json.load(open(os.path.join(multi, "summary.json")))
  ref = json.load(open(os.path.join(single, "summary.json")))
  assert summary["eval_after"]["correct_per_problem"] == ref["eval_after"]["correct_per_problem"]
  assert summary["samples_generated"] == ref["samples_generated"]
  return worst


def _check_same_rows(multi, single, step: int) -> None:
  """The buffer of checkpoint `step`: every process's rows, in place, are the single run's."""
  c = config_lib.from_file("configs/tiny.py:smoke")
  got, want = _saved(multi, step, "buffer"), _saved(single, step, "buffer")
  assert got and len(got) == len(want)
  for x, y in zip(got, want):
    order = global_row_order(len(y) // c.rl.group_size // 2, c.rl.group_size, 2, 1)
    np.testing.assert_array_equal(x[order], y)


@pytest.mark.slow  # CI: test_two_processes_sample_and_step_exactly_as_one_process_with_two_engines
def test_local_multihost_smoke_run_is_the_two_engine_run(tmp_path):
  """launch/local_multihost.sh 2 configs/tiny.py:smoke (few steps) vs one process with
  sampling.engines=2: one metrics.jsonl and summary.json, equal losses (<= 1e-5) and metrics,
  the same rows in the checkpointed buffer, the same final weights."""
  multi, single = tmp_path / "multi", tmp_path / "single"
  procs = [_launch(2, multi, *SMALL, "--config.log.profile_steps=2:3"), _single_run(single, *SMALL)]
  out = _finish(procs[0])
  _finish(procs[1])
  assert out.count('"trainer_steps": 4') == 1  # process 0 alone prints the summary
  # a profiler trace from each process, each in its own folder (one machine: one host name)
  for i in range(2):
    assert len(list((multi / "profile" / f"process_{i}").glob("plugins/profile/*/*.xplane.pb"))) == 1
  worst = _check_same_run(multi, single, 4)
  print(f"max loss difference {worst:.3g}")
  _check_same_rows(multi, single, 2)
  for x, y in zip(_saved(multi, 4, "params"), _saved(single, 4, "params")):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


@pytest.mark.slow  # CI: test_two_processes_packing_their_own_answers_step_like_one_padded_process
def test_local_multihost_packed_run_is_the_one_process_packed_run(tmp_path):
  """train.packing end to end over 2 processes (each packs its own answers into its row of
  each micro-batch) vs one process with both engines packing all of them: the same losses (to
  1e-5; float32 rounding, the segments lie elsewhere), rewards, rollouts and evaluation, and the
  layout metrics in metrics.jsonl."""
  packed = ("--config.train.packing=True", "--config.train.pack_rows=2", "--config.train.pack_budget=28")
  multi, single = tmp_path / "multi", tmp_path / "single"
  procs = [_launch(2, multi, *SMALL, *packed), _single_run(single, *SMALL, *packed)]
  _finish(procs[0])
  _finish(procs[1])
  print(f"max loss difference {_check_same_run(multi, single, 4):.3g}")
  for got, want in zip(_metrics(multi), _metrics(single)):
    assert 0.0 <= got["pad_fraction"] < 1.0 and got["rows_filled"] >= want["rows_filled"] >= 1
    assert 1 <= got["micro_batches"] and 1 <= want["micro_batches"]


@pytest.mark.slow  # CI: the sharded LoRA step (test_lora.py) and the two-process steps above
def test_local_multihost_lora_run_is_the_two_engine_run(tmp_path):
  """The same with low-rank adapters (model.lora): each process rebuilds the frozen base, the
  base's sha256 is agreed over both processes' shards, and the losses, metrics and the saved
  adapters are the one-process run's."""
  lora = ("--config.model.lora.rank=4", "--config.model.lora.alpha=8.0")
  multi, single = tmp_path / "multi", tmp_path / "single"
  procs = [_launch(2, multi, *SMALL, *lora), _single_run(single, *SMALL, *lora)]
  _finish(procs[0])
  _finish(procs[1])
  _check_same_run(multi, single, 4)
  got, want = _saved(multi, 4, "params"), _saved(single, 4, "params")
  assert len(got) == 2 * 7 * 2  # A and B of 7 projections in 2 layers: the adapters only
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_local_multihost_small_run_stopped_and_resumed_ends_with_the_same_weights(tmp_path):
  """The reduced form of the next test (CI): the small run (a 10-step warm-up, 4 steps, an
  evaluation at step 2) stopped by SIGTERM to the launcher once step 1 is logged (both
  processes stop after step 1 or, while evaluating at step 2, after step 2: a checkpoint whose
  buffer holds groups of the window) and started again with the same command: it resumes, and
  its losses, metrics and final weights are the uninterrupted single-process two-engine run's
  (losses to 1e-5, weights to 1e-6). Broken by hand at the restore, each failed here: the
  weights x 1.001 (the final weights 2e-6 to 4e-5 off; the losses stay within 1e-5, the small
  run's rewards being 0), the buffer dropped (stopped at step 2: step 3's answer_length 3.25 for
  3.66), AdamW's state reset (step 4's answer_length 3.25 for 3.41)."""
  multi, single = tmp_path / "multi", tmp_path / "single"
  small = [*SMALL, "--config.eval.every=2"]
  reference = _single_run(single, *small)
  first = _launch(2, multi, *small)
  deadline = time.monotonic() + 900  # a safety net, not a timing check
  while not ((multi / "metrics.jsonl").exists() and (multi / "metrics.jsonl").read_text().strip()):
    assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-4000:]
    time.sleep(0.05)
  first.send_signal(signal.SIGTERM)  # the launcher passes it on to both processes
  out, _ = first.communicate(timeout=600)
  assert first.returncode == 128 + signal.SIGTERM, out[-4000:]
  stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", out).group(1))
  assert not (multi / "summary.json").exists(), out[-4000:]
  out = _finish(_launch(2, multi, *small))
  assert f"resumed from step {stopped}" in out
  _finish(reference)
  _check_same_run(multi, single, 4, starts=2)
  for x, y in zip(_saved(multi, 4, "params"), _saved(single, 4, "params")):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_local_multihost_run_killed_and_resumed_ends_with_the_same_weights(tmp_path):
  """The smoke run (6 steps) stopped by SIGTERM after a checkpoint and started again with the
  same command: it resumes, and its losses and final weights are the uninterrupted
  single-process two-engine run's."""
  multi, single = tmp_path / "multi", tmp_path / "single"
  reference = _single_run(single)
  first = _launch(2, multi)
  ckpt = multi / "checkpoints" / "2"
  deadline = time.monotonic() + 900
  while not (ckpt / "meta").exists() and time.monotonic() < deadline and first.poll() is None:
    time.sleep(1)
  first.send_signal(signal.SIGTERM)  # the launcher passes it on to both processes
  out, _ = first.communicate(timeout=600)
  assert first.returncode == 128 + signal.SIGTERM, out[-4000:]
  assert not (multi / "summary.json").exists()
  out = _finish(_launch(2, multi))
  assert "resumed from step" in out
  _finish(reference)
  _check_same_run(multi, single, 6, starts=2)
  for x, y in zip(_saved(multi, 6, "params"), _saved(single, 6, "params")):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
