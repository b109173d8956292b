"""The decode step's TPU cache writes (`sampling.decode.write_keys` / `write_values`, which keep
XLA:TPU from copying the KV cache: tests/test_aot.py) write what the scatters of the CPU path
write, bit for bit: capacities below, at and not a multiple of their 128-position blocks, and
positions at either end of a block and of the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oapl_jax.sampling.decode import write_keys, write_values


@pytest.mark.parametrize("size", [14, 128, 300])
def test_tpu_cache_writes_equal_the_scatters(size):
  b, heads, d = 6, 2, 8
  ks = jax.random.split(jax.random.key(size), 4)
  k_cache = jax.random.normal(ks[0], (b, heads, d, size), jnp.bfloat16)
  v_cache = jax.random.normal(ks[1], (b, heads, size, d), jnp.bfloat16)
  k = jax.random.normal(ks[2], (b, heads, d), jnp.bfloat16)
  v = jax.random.normal(ks[3], (b, heads, d), jnp.bfloat16)
  positions = jnp.array([0, size - 1, min(127, size - 1), min(128, size - 1), size // 2, 5], jnp.int32)
  rows = jnp.arange(b)
  want_k = k_cache.at[rows, :, :, positions].set(k)
  want_v = v_cache.at[rows, :, positions].set(v)
  got_k = jax.jit(write_keys)(k_cache, k, positions)
  got_v = jax.jit(write_values)(v_cache, v, positions)
  np.testing.assert_array_equal(np.asarray(got_k).view(np.uint16), np.asarray(want_k).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(got_v).view(np.uint16), np.asarray(want_v).view(np.uint16))
  assert not np.array_equal(np.asarray(want_k), np.asarray(k_cache))  # the writes changed something
