"""How long a checkpoint save holds up training: the Qwen3-0.6B run state on 8 host devices.

    python benchmarks/checkpoint_save.py                    # this checkout
    python benchmarks/checkpoint_save.py --before=/path/to/an/older/checkout   # side by side

The state is a run's: pi_theta (float32 master weights), AdamW's two moments, the snapshot
pi_old (bfloat16), all created sharded over fsdp=8 host devices (Qwen3-0.6B preset, random
weights: 2.4 + 4.8 + 1.2 GB), and a buffer of 64 rows x 2048 tokens. Each checkout runs in its own
child process and saves it `--saves` times (a new step each, keep=2) into a fresh folder on
local disk through `checkpoint.Checkpointer`, timing:

  blocking_s  what the training loop waits for (`save(..., wait=False)` where the checkout has
              it: checksums and orbax's copy of the arrays; else the whole save)
  total_s     until the step is written and in place (`wait()`)
  hash_s      the checksums alone (`checkpoint.leaf_digests`), measured apart

and prints the medians, one JSON line per checkout. Host "devices" share this machine's cores
and the disk is the local one: the ratio between checkouts is the figure, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(saves: int, out_dir: str) -> dict:
  import inspect  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from oapl_jax import checkpoint, sharding  # noqa: PLC0415
  from oapl_jax import config as config_lib  # noqa: PLC0415
  from oapl_jax.models.build import init_model  # noqa: PLC0415
  from oapl_jax.rl.step import make_optimizer, opt_state_shardings  # noqa: PLC0415

  c = config_lib.defaults("qwen3_0_6b")
  c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 1
  mesh = sharding.make_mesh(c.mesh, jax.devices())
  _, _, params = init_model(c, mesh=mesh)
  shardings = jax.tree.map(lambda x: x.sharding, params)  # as a run lays them out (rl.step.TrainStep)
  optimizer = make_optimizer(c.train, 100)
  opt_shardings = opt_state_shardings(optimizer, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), shardings, mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  snapshot = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p),
                     out_shardings=shardings)(params)
  rng = np.random.default_rng(0)
  buffer = {"tokens": rng.integers(0, 151936, (64, 2048), dtype=np.int32),
            "logprobs": rng.standard_normal((64, 2048)).astype(np.float32)}
  state = {"params": params, "opt_state": opt_state, "snapshot": snapshot, "buffer": buffer}
  jax.block_until_ready(state)
  gib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30

  ckpt = checkpoint.Checkpointer(out_dir, keep=2)
  async_save = "wait" in inspect.signature(ckpt.save).parameters
  blocking, total, hashing = [], [], []
  for step in range(1, saves + 1):
    t0 = time.perf_counter()
    if async_save:
      ckpt.save(step, state, {"model": {}}, wait=False)
      blocking.append(time.perf_counter() - t0)
      ckpt.wait()
    else:
      ckpt.save(step, state, {"model": {}})
      blocking.append(time.perf_counter() - t0)
    total.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    checkpoint.leaf_digests(state)
    hashing.append(time.perf_counter() - t0)
  return {"state_gib": round(gib, 2), "async": async_save, "saves": saves,
          "blocking_s": round(statistics.median(blocking), 2), "total_s": round(statistics.median(total), 2),
          "hash_s": round(statistics.median(hashing), 2), "devices": len(jax.devices()),
          "sharded_gib": round(sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
                                   and not x.is_fully_replicated) / 2**30, 2)}


def run_checkout(root: str, saves: int) -> dict:
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  with tempfile.TemporaryDirectory() as d:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"--saves={saves}",
                        f"--out={d}/ckpt"], cwd=root, env=env, capture_output=True, text=True)
  if p.returncode != 0:
    raise SystemExit(f"{root}: child failed:\n{p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--saves", type=int, default=3)
  ap.add_argument("--before", help="another checkout of this project, measured first")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--out", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    sys.path.insert(0, os.getcwd())
    print(json.dumps(child(args.saves, args.out)), flush=True)
    return
  rows = []
  for name, root in ([("before", os.path.abspath(args.before))] if args.before else []) + [("this", ROOT)]:
    row = {"checkout": name, **run_checkout(root, args.saves)}
    rows.append(row)
    print(json.dumps(row), flush=True)
  if len(rows) == 2:
    print(f"blocking time: {rows[1]['blocking_s']:.2f} s vs {rows[0]['blocking_s']:.2f} s before "
          f"({rows[0]['blocking_s'] / max(rows[1]['blocking_s'], 1e-9):.1f}x less)")


if __name__ == "__main__":
  main()
