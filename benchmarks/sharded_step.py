"""Tokens/s of the real train step (`rl.step.make_train_step`, OAPL) on 8 host devices vs 1.

    python benchmarks/sharded_step.py            # 1 device, fsdp 8, fsdp 4 x tensor 2
    python benchmarks/sharded_step.py --qwen3    # Qwen3-0.6B architecture on 8 host devices

Each mesh runs in its own child process (JAX fixes its CPU device count at start-up) on the
same model, batch and seed: parameters and AdamW state created sharded, the batch laid out by
`TrainStep.place_batch`, the step compiled ahead of time (`lower().compile()`: compile time and
XLA's per-device memory figures apart), one warm-up step, then `--reps` timed steps; the figure
is the median (tokens = rows x sequence length per step). Host "devices" share this machine's cores, so 8 of
them show the cost of the sharded program (collectives, partitioning), not a speed-up.

`--qwen3`: one (`--reps 0`) or two OAPL steps of the Qwen3-0.6B preset's architecture (random weights,
float32 master weights, bfloat16 compute, 2 rows x 2048 tokens) on 8 host devices
(fsdp 2 x tensor 4: 2 rows cannot split over more batch shards), printing the step time and the
process's peak resident memory (the highest per-phase high-water mark, `/proc/self/status` VmHWM,
and the parent's polling of VmRSS). It sets train.remat=full,
attn_block=512, logprob_tile=128 and says which of them the code in this checkout honours; the
child runs with XLA:CPU's memory-minded scheduler (`CPU_MEMORY_FLAGS`; `--concurrency_scheduler`
keeps the default) and is stopped once its RSS passes `--rss_limit_gib` (default 16 GB).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The throughput model: small enough for a 2-core CPU, big enough that matmuls dominate.
MODEL = dict(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
             head_dim=32, mlp_dim=768, tie_embeddings=True)
MESHES = [(1, 1, 1), (8, 8, 1), (8, 4, 2)]  # (devices, fsdp, tensor)


def _config(qwen3: bool, fsdp: int, tensor: int):
  from oapl_jax import config as config_lib  # noqa: PLC0415
  c = config_lib.defaults("qwen3_0_6b" if qwen3 else "tiny_addition")
  if qwen3:
    c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
    c.rl.group_size, c.rl.groups_per_step = 2, 1  # 2 rows
    c.sampling.max_prompt_len, c.sampling.max_new_tokens = 1024, 1024  # 2048 tokens
    c.train.remat, c.train.attn_block, c.train.logprob_tile = "full", 512, 128
  else:
    c.model.update(MODEL)
    c.rl.group_size, c.rl.groups_per_step = 8, 2  # 16 rows
    c.sampling.max_prompt_len, c.sampling.max_new_tokens = 32, 96  # 128 tokens
  c.sampling.temperature = 1.0
  c.train.lr = 1e-6
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, fsdp, tensor
  return c


def _batch(c, seed: int = 0):
  import numpy as np  # noqa: PLC0415
  from oapl_jax.rl.step import Batch  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  b = c.rl.groups_per_step * c.rl.group_size
  t = c.sampling.max_prompt_len + c.sampling.max_new_tokens
  mask = np.zeros((b, t - 1), np.float32)
  mask[:, c.sampling.max_prompt_len - 1:] = 1.0  # every answer at full length
  return Batch(tokens=rng.integers(0, c.model.vocab_size, (b, t)).astype(np.int32), mask=mask,
               sampler_logprobs=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
               rewards=rng.integers(0, 2, b).astype(np.float32))


def honoured() -> dict:
  """Which of the memory settings the code of this checkout takes (by signature)."""
  from oapl_jax.models.transformer import Transformer  # noqa: PLC0415
  from oapl_jax.rl import logprobs, step  # noqa: PLC0415
  hidden = inspect.signature(Transformer.hidden_states).parameters
  kernel = inspect.signature(logprobs.token_logprobs).parameters
  source = inspect.getsource(step)
  return {"attn_block": "attn_block" in hidden and "attn_block" in source,
          "remat": "remat" in hidden and "remat" in source,
          "logprob_tile": "tile" in kernel and "tile" in source}


def _memory_phase(name: str, phases: dict) -> None:
  """Records this process's resident memory now and its peak since the last phase (Linux:
  VmRSS, VmHWM; the peak is then reset through /proc/self/clear_refs), in GiB, under `name`."""
  try:
    with open("/proc/self/status") as f:
      status = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Vm")}
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:  # not Linux: no phase figures
    return
  phases[name] = {"rss": round(status["VmRSS"] / 2**20, 2), "peak": round(status["VmHWM"] / 2**20, 2)}
  print(f"memory after {name}: {phases[name]} GiB", file=sys.stderr, flush=True)


def child(args) -> dict:
  """One mesh: times `args.reps` steps after a compile step; returns the figures."""
  import jax  # noqa: PLC0415
  from oapl_jax import sharding  # noqa: PLC0415
  from oapl_jax.models.build import init_model  # noqa: PLC0415
  from oapl_jax.rl.step import make_optimizer, make_train_step  # noqa: PLC0415
  from oapl_jax.sampling import SamplingParams  # noqa: PLC0415
  phases = {}  # resident memory (GiB) now and at its peak during each phase
  _memory_phase("imports", phases)
  c = _config(args.qwen3, args.fsdp, args.tensor)
  mesh = sharding.make_mesh(c.mesh, jax.devices())
  t0 = time.perf_counter()
  _, graphdef, params = init_model(c, mesh=mesh)
  step = make_train_step(c, graphdef, make_optimizer(c.train, 100),
                         SamplingParams.from_config(c.sampling), mesh)
  opt_state = step.init_opt_state(params)
  snapshot = step.snapshot_of(params)
  jax.block_until_ready((params, opt_state, snapshot))
  init_s = time.perf_counter() - t0
  _memory_phase("init (params, AdamW, snapshot)", phases)
  batch = step.place_batch(_batch(c))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):  # ahead of time: the compile apart, and XLA's memory figures
    compiled = step.jitted.lower(params, opt_state, snapshot, batch, None, None).compile()
  compile_s = time.perf_counter() - t0
  _memory_phase("compile", phases)
  mem = compiled.memory_analysis()
  memory = {k: round(getattr(mem, f"{k}_size_in_bytes") / 2**30, 3)
            for k in ("argument", "output", "alias", "temp")} if mem is not None else None
  print(f"compiled in {compile_s:.1f} s; per-device GiB {memory}", file=sys.stderr, flush=True)
  times, losses = [], []
  for _ in range(args.reps + 1):  # the first one warms up
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      params, opt_state, m = compiled(params, opt_state, snapshot, batch, None, None)
    losses.append(float(jax.block_until_ready(m["loss"])))
    times.append(time.perf_counter() - t0)
    _memory_phase(f"step {len(times)}", phases)
    print(f"step {len(times)}: {times[-1]:.1f} s, loss {losses[-1]:.6f}", file=sys.stderr, flush=True)
  tokens = batch.tokens.size
  median = statistics.median(times[1:] or times)  # --reps 0: the one step
  planned = planned_gib(c) if args.qwen3 else None
  return {"devices": jax.device_count(), "mesh": dict(mesh.shape), "tokens_per_step": tokens,
          "init_s": round(init_s, 2), "compile_s": round(compile_s, 1),
          "xla_memory_gib_per_device": memory, "first_step_s": round(times[0], 2),
          "step_s": [round(t, 3) for t in times[1:]], "median_step_s": round(median, 3),
          "tokens_per_s": round(tokens / median, 1), "loss": losses,
          # the highest resident memory of any phase (ru_maxrss is not used: the phase figures
          # reset the kernel's high-water mark, which getrusage then under-reports)
          "peak_rss_gib": max([p["peak"] for p in phases.values()] or
                              [round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)]),
          "memory_phases_gib": phases, "honoured": honoured() if args.qwen3 else None, "plan_gib_per_device": planned}


def planned_gib(c) -> dict:
  """The memory planner's trainer figures per device for config `c` (oapl_jax/plan.py): its
  state (weights, AdamW, snapshot), its step (gradients, activations, log-prob kernel), and
  both x the devices: what the process would hold if every device's temp peaked at once."""
  from oapl_jax import plan  # noqa: PLC0415
  p = plan.make_plan(c)
  state = sum(i.nbytes for i in p.items if i.where == "trainer" and i.phase == "state")
  step = sum(i.nbytes for i in p.items if i.where == "trainer" and i.phase == "step")
  return {"state": round(state / 2**30, 3), "step": round(step / 2**30, 3),
          "trainer_total_x_devices": round((state + step) * p.devices / 2**30, 2)}


def _rss_gib(pid: int) -> float:
  """Resident memory of process `pid` now (VmRSS), GiB; 0 once it is gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
  except (OSError, StopIteration):
    return 0.0


# XLA:CPU's default scheduler orders the step's ops for concurrency, which keeps more buffers
# alive at once; the memory-minded order cut the Qwen3-0.6B step's temp per device from 0.805
# to about 0.6 GiB (docs/memory.md). A CPU-only flag: TPU and GPU ignore it.
CPU_MEMORY_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def run_child(devices: int, fsdp: int, tensor: int, reps: int, qwen3: bool,
              rss_limit_gib: float = 0.0, xla_flags: str = "") -> dict:
  """Runs one mesh in a child process; with `rss_limit_gib` the child is stopped (and the
  run reported as over the limit) once its resident memory passes it; `xla_flags` are
  added to its XLA_FLAGS."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()}
  cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--fsdp={fsdp}",
         f"--tensor={tensor}", f"--reps={reps}"] + (["--qwen3"] if qwen3 else [])
  log = tempfile.NamedTemporaryFile("w+", prefix="sharded_step_", suffix=".log", delete=False)
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
  peak = 0.0
  while proc.poll() is None:
    peak = max(peak, _rss_gib(proc.pid))
    if rss_limit_gib and peak > rss_limit_gib:
      proc.kill()
      proc.communicate()
      raise SystemExit(f"child {cmd} passed {rss_limit_gib} GiB of RSS: stopped (log {log.name})")
    time.sleep(0.2)
  stdout, _ = proc.communicate()
  if proc.returncode:
    log.seek(0)
    raise SystemExit(f"child {cmd} failed (log {log.name}):\n{log.read()[-4000:]}")
  return {**json.loads(stdout.strip().splitlines()[-1]), "watched_peak_rss_gib": round(peak, 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5, help="timed steps per mesh (after the compile step)")
  parser.add_argument("--qwen3", action="store_true", help="the Qwen3-0.6B step on 8 host devices")
  parser.add_argument("--rss_limit_gib", type=float, default=16e9 / 2**30,  # 16 GB
                      help="--qwen3: stop the child once its resident memory passes this")
  parser.add_argument("--concurrency_scheduler", action="store_true",
                      help=f"--qwen3: keep XLA:CPU's default scheduler (without {CPU_MEMORY_FLAGS})")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--fsdp", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--tensor", type=int, default=1, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args)), flush=True)
    return
  if args.qwen3:
    flags = "" if args.concurrency_scheduler else CPU_MEMORY_FLAGS
    r = run_child(8, 2, 4, min(args.reps, 1), qwen3=True, rss_limit_gib=args.rss_limit_gib,
                  xla_flags=flags)
    r["xla_flags"] = flags
    peak = max(r["peak_rss_gib"], r["watched_peak_rss_gib"])  # the child's phases; the parent's polling
    print(json.dumps(r, indent=1))
    print(f"Qwen3-0.6B OAPL step, 8 host devices (fsdp 2 x tensor 4), 2 x 2048 tokens, bf16 compute: "
          f"{r['median_step_s']:.1f} s/step (compile {r['compile_s']:.0f} s, first step {r['first_step_s']:.0f} s), "
          f"peak RSS {peak:.2f} GiB ({peak * 2**30 / 1e9:.2f} GB); XLA per device {r['xla_memory_gib_per_device']}; "
          f"plan per device {r['plan_gib_per_device']}; settings honoured: {r['honoured']}")
    return
  rows = [run_child(d, f, t, args.reps, qwen3=False) for d, f, t in MESHES]
  base = rows[0]["tokens_per_s"]
  print(f"model {MODEL}, {rows[0]['tokens_per_step']} tokens/step, median of {args.reps} steps")
  print(f"{'devices':>7} {'mesh (data, fsdp, tensor)':>26} {'step s':>8} {'tokens/s':>9} {'vs 1':>6} {'RSS GiB':>8}")
  for r in rows:
    m = r["mesh"]
    print(f"{r['devices']:>7} {str((m['data'], m['fsdp'], m['tensor'])):>26} {r['median_step_s']:>8.3f} "
          f"{r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>6.2f} {r['peak_rss_gib']:>8.2f}")
  losses = [r["loss"][0] for r in rows]
  print(f"first-step losses (same model and batch): {losses}")


if __name__ == "__main__":
  main()
