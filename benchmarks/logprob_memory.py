"""Scratch memory of the trainer's log-prob kernel: tiled vs plain, from XLA's compiled plan.

The workload is the kernel alone, on a stand-in for the model: hidden states `[1, 4096, E]`
(E = 1024 by default; random, an input) and an LM head `[E, 151936]` (Qwen's vocabulary;
float32, an input), targets random. Both sides compile `jax.value_and_grad` of the summed
log-probs w.r.t. hidden states and head, i.e. the log-prob part of a train step's forward
and backward pass:

* plain: `reference_logprobs(hidden @ head, targets)`: float32 `[1, 4096, V]` logits and the
  processing / log-softmax / gather on them (the kernel before issue 13);
* tiled: `tiled_logprobs(hidden, head, targets, tile=512)`: the trainer's kernel.

Printed: `compiled.memory_analysis()` temp bytes (XLA's scratch: every intermediate buffer the
program allocates besides its arguments and outputs) for each, and plain / tiled. Nothing is
executed, so the plain kernel's ~12 GiB are never allocated; compiles on the machine's
default backend (CPU here) in about a minute.

  python benchmarks/logprob_memory.py [--tokens 4096] [--hidden 1024] [--tile 512]
      [--dtype float32|bfloat16]

Cases: temperature 0.6 with top-p 0.95 (the paper's code runs), and the same with top-k 20.

Measured here (CPU backend, jax 0.10.2), both cases alike: float32, tile 512: 1.175 vs
11.592 GiB (9.9x); tile 256: 0.741 GiB (15.6x); bfloat16 hidden states, tile 512: 1.754 vs
12.187 GiB (6.9x; the bf16 head copy and its transpose stay live through the scans). Of the
tiled figure, 0.58 GiB is the per-tile `[E, V]` float32 head gradient before it is added to
the running sum (XLA on CPU does not fuse that add into the matmul).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from oapl_jax.rl.logprobs import reference_logprobs, tiled_logprobs
from oapl_jax.sampling.processing import SamplingParams

VOCAB = 151_936  # Qwen2.5 / Qwen3 / R1-Distill-Qwen
CASES = {
    "T=0.6 top-p=0.95": SamplingParams(temperature=0.6, top_p=0.95),
    "T=0.6 top-k=20 top-p=0.95": SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
}
GIB = 2 ** 30


def compiled_grad(kernel, hidden, head, targets):
  """The compiled value_and_grad of sum(log-probs) w.r.t. (hidden, head) (shapes only)."""
  loss = lambda h, w, y: jnp.sum(kernel(h, w, y)[0])
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, head, targets).compile()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--tile", type=int, default=512)
  parser.add_argument("--dtype", default="float32", help="hidden states' (compute) dtype")
  args = parser.parse_args()

  hidden = jax.ShapeDtypeStruct((1, args.tokens, args.hidden), jnp.dtype(args.dtype))
  head = jax.ShapeDtypeStruct((args.hidden, VOCAB), jnp.float32)
  targets = jax.ShapeDtypeStruct((1, args.tokens), jnp.int32)
  print(f"backend {jax.default_backend()}; hidden [1, {args.tokens}, {args.hidden}] {args.dtype}, "
        f"head [{args.hidden}, {VOCAB}] float32, tile {args.tile}; value_and_grad w.r.t. both")

  for name, sampling in CASES.items():
    def plain(h, w, y, sampling=sampling):
      logits = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)  # [1, T, V]
      return reference_logprobs(logits, y, sampling)

    def tiled(h, w, y, sampling=sampling):
      return tiled_logprobs(h, w, y, sampling, tile=args.tile)

    temp = {}
    for side, kernel in (("plain", plain), ("tiled", tiled)):
      start = time.perf_counter()
      mem = compiled_grad(kernel, hidden, head, targets).memory_analysis()
      temp[side] = mem.temp_size_in_bytes
      print(f"  {name:28s} {side}: temp {temp[side] / GIB:7.3f} GiB  (arguments "
            f"{mem.argument_size_in_bytes / GIB:.3f} GiB, outputs {mem.output_size_in_bytes / GIB:.3f} "
            f"GiB; compiled in {time.perf_counter() - start:.0f} s)")
    ratio = temp["plain"] / temp["tiled"]
    print(f"  {name:28s} plain / tiled = {ratio:.1f}x  (target >= 8x: {'met' if ratio >= 8 else 'NOT met'})")


if __name__ == "__main__":
  main()
