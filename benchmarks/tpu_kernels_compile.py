"""The attention kernels compiled ahead of time for one TPU v5p device, beside the blockwise code.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python benchmarks/tpu_kernels_compile.py [causal|decode|run]

Needs libtpu in the Python environment (a venv of its own, `pip install -e '.[tpu]'`); runs on a
CPU host: the TPU compiler builds for one device of `get_topology_desc("v5:2x2x1", "megacore")`
(a v5p-8 slice), nothing runs. For each attention ("causal": the trainer's pass, forward and
forward + backward; "decode": one engine step), with `attention_kernel` "pallas" (splash /
the project's decode kernel) and "xla" (the blockwise code): compile time, XLA's
`cost_analysis()` (FLOPs, bytes accessed; a Pallas kernel is one custom call whose FLOPs XLA
does not count, so the attention's FLOPs are also given by hand) and `memory_analysis()`
(argument, output and temporary bytes). Shapes: causal B=1, T=2048, N=16, K=8, D=128; decode
B=64 rows at position 4095 of a 4096-position cache, chunk 1024; bfloat16.

With the argument `run`: the whole `configs/tiny.py` run compiled for v5p-8 by the compile dry
run (`oapl_jax.aot.compile_run`, which sets `attention_kernel` "pallas" for a TPU topology),
and the Mosaic (Pallas) calls counted in each compiled program's HLO.
"""

import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from oapl_jax.models.attention import causal_attention, decode_attend  # noqa: E402

B, T, N, K, D = 1, 2048, 16, 8, 128
ROWS, CACHE, CHUNK = 64, 4096, 1024
DTYPE = jnp.bfloat16


def _causal_programs(device):
  """{name: (fn, abstract args, attention FLOPs by hand)} of the trainer's attention."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, DTYPE, sharding=device)  # noqa: E731
  args = (sds(B, T, N, D), sds(B, T, K, D), sds(B, T, K, D))
  pairs = T * (T + 1) // 2  # causal (query, key) pairs
  fwd_flops = 4 * B * N * D * pairs  # q k and p v
  progs = {}
  for kernel in ("pallas", "xla"):
    fwd = lambda q, k, v, kernel=kernel: causal_attention(q, k, v, kernel=kernel)  # noqa: E731

    def fwd_bwd(q, k, v, fwd=fwd):
      out, vjp = jax.vjp(fwd, q, k, v)
      return vjp(out)  # a cotangent the size of the output

    progs[f"causal fwd {kernel}"] = (fwd, args, fwd_flops)
    progs[f"causal fwd+bwd {kernel}"] = (fwd_bwd, args, fwd_flops * 7 // 2)  # + recompute, dq, dk, dv
  return progs


def _decode_programs(device):
  g = N // K
  sds = lambda shape, dtype=DTYPE: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
  args = (sds((ROWS, K, g, D)), sds((ROWS, K, D, CACHE)), sds((ROWS, K, CACHE, D)),
          sds((ROWS,), jnp.int32))
  flops = 4 * ROWS * N * D * CACHE
  progs = {}
  for kernel in ("pallas", "xla"):
    def step(q, k_cache, v_cache, positions, kernel=kernel):
      return decode_attend(q, k_cache, v_cache, positions, jnp.int32(CACHE), CHUNK, kernel=kernel)
    progs[f"decode {kernel}"] = (step, args, flops)
  return progs


def tiny_run():
  """Mosaic calls per program of configs/tiny.py compiled for v5p-8."""
  from configs import tiny  # noqa: PLC0415
  from oapl_jax import aot  # noqa: PLC0415
  from oapl_jax import config as config_lib  # noqa: PLC0415
  config = tiny.get_config()
  config.mesh.topology = "v5p-8"
  config_lib.validate(config, dry_run=True)
  for prog in aot.compile_run(config, keep_hlo=True).programs:
    kernels = {k: prog.hlo.count(k) > 0 for k in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")}
    calls = prog.hlo.count('custom_call_target="tpu_custom_call"')
    print(f"{prog.name:<16} Mosaic calls: {calls}  {', '.join(k for k, v in kernels.items() if v)}")


def main():
  topology = topologies.get_topology_desc("v5:2x2x1", chip_config_name="megacore",
                                          chips_per_host_bounds=(2, 2, 1))
  device = jax.sharding.SingleDeviceSharding(topology.devices[0])
  print(f"device: {topology.devices[0].device_kind} (1 of {len(topology.devices)}); "
        f"causal B={B} T={T} N={N} K={K} D={D}, decode rows={ROWS} cache={CACHE} chunk={CHUNK}, "
        f"{jnp.dtype(DTYPE).name}")
  print(f"{'program':<24}{'compile s':>10}{'XLA GFLOP':>11}{'hand GFLOP':>11}{'GB accessed':>12}"
        f"{'arg MiB':>9}{'out MiB':>9}{'temp MiB':>10}")
  progs = {**_causal_programs(device), **_decode_programs(device)}
  only = sys.argv[1] if len(sys.argv) > 1 else ""  # a name prefix: "causal", "decode"
  for name, (fn, args, flops) in progs.items():
    if not name.startswith(only):
      continue
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    mib = lambda n: n / 2**20  # noqa: E731
    print(f"{name:<24}{seconds:>10.1f}{cost.get('flops', 0) / 1e9:>11.2f}{flops / 1e9:>11.2f}"
          f"{cost.get('bytes accessed', 0) / 1e9:>12.3f}{mib(mem.argument_size_in_bytes):>9.1f}"
          f"{mib(mem.output_size_in_bytes):>9.1f}{mib(mem.temp_size_in_bytes):>10.1f}")


if __name__ == "__main__":
  tiny_run() if sys.argv[1:] == ["run"] else main()
