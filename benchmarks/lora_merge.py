"""Merge the adapters into the engine's weights at a refresh, or apply them at every token?

  python benchmarks/lora_merge.py [--preset=qwen3_0_6b_cpu] [--rank=16] [--repeats=7]

Measures, side by side on this machine, medians of `--repeats` timed calls (after a compile):
* merge: `lora.merged(base, adapters)` jitted, once per refresh (every rl.lag steps);
* the forward pass over a batch of rows of 1 token (a decode step's shape; 16 rows) and of
  64 tokens (a prefill's), with the base merged (what the engines run) and with the adapters
  applied beside each projection (`x W + s (x A) B`, what an engine applying them would add).
A decode-step delta times the decode steps between two refreshes, against one merge, decides.
The forward pass stands in for the engine's decode step (same projections, no KV cache): the
extra work of applying adapters is the same low-rank matmuls in both.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.models import lora as lora_lib
from oapl_jax.models.build import model_config
from oapl_jax.models.transformer import Transformer

# A CPU-sized stand-in for Qwen3-0.6B's block shapes (width 1024, 16 heads, MLP 3072), fewer layers.
PRESETS = {"qwen3_0_6b_cpu": dict(vocab_size=4096, hidden_size=1024, num_layers=4, num_heads=16,
                                  num_kv_heads=8, head_dim=128, mlp_dim=3072)}


def median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="qwen3_0_6b_cpu")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  cfg = model_config(PRESETS.get(args.preset, args.preset))
  lora = lora_lib.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
  graphdef, base = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  lgraph, adapters, _ = nnx.split(lora_lib.attach(nnx.merge(graphdef, base), lora, 0), nnx.LoRAParam, nnx.Param)
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)
  merge = jax.jit(lambda b, a: lora_lib.merged(b, a, lora.scale))
  merged = merge(base, adapters)
  plain = jax.jit(lambda w, t: nnx.merge(graphdef, w)(t))
  applied = jax.jit(lambda a, b, t: nnx.merge(lgraph, a, b)(t))  # weights as arguments in both
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.preset}: {cfg.num_layers} layers, "
        f"width {cfg.hidden_size}, MLP {cfg.mlp_dim}; rank {args.rank} on {len(lora.targets)} projections; "
        f"medians of {args.repeats}")
  t_merge = median_seconds(lambda: merge(base, adapters), args.repeats)
  print(f"merge at a refresh: {t_merge * 1e3:.2f} ms")
  for rows, length in ((16, 1), (16, 64)):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, length)))
    t_plain = median_seconds(lambda: plain(merged, tokens), args.repeats)
    t_applied = median_seconds(lambda: applied(adapters, base, tokens), args.repeats)
    print(f"forward [{rows}, {length}]: merged {t_plain * 1e3:.2f} ms, adapters applied "
          f"{t_applied * 1e3:.2f} ms (x{t_applied / t_plain:.2f}, {(t_applied - t_plain) * 1e3:+.2f} ms)"
          + (f"; one merge = the extra of {t_merge / (t_applied - t_plain):.0f} such calls"
             if t_applied > t_plain else ""))


if __name__ == "__main__":
  main()
