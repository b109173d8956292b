"""Attention scratch memory at 16k tokens: blockwise (`attention.causal_attention`) vs dense.

One layer's attention with Qwen3-4B's heads (32 query heads, 8 KV heads, head width 128),
bfloat16 q / k / v, one row of T tokens; forward + backward (`jax.grad` of a weighted sum of
the output with respect to q, k and v). Compile only (`lower().compile().memory_analysis()`):
the dense reference (float32 scores `[B, K, G, T, T]` and a `[T, T]` mask, what `attend` did
before issue 13) would not fit in this machine's memory at 16k tokens.

  python benchmarks/attention_memory.py [--tokens 16384] [--block 512]

Prints the compiled temp (scratch) bytes of each and their ratio.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from oapl_jax.models import attention as tr

N, K, D = 32, 8, 128  # Qwen3-4B: query heads, KV heads, head width


def dense_attention(q, k, v):
  """The pre-issue-13 dense attention: float32 scores, a `[T, T]` causal mask."""
  b, t, n, d = q.shape
  q = q.reshape(b, t, K, n // K, d)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None, None], s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, n, d)


def temp_bytes(attention, tokens: int) -> int:
  """Compiled scratch bytes of forward + backward of `attention` at `tokens` tokens."""
  q = jax.ShapeDtypeStruct((1, tokens, N, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, tokens, K, D), jnp.bfloat16)
  loss = lambda q, k, v, w: jnp.sum(attention(q, k, v).astype(jnp.float32) * w)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  compiled = grad.lower(q, kv, kv, jax.ShapeDtypeStruct((1, tokens, N, D), jnp.float32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--block", type=int, default=tr.DEFAULT_ATTN_BLOCK)
  args = parser.parse_args()
  gib = 2.0**30
  blockwise = temp_bytes(lambda q, k, v: tr.causal_attention(q, k, v, args.block), args.tokens)
  dense = temp_bytes(dense_attention, args.tokens)
  print(f"attention forward+backward, 1 layer, {args.tokens} tokens, {N} q / {K} kv heads x {D}, bf16 "
        f"({jax.default_backend()}):")
  print(f"  blockwise (block {args.block}): {blockwise / gib:8.3f} GiB temp")
  print(f"  dense:                 {dense / gib:8.3f} GiB temp")
  print(f"  ratio dense / blockwise: {dense / blockwise:.1f}x")


if __name__ == "__main__":
  main()
