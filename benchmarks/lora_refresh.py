"""What model.lora.merge costs: a standing merged copy ("kept") or none ("in_refresh").

  python benchmarks/lora_refresh.py [--repeats=7] [--hidden=128 --layers=2 --mlp=384] [--dtype=float32]
      [--build_first=kept|in_refresh]

Two LoRA runs of `configs/tiny.py:lora,smoke` (the tiny addition task; its model widened with
--hidden / --layers / --mlp), one per setting, built side by side in this process. Each
repeat, the two take turns: a refresh (`Run.refresh_engine`, then `Run.engine_weights`: the
merge and the engines' re-layout, to ready arrays) and one rollout of a step's groups with the
new weights (`Sampler.sample`: prefill, decode, scoring), each setting first every other
repeat. Printed: the medians over `--repeats`
(after one untimed refresh and rollout that compile), answer tokens per second of the rollouts,
and the bytes each run holds on the devices after a refresh (arrays made since just before
the run was built: base, adapters, AdamW state, pi_old, the merged copy where kept, the
engine's weights and KV cache), and their difference; then the temp and output bytes of the
refresh's compiled programs (XLA's memory_analysis): the merge and the re-layout ("kept": two
programs) and the re-layout with the merge inside ("in_refresh"), whose temp beyond the plain
re-layout's is the merge in transit.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

from configs import tiny  # noqa: E402
from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import train  # noqa: E402

MODES = ("kept", "in_refresh")


def make_config(merge: str, args):
  c = tiny.get_config("lora,smoke")
  c.model.lora.merge = merge
  c.model.hidden_size, c.model.num_layers, c.model.mlp_dim = args.hidden, args.layers, args.mlp
  c.model.dtype = args.dtype
  c.warmup.steps = c.warmup.noisy_steps = 0
  config_lib.validate(c)
  return c


def held_bytes(before: list) -> int:
  """Bytes of the live device arrays not among `before` (held so their ids stay unique)."""
  gc.collect()
  old = {id(x) for x in before}
  return sum(x.nbytes for x in jax.live_arrays() if id(x) not in old and not x.is_deleted())


def refresh(run) -> float:
  t0 = time.perf_counter()
  run.refresh_engine()
  jax.block_until_ready(run.engine_weights())
  return time.perf_counter() - t0


def rollout(run, weights, seed: int) -> tuple[float, int]:
  c = run.config
  problems = run.sampler.task.eval_problems()[:c.rl.groups_per_step]  # the same ones each time
  t0 = time.perf_counter()
  scored = run.sampler.sample(weights, problems, group_size=c.rl.group_size, key=jax.random.key(seed))
  seconds = time.perf_counter() - t0
  return seconds, int(scored.rollout.lengths.sum())


def compiled_bytes(run) -> dict:
  """Temp and output bytes (XLA's memory_analysis) of the refresh's programs for `run`'s model,
  compiled on this backend: the merge alone ("kept" runs it before the re-layout), the
  re-layout of merged weights, and the re-layout with the merge inside ("in_refresh")."""
  from oapl_jax.models import lora as lora_lib  # noqa: PLC0415
  from oapl_jax.sampling.layout import staging_mesh, _source_devices  # noqa: PLC0415
  replicas = run.sampler.replicas
  layout, base, adapters = replicas.engine.layout, run.base, run.snapshot
  stage = staging_mesh(_source_devices(base), replicas.meshes, layout.tensor)
  out = layout.shardings(base, stage)
  scale = run.lora.scale

  def sizes(fn, *args):
    m = fn.lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes, m.output_size_in_bytes

  return {"merge (kept)": sizes(jax.jit(lambda b, a: lora_lib.merged(b, a, scale)), base, adapters),
          "re-layout (kept)": sizes(layout.jitted_relayout(stage, out, base), base),
          "re-layout + merge (in_refresh)": sizes(layout.jitted_relayout(stage, out, base, scale), base, adapters)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--mlp", type=int, default=384)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--workdir", default="/tmp/oapl_lora_refresh_bench")
  p.add_argument("--build_first", choices=MODES, default=MODES[0], help="which run is built first")
  args = p.parse_args()

  runs, held = {}, {}
  for mode in sorted(MODES, key=lambda m: m != args.build_first):
    gc.collect()
    before = jax.live_arrays()
    runs[mode] = train.Run(make_config(mode, args), f"{args.workdir}/{mode}")
    runs[mode].step()  # B moves off zero: the merge is not a no-op
    refresh(runs[mode])  # compiles the merge and the re-layout
    rollout(runs[mode], runs[mode].engine_weights(), 0)  # compiles the rollout
    held[mode] = held_bytes(before)
    del before
  times = {m: {"refresh": [], "rollout": [], "tokens": []} for m in MODES}
  for i in range(args.repeats):
    for mode in (MODES if i % 2 == 0 else MODES[::-1]):  # each goes first in turn
      run = runs[mode]
      times[mode]["refresh"].append(refresh(run))
      seconds, tokens = rollout(run, run.engine_weights(), i + 1)
      times[mode]["rollout"].append(seconds)
      times[mode]["tokens"].append(tokens / seconds)
  c = runs["kept"].config
  base = sum(x.nbytes for x in jax.tree.leaves(runs["kept"].base))
  print(f"{jax.devices()[0].device_kind} x {jax.device_count()}; model {c.model.num_layers} layers, width "
        f"{c.model.hidden_size}, MLP {c.model.mlp_dim}, {c.model.dtype}; LoRA rank {c.model.lora.rank}; "
        f"base {base:,} B; medians of {args.repeats}")
  print(f"{'model.lora.merge':<18} {'refresh s':>10} {'rollout s':>10} {'tokens/s':>10} {'bytes held':>14}")
  for mode in MODES:
    t = times[mode]
    print(f"{mode:<18} {statistics.median(t['refresh']):>10.4f} {statistics.median(t['rollout']):>10.4f} "
          f"{statistics.median(t['tokens']):>10.1f} {held[mode]:>14,}")
  print(f"held: kept - in_refresh = {held['kept'] - held['in_refresh']:,} B (the base in {c.model.dtype}: {base:,} B)")
  print(f"compiled refresh programs ({jax.devices()[0].platform}): temp / output bytes")
  for name, (temp, output) in compiled_bytes(runs["in_refresh"]).items():
    print(f"  {name:<32} {temp:>14,} {output:>14,}")
  for run in runs.values():
    run.close()


if __name__ == "__main__":
  main()
