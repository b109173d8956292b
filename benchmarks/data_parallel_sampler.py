"""Is the second CPU core worth a second engine? One engine vs one engine per host device.

An experiment for the engine's speed target, not a feature: `benchmarks/sampler.py`'s fixed
workload (tiny Qwen3, 32 prompts x 32 tokens, 128 new tokens, temperature 1) run by

  one:    one `Engine` with 32 slots on host device 0 (what `rollout` does today), and
  split:  one `Engine` per host device, each with 32 / N slots and every N-th prompt, each
          driven by its own host thread (`oapl_jax.sampling.parallel.parallel_rollout`),

alternating repetitions in one process with transformers' `generate` on the same weights (its
own process, as in `benchmarks/sampler.py`), medians reported. The host devices are XLA's CPU
devices (`--xla_force_host_platform_device_count`, set below before JAX is imported; default:
the number of cores). Same weights on every device; the split run's answers are sampled with
other keys than the single engine's, so only throughput is compared.

  python benchmarks/data_parallel_sampler.py [--reps 7] [--devices 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--devices", type=int, default=os.cpu_count())
  parser.add_argument("--skip-hf", action="store_true")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")

  import jax  # after XLA_FLAGS
  from flax import nnx

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import sampler as bench  # the fixed workload's model config and prompts
  from oapl_jax.models import Transformer
  from oapl_jax.sampling import Engine, SamplingParams
  from oapl_jax.sampling.parallel import parallel_rollout, shard_engines

  cfg = bench.model_config()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  hf = None if args.skip_hf else bench.HFWorker(model)
  graphdef, params = nnx.split(model, nnx.Param)
  prompts = bench.prompts(32, 32, 32, seed=0)
  devices = jax.devices()

  def make(slots):
    return lambda: Engine(graphdef, cfg, SamplingParams(temperature=1.0), max_slots=slots,
                          max_prefill_length=32, max_len=160)

  one = shard_engines(make(32), params, devices[:1])
  split = shard_engines(make(32 // len(devices)), params, devices)

  def run(shards, rep):
    """Wall seconds and generated tokens of one rollout of all prompts over `shards`."""
    t0 = time.perf_counter()
    ro = parallel_rollout(shards, prompts, group_size=1, max_new_tokens=128, eos_id=-1, pad_id=0,
                          key=jax.random.key(rep))
    return time.perf_counter() - t0, int(ro.lengths.sum())

  for engines in (one, split):  # compile
    run(engines, 0)
  times = {"one": [], "split": []}
  for rep in range(1, args.reps + 1):
    if hf is not None:
      hf.rep(rep)
    for name, engines in (("one", one), ("split", split)):
      seconds, tokens = run(engines, rep)
      times[name].append((seconds, tokens))
  rate = {k: v[0][1] / statistics.median(s for s, _ in v) for k, v in times.items()}
  print(f"jax {jax.__version__}, {len(devices)} host devices, {os.cpu_count()} cores, {args.reps} reps")
  print(f"one engine, 32 slots on one device:        {rate['one']:7.0f} tok/s")
  print(f"{len(devices)} engines, {32 // len(devices)} slots each, one per device: {rate['split']:7.0f} tok/s"
        f"  -> {rate['split'] / rate['one']:.2f}x")
  if hf is not None:
    theirs = hf.finish()["tokens_per_s"]
    print(f"transformers generate (torch, same weights):  {theirs:7.0f} tok/s"
          f"  -> one engine {rate['one'] / theirs:.2f}x, split {rate['split'] / theirs:.2f}x")


if __name__ == "__main__":
  main()
