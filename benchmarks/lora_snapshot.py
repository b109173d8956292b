"""Remote mode under model.lora: what a published pi_old weighs and what a sampler job pays to reload it.

  python benchmarks/lora_snapshot.py --config=tiny.py:lora
  python benchmarks/lora_snapshot.py --config=gsm8k.py:lora          # Qwen3-0.6B, bf16 base, rank 16

For a config of configs/ (its model.lora; a random base, as with no model.path), publishes
`--versions` snapshots of random adapters as a LoRA trainer does (`remote.publish_snapshot`, the
adapters in model.dtype, the base's {path, sha256} in the header) and reloads each as a sampler
job does (`remote.read_snapshot`, then `lora.merged` into the base, jitted, on this machine's
first device). Prints the bytes per version, the seconds of each reload (the first one compiles
the merge), and, beside them, the full model.dtype snapshot a run without adapters publishes and
its read. The sampler job's one-time costs (building the base, its sha256) are printed too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax import checkpoint
from oapl_jax import config as config_lib
from oapl_jax.models import build
from oapl_jax.models import lora as lora_lib
from oapl_jax.rl import remote


def timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="tiny.py:lora", help="a configs/ file and arg, with model.lora.rank > 0")
  p.add_argument("--versions", type=int, default=5)
  args = p.parse_args()
  config = config_lib.repo_config(args.config)
  lora, dtype = build.lora_of(config), jnp.dtype(config.model.dtype)
  assert lora is not None, f"{args.config}: model.lora.rank is 0"
  (model_cfg, graphdef, base), t_base = timed(lambda: build.init_model(config, param_dtype=config.model.dtype))
  record, t_sha = timed(lambda: checkpoint.base_record(config, base))
  meta = {**model_cfg.architecture(), "lora": lora.record(), "base": record}
  _, adapters, _ = nnx.split(lora_lib.attach(nnx.merge(graphdef, base), lora, config.seed), nnx.LoRAParam, nnx.Param)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=device), adapters)
  merge = jax.jit(lambda b, a: lora_lib.merged(b, a, lora.scale))
  n_base = sum(x.size for x in jax.tree.leaves(base))
  n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.config}: {model_cfg.num_layers} layers, "
        f"width {model_cfg.hidden_size}, {n_base / 1e6:.1f}M base weights in {dtype.name}; rank {lora.rank} on "
        f"{len(lora.targets)} projections: {n_adapters / 1e6:.2f}M adapter weights")
  print(f"sampler job, once: base built in {t_base:.2f}s, its sha256 in {t_sha:.2f}s")
  with tempfile.TemporaryDirectory() as root:
    reloads = []
    for v in range(args.versions):
      keys = iter(jax.random.split(jax.random.key(v), 10_000))
      pi_old = jax.tree.map(lambda x: (x + 0.01 * jax.random.normal(next(keys), x.shape)).astype(dtype), adapters)
      path, t_pub = timed(lambda: remote.publish_snapshot(root, pi_old, version=v, snapshot_step=v, model_meta=meta))
      size = os.path.getsize(path)
      t0 = time.perf_counter()
      got, _ = remote.read_snapshot(path, abstract, meta)
      t_read = time.perf_counter() - t0
      jax.block_until_ready(merge(base, jax.device_put(got)))
      reloads.append((time.perf_counter() - t0, t_read))
      print(f"version {v}: {size} bytes ({size / 2**20:.2f} MiB; adapters {n_adapters * dtype.itemsize} + header and "
            f"zip {size - n_adapters * dtype.itemsize}), published in {t_pub:.3f}s; reload {reloads[-1][0]:.3f}s "
            f"(read and checked {t_read:.3f}s, merged {reloads[-1][0] - t_read:.3f}s)")
    steady = reloads[1:] or reloads
    print(f"reload (read + check + merge), versions 1-{args.versions - 1}: median {np.median([r for r, _ in steady]):.3f}s "
          f"(read {np.median([r for _, r in steady]):.3f}s); version 0 compiles the merge")
    full_meta = model_cfg.architecture()
    merged = merge(base, adapters)
    path, t_pub = timed(lambda: remote.publish_snapshot(root, merged, version=99, snapshot_step=0, model_meta=full_meta))
    full_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=device), merged)
    _, t_read = timed(lambda: remote.read_snapshot(path, full_abstract, full_meta)[0])
    size = os.path.getsize(path)
    print(f"without adapters (the full {dtype.name} weights): {size} bytes ({size / 2**20:.1f} MiB), published in "
          f"{t_pub:.2f}s, read and checked in {t_read:.2f}s; {size / os.path.getsize(remote.snapshot_path(root, 0)):.0f}x "
          "the adapters' snapshot")


if __name__ == "__main__":
  main()
