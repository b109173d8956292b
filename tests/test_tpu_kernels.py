"""The Pallas TPU kernels (`models/pallas_attention.py`) compute what the blockwise code does:
splash attention's values and gradients equal `causal_attention`'s, the decode kernel's output
`decode_attend`'s (float32, <= 1e-5), run here in Pallas interpret mode; and
`config.model.attention_kernel` picks them ("auto": TPU only)."""

import dataclasses
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from oapl_jax import config as config_lib
from oapl_jax.errors import ConfigError
from oapl_jax.models import ModelConfig, Transformer, init_cache, write_prefix
from oapl_jax.models import attention, pallas_attention
from oapl_jax.sampling import decode as decode_lib
from oapl_jax.sampling.layout import EngineLayout

TOL = 1e-5


def _qkv(b, t, n, kv, d, seed=0):
  """q `[B, T, N, D]` scaled by 1/sqrt(D), k, v `[B, T, K, D]`, float32."""
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, d)) * d**-0.5
  return q, jax.random.normal(ks[1], (b, t, kv, d)), jax.random.normal(ks[2], (b, t, kv, d))


def test_attention_impl_and_the_setting(monkeypatch):
  assert attention.attention_impl("auto") == "xla"  # these tests' CPU
  assert attention.attention_impl("pallas") == "pallas"
  with pytest.raises(ValueError, match="attention kernel 'splash'"):
    attention.attention_impl("splash")
  monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="tpu")])
  assert attention.attention_impl("auto") == "pallas"
  assert attention.attention_impl("xla") == "xla"
  monkeypatch.undo()
  with pytest.raises(ValueError, match="model.attention_kernel='splash'"):
    ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=8, mlp_dim=8, attention_kernel="splash")
  c = tiny.get_config("smoke")
  assert c.model.attention_kernel == "auto"
  assert ModelConfig.from_config(c.model).attention_kernel == "auto"
  c.model.attention_kernel = "splash"
  with pytest.raises(ConfigError, match="model.attention_kernel"):
    config_lib.validate(c, dry_run=True)


@pytest.mark.parametrize("b, t, n, kv", [
    (2, 200, 4, 2),  # GQA, T padded to 256: blocks of 256, the last 56 positions padding
    (1, 37, 2, 2),  # odd T, padded to 128; plain multi-head
])
def test_splash_equals_blockwise_values_and_gradients(b, t, n, kv):
  q, k, v = _qkv(b, t, n, kv, 16)
  d_out = jax.random.normal(jax.random.key(9), q.shape)  # a cotangent touching every output

  def run(kernel):
    out, vjp = jax.vjp(lambda q, k, v: attention.causal_attention(q, k, v, 64, kernel=kernel),
                       q, k, v)
    return (out, *vjp(d_out))

  splash, blockwise = jax.jit(lambda: run("pallas_interpret"))(), jax.jit(lambda: run("xla"))()
  for name, x, y in zip(("out", "dq", "dk", "dv"), splash, blockwise):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL, rtol=0, err_msg=name)


def test_splash_block():
  assert pallas_attention.splash_block(2048) == (2048, 512)
  assert pallas_attention.splash_block(2080) == (2304, 256)  # 2560 would pad 480 > 2080 / 8
  assert pallas_attention.splash_block(200) == (256, 256)
  assert pallas_attention.splash_block(37) == (128, 128)


def test_decode_chunk():
  assert pallas_attention.decode_chunk(4096, 1024) == 1024
  assert pallas_attention.decode_chunk(1536, 1024) == 768  # the largest 128-multiple divisor
  assert pallas_attention.decode_chunk(200, 1024) == 200  # the whole cache, <= chunk
  assert pallas_attention.decode_chunk(1000, 512) == 1000  # no 128-multiple divides: the whole cache
  assert pallas_attention.decode_chunk(40, 16, interpret=True) == 10


@pytest.mark.parametrize("size, chunk", [
    (40, 8),  # 5 chunks
    (40, 16),  # chunk 10 (divides 40); decode_attend's 16 overlaps its last chunk
])
def test_decode_kernel_equals_decode_attend(size, chunk):
  b, kv, g, d = 4, 2, 3, 16
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (b, kv, g, d)) * d**-0.5
  k_cache = jax.random.normal(ks[1], (b, kv, d, size))
  v_cache = jax.random.normal(ks[2], (b, kv, size, d))
  positions = jnp.array([0, 9, 23, size - 1])  # first index only, within and at chunk ends, last
  want = attention.decode_attend(q, k_cache, v_cache, positions, jnp.int32(size), chunk, kernel="xla")
  got = jax.jit(lambda *a: attention.decode_attend(*a, jnp.int32(size), chunk,
                                                   kernel="pallas_interpret"))(
      q, k_cache, v_cache, positions)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)


def test_model_forward_gradient_and_decode_through_the_kernels(monkeypatch):
  """`ModelConfig.attention_kernel` reaches both kernels: the forward pass, its weight
  gradient, and a prefill + decode step equal the blockwise model's."""
  calls = []
  for name in ("splash_causal_attention", "decode_attention"):
    kernel = getattr(pallas_attention, name)
    monkeypatch.setattr(pallas_attention, name,
                        lambda *a, kernel=kernel, name=name, **kw: calls.append(name) or kernel(*a, **kw))
  cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=64)
  models = {kernel: Transformer(dataclasses.replace(cfg, attention_kernel=kernel), rngs=nnx.Rngs(0))
            for kernel in ("xla", "pallas_interpret")}
  tokens = jax.random.randint(jax.random.key(2), (2, 21), 0, cfg.vocab_size)
  rows, cache_len, prompt_len = jnp.arange(2), 24, 20

  @nnx.jit
  def check(model):
    loss, grads = nnx.value_and_grad(lambda m: jnp.sin(m(tokens)).sum())(model)
    _, kvs = model(tokens[:, :prompt_len], return_kv=True)
    cache = write_prefix(init_cache(model.cfg, 2, cache_len), kvs, rows)
    graphdef, params = nnx.split(model, nnx.Param)
    rest, fused = EngineLayout(model.cfg, tensor=1).relayout(params)
    logits, _ = decode_lib.decode(nnx.merge(graphdef, rest), fused, tokens[:, prompt_len],
                                  jnp.full((2,), prompt_len), cache, live_len=jnp.int32(prompt_len + 1),
                                  chunk=8, rope_table=model.rope_table(cache_len))
    return loss, nnx.state(grads), logits

  want = check(models["xla"])
  assert not calls
  got = check(models["pallas_interpret"])
  assert set(calls) == {"splash_causal_attention", "decode_attention"}, calls
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4, rtol=1e-5)


_MESH_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from oapl_jax.models import attention
mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
ks = jax.random.split(jax.random.key(0), 6)
q = jax.random.normal(ks[0], (2, 40, 4, 16)) * 0.25
k, v = jax.random.normal(ks[1], (2, 40, 2, 16)), jax.random.normal(ks[2], (2, 40, 2, 16))
qd = jax.random.normal(ks[3], (2, 2, 2, 16)) * 0.25
kc, vc = jax.random.normal(ks[4], (2, 2, 16, 24)), jax.random.normal(ks[5], (2, 2, 24, 16))
pos = jnp.array([5, 23])
rows = NamedSharding(mesh, P("data", None, "tensor", None))
def run(kernel):
  def f(q, k, v, qd, kc, vc):
    out = attention.causal_attention(q, k, v, 16, kernel=kernel, batch_axes="data")
    grad = jax.grad(lambda q: attention.causal_attention(q, k, v, 16, kernel=kernel,
                                                         batch_axes="data").sum())(q)
    dec = attention.decode_attend(qd, kc, vc, pos, jnp.int32(24), 8, kernel=kernel)
    return out, grad, dec
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, rows) for x in (q, k, v)] + [qd, kc, vc]
    fn = jax.jit(f)
    if kernel != "xla":  # one Pallas call per device, inside a shard_map
      assert "shard_map" in str(jax.make_jaxpr(f)(*args)), "no shard_map"
    return fn(*args)
for name, x, y in zip(("out", "dq", "decode"), run("pallas_interpret"), run("xla")):
  np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0, err_msg=name)
print("OK")
"""


def test_kernels_under_a_mesh_run_per_device_and_equal_blockwise():
  """Under `jax.set_mesh` (4 fake CPU devices: rows over "data", heads over "tensor") the
  Pallas calls run inside a shard_map, with the blockwise numbers."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  done = subprocess.run([sys.executable, "-c", _MESH_CHECK], env=env, capture_output=True,
                        text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


# --- Compiled for a TPU by the TPU compiler (libtpu; skipped without it, failed in CI) -------

# Splash with segment ids (packed rows), forward + backward, bfloat16, compiled for the 4 chips
# of a v5p-8 slice under a ("data", "tensor") mesh: rows over "data", heads over "tensor", the
# segment ids split by rows into the kernel's shard_map. Prints the Mosaic kernels' names found
# in the compiled HLO.
_TPU_SPLASH_SEGMENTS = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from oapl_jax.models.attention import causal_attention
topology = topologies.get_topology_desc("v5:2x2x1", chip_config_name="megacore",
                                        chips_per_host_bounds=(2, 2, 1))
mesh = jax.sharding.Mesh(np.array(topology.devices).reshape(2, 2), ("data", "tensor"))
b, t, n, kv, d = 4, 1000, 8, 4, 128
rows = NamedSharding(mesh, P("data", None, "tensor", None))
sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rows)
seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))
def step(q, k, v, seg):
  fn = lambda q, k, v: causal_attention(q, k, v, segment_ids=seg, kernel="pallas", batch_axes="data")
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(out)
with jax.set_mesh(mesh):
  hlo = jax.jit(step).lower(sds(b, t, n, d), sds(b, t, kv, d), sds(b, t, kv, d), seg).compile().as_text()
names = [k for k in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv") if k in hlo]
print("COMPILED", hlo.count('custom_call_target="tpu_custom_call"'), " ".join(names))
"""


def _libtpu_path() -> str | None:
  """A PYTHONPATH entry under which libtpu imports ("" if this environment has it), or None
  (as tests/test_aot.py finds it: OAPL_LIBTPU_DIR, which .ci/run sets)."""
  import importlib.util  # noqa: PLC0415
  if importlib.util.find_spec("libtpu") is not None:
    return ""
  folder = os.environ.get("OAPL_LIBTPU_DIR")
  return folder if folder and os.path.isdir(os.path.join(folder, "libtpu")) else None


def test_splash_with_segment_ids_compiles_for_tpu():
  """The packed rows' splash call (segment ids, forward + backward, under a mesh) compiles for
  a TPU v5p with the TPU compiler: the forward, dq and dkv Mosaic kernels in the program."""
  from conftest import in_ci  # noqa: PLC0415
  path = _libtpu_path()
  if path is None:
    message = "libtpu not found (set OAPL_LIBTPU_DIR to a `pip install --no-deps --target DIR libtpu==...` folder)"
    if in_ci():
      pytest.fail(message, pytrace=False)
    pytest.skip(message)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, root) if p),
         "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"}
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-c", _TPU_SPLASH_SEGMENTS], cwd=root, env=env,
                        capture_output=True, text=True, timeout=1200)
  lines = [line for line in done.stdout.splitlines() if line.startswith("COMPILED")]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  calls, *names = lines[0].split()[1:]
  assert int(calls) >= 3 and names == ["splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"], lines
