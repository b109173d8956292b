"""The engine on a mesh (issue 13 item 5): tensor-parallel replicas, one copy of the weights,
the refresh from the trainer's layout on device.

Multi-device checks run in a child process with 8 fake CPU devices (JAX fixes its device count
when it starts); the rest runs here on one device.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import tiny
from oapl_jax import config as config_lib
from oapl_jax.config import ConfigError
from oapl_jax.models import ModelConfig, Transformer
from oapl_jax.models.presets import PRESETS
from oapl_jax.sampling import Engine, SamplingParams
from oapl_jax.sampling.engine import engine_settings
from oapl_jax.sampling.layout import EngineLayout, engine_bytes
from oapl_jax.sampling.sampler import make_replicas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Common to the child scripts: two small models (tied + QK-norm; untied + qkv bias), engines.
SETUP = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from oapl_jax import config as config_lib, sharding
    from oapl_jax.models import ModelConfig, Transformer
    from oapl_jax.rl.logprobs import make_batch, token_logprobs
    from oapl_jax.sampling import Engine, SamplingParams, rollout
    from oapl_jax.sampling.engine import engine_settings
    from oapl_jax.sampling.layout import engine_mesh
    from oapl_jax.sampling.parallel import Replicas

    devices = jax.devices()
    assert len(devices) == 8, devices
    RULES = config_lib.defaults("tiny_addition").sharding.rules
    SETTINGS = {**engine_settings(config_lib.defaults("tiny_addition").sampling),
                "steps_per_call": 4, "cache_bucket": 8, "min_decode_width": 2}
    SAMPLING = SamplingParams(temperature=0.8, top_p=0.9)

    def small(**kw):
      cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, mlp_dim=128, **kw)
      model = Transformer(cfg, rngs=nnx.Rngs(0))
      model.embed[...] = model.embed[...] * 15.0  # peaked distributions: top-p truncates
      graphdef, params = nnx.split(model, nnx.Param)
      return cfg, graphdef, params

    def engine(cfg, graphdef, mesh, slots=4):
      return Engine(graphdef, cfg, SAMPLING, max_slots=slots, max_prefill_length=8, max_len=24,
                    mesh=mesh, rules=RULES, **SETTINGS)

    rng = np.random.default_rng(0)
    PROMPTS = [list(rng.integers(3, 40, size=int(rng.integers(2, 8)))) for _ in range(5)]
    KW = dict(group_size=2, max_new_tokens=12, eos_id=1, pad_id=0)
    gap = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())  # arrays on any devices
    leaves_equal = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
""")

# A tensor-2 engine computes what the one-device engine computes: prefill logits and keys,
# decode logits step by step, the sampled tokens and their log-probs; its KV cache is split
# over KV heads and its next-token logits are replicated.
TENSOR = SETUP + textwrap.dedent(r"""
    worst = 0.0
    for kw in (dict(qk_norm=True), dict(qk_norm=False, qkv_bias=True, tie_embeddings=False)):
      cfg, graphdef, params = small(**kw)
      one = engine(cfg, graphdef, engine_mesh(devices[:1]))
      two = engine(cfg, graphdef, engine_mesh(devices[2:4]))
      w1, w2 = one.load_params(params, version=5), two.load_params(params, version=5)
      qkv = w2.decode["layers"][0]["qkv"]
      assert qkv.sharding.spec == P(None, "tensor", None), qkv.sharding
      assert {s.data.shape for s in qkv.addressable_shards} == {(64, 1, (4 + 2 * 2) // 2 * 16)}
      assert w2.params["layers"][0]["attn"]["q_proj"].get_value() is None  # held once: fused
      tokens = np.array([[3, 7, 9, 11, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0, 0, 0]], np.int32)
      lengths = np.array([4, 2], np.int32)
      p1, p2 = one.prefill_batch(w1, tokens, lengths), two.prefill_batch(w2, tokens, lengths)
      worst = max(worst, gap(p1["logits"], p2["logits"]))
      for (k1, v1), (k2, v2) in zip(p1["kvs"], p2["kvs"]):
        worst = max(worst, gap(k1, k2), gap(v1, v2))
        assert k2.sharding.spec == P(None, None, "tensor", None)
      key = jax.random.key(3)
      s1, s2 = (e.init_decode_state(key, eos_id=-1) for e in (one, two))
      s1 = one.insert_many(p1, s1, np.array([0, 1, 2]), np.array([0, 0, 1]), np.array([9, 9, 9]))
      s2 = two.insert_many(p2, s2, np.array([0, 1, 2]), np.array([0, 0, 1]), np.array([9, 9, 9]))
      for _ in range(6):
        s1, t1 = one.generate(w1, s1)
        s2, t2 = two.generate(w2, s2)
        np.testing.assert_array_equal(t1.data, t2.data)  # same tokens sampled
        worst = max(worst, gap(t1.log_probs, t2.log_probs), gap(s1["next_logits"], s2["next_logits"]))
      k, v = s2["cache"]["k"][0], s2["cache"]["v"][0]  # [S, K, D, M], [S, K, M, D]
      assert k.sharding.spec == v.sharding.spec == P(None, "tensor", None, None)
      assert {s.data.shape[1] for s in k.addressable_shards} == {1}  # one KV head per device
      assert s2["next_logits"].sharding.is_fully_replicated
      # A decode call moves activations only (weights and cache stay split): every collective's
      # result is at most [S, V] (the logits' all-gather) or [S, E] (all-reduces) elements.
      hlo = two._generate_steps.lower(w2, s2, np.int32(1)).compile().as_text()
      moved = re.findall(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute)", hlo)
      assert {op for _, op in moved} == {"all-gather", "all-reduce"}, moved
      assert max(np.prod([int(n) for n in shape.split(",")]) for shape, _ in moved) <= 4 * 64, moved
      if not cfg.tie_embeddings:
        continue
      # Whole rollouts: the same answers; the log-probs are the trainer's on the same tokens.
      r1 = rollout(one, w1, PROMPTS, key=key, **KW)
      r2 = rollout(two, w2, PROMPTS, key=key, **KW)
      np.testing.assert_array_equal(r1.answers, r2.answers)
      assert (r2.versions == 5).all()
      worst = max(worst, gap(r1.logprobs, r2.logprobs))
      batch = make_batch(r2, np.zeros(r2.num_samples), seq_len=24, pad_id=0)
      logp, _ = token_logprobs(nnx.merge(graphdef, params), batch.tokens, SAMPLING)
      trainer = float(np.abs(np.where(batch.mask > 0, np.asarray(logp) - batch.sampler_logprobs, 0)).max())
      assert trainer <= 1e-5, trainer
    assert worst <= 1e-5, worst
    print("OK worst", worst)
""")

# The refresh: pi_theta sharded over the trainer's mesh (fsdp 4 x tensor 2 over 8 devices) ->
# 2 replicas x tensor 2, on device: under JAX's transfer guards, equal to loading the same
# weights from one device, and the engines sample the same. Then async placement: engines on
# their own devices (the last 4), the trainer's pi_theta on the first 4.
REFRESH = SETUP + textwrap.dedent("""
    cfg, graphdef, params = small(qk_norm=True)
    trainer = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tensor"))
    with jax.set_mesh(trainer):
      sharded = jax.device_put(params, sharding.param_shardings(params, trainer, RULES))
    assert sharded["layers"][0]["attn"]["q_proj"].get_value().sharding.spec == P("fsdp", "tensor", None)
    make = lambda mesh: engine(cfg, graphdef, mesh)
    replicas = Replicas(make, 2, devices[:4], tensor=2)
    assert [list(m.devices.flat) for m in replicas.meshes] == [devices[0:2], devices[2:4]]
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
         jax.transfer_guard_device_to_host("disallow_explicit"):
      reference = replicas.load_params(params, version=3)  # from one device: shards cut there
      jax.block_until_ready(reference)
    with jax.transfer_guard("disallow"):
      weights = replicas.load_params(sharded, version=3)
      jax.block_until_ready(weights)
    with jax.transfer_guard_host_to_device("disallow_explicit"), \\
         jax.transfer_guard_device_to_host("disallow_explicit"):
      again = replicas.load_params(sharded, version=4)
      jax.block_until_ready(again)
    assert int(again[1].version) == 4
    on = lambda w: {d for x in jax.tree.leaves(w) for d in x.devices()}
    for r in range(2):
      assert on(weights[r]) == set(devices[2 * r:2 * r + 2])
      assert leaves_equal(weights[r], reference[r])
      for x, y in zip(jax.tree.leaves(weights[r]), jax.tree.leaves(reference[r])):
        assert x.sharding == y.sharding
    a = replicas.rollout(weights, PROMPTS, key=jax.random.key(1), **KW)
    b = replicas.rollout(reference, PROMPTS, key=jax.random.key(1), **KW)
    np.testing.assert_array_equal(a.answers, b.answers)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.versions == 3).all()
    # async: the trainer on devices 0-3 (fsdp 2 x tensor 2), the engines on devices 4-7
    first = Mesh(np.array(devices[:4]).reshape(2, 2), ("fsdp", "tensor"))
    with jax.set_mesh(first):
      apart = jax.device_put(params, sharding.param_shardings(params, first, RULES))
    engines = Replicas(make, 2, devices[4:], tensor=2)
    with jax.transfer_guard_host_to_device("disallow_explicit"), \\
         jax.transfer_guard_device_to_host("disallow_explicit"):
      moved = engines.load_params(apart, version=3)
      jax.block_until_ready(moved)
    for r in range(2):
      assert on(moved[r]) == set(devices[4 + 2 * r:6 + 2 * r])
      assert leaves_equal(moved[r], reference[r])
    c = engines.rollout(moved, PROMPTS, key=jax.random.key(1), **KW)
    np.testing.assert_array_equal(a.answers, c.answers)
    print("OK")
""")

# The refresh from fsdp 8 (pi_theta's embedding dimension split 8 ways) to 4 replicas x tensor
# 2, in float32 (no cast: straight from the trainer's split to the engine's, XLA:SPMD gathered
# o_proj and down_proj whole onto every device, warning of an "involuntary full
# rematerialization"); through `EngineLayout.staging_steps` it does not, and the weights are
# those loaded from one device.
FSDP8_REFRESH = SETUP + textwrap.dedent("""
    cfg, graphdef, params = small()
    trainer = Mesh(np.array(devices).reshape(8, 1), ("fsdp", "tensor"))
    with jax.set_mesh(trainer):
      sharded = jax.device_put(params, sharding.param_shardings(params, trainer, RULES))
    assert sharded["layers"][0]["attn"]["o_proj"].get_value().sharding.spec[-1] == "fsdp"
    replicas = Replicas(lambda mesh: engine(cfg, graphdef, mesh), 4, devices, tensor=2)
    reference = replicas.load_params(params, version=1)
    weights = replicas.load_params(sharded, version=1)
    for r in range(4):
      assert leaves_equal(weights[r], reference[r])
    print("OK")
""")


# The run's placement: max_slots a total over the engines; sync engines on the first devices,
# async ones on the last (the trainer keeps the rest); the devices a run asks for. Then the
# loop with tensor-2 engines.
PLACEMENT = SETUP + textwrap.dedent("""
    from configs import tiny
    from oapl_jax.models.build import init_model
    from oapl_jax.placement import devices_wanted
    from oapl_jax.rl.loop import engine_devices
    from oapl_jax.sampling.sampler import make_replicas
    c = tiny.get_config("smoke")
    c.sampling.engines, c.sampling.tensor, c.sampling.max_slots = 2, 2, 16
    config_lib.validate(c)
    model_cfg, graphdef, params = init_model(c)
    assert devices_wanted(c) == 4 and engine_devices(c)[:4] == devices[:4]
    replicas = make_replicas(c, model_cfg, graphdef, SAMPLING, engine_devices(c))
    assert [e.max_concurrent_decodes for e in replicas.engines] == [8, 8]
    assert replicas.devices == devices[:4]
    c.rl.mode = "async"
    assert devices_wanted(c) == 5 and engine_devices(c) == devices[4:]
    replicas = make_replicas(c, model_cfg, graphdef, SAMPLING, engine_devices(c))
    assert [list(m.devices.flat) for m in replicas.meshes] == [devices[4:6], devices[6:8]]
    c.sampling.tensor = 1
    assert engine_devices(c) == devices[6:]  # trainer on devices 0-5
    c.sampling.engines, c.sampling.max_slots = 8, 64  # too many to keep a trainer device: shared
    assert engine_devices(c) == devices
    # The loop with 2 engines x tensor 2: the engines' log-probs are the trainer's, refreshes on.
    import tempfile
    from oapl_jax import train
    c = tiny.get_config("smoke")
    c.sampling.engines, c.sampling.tensor, c.sampling.max_slots = 2, 2, 64
    run = train.Run(c, tempfile.mkdtemp())
    metrics = [run.step() for _ in range(4)]  # a refresh after step 3 (rl.lag = 3)
    assert run.counters.version == 1
    gaps = [m["engine_mismatch_abs"] for m in metrics if "engine_mismatch_abs" in m]
    assert gaps and max(gaps) < 1e-5, gaps
    on = lambda w: {d for x in jax.tree.leaves(w) for d in x.devices()}
    assert [on(w) for w in run.engine_weights()] == [set(devices[0:2]), set(devices[2:4])]
    # The loop's own refresh, both halves (pi_old <- pi_theta on the trainer's mesh, then the
    # engines' copy), makes no trip through the host: an explicit host-to-device copy (what
    # routing a shard through numpy takes) is refused here; jax.transfer_guard("disallow")
    # would not catch it, and device-to-host guards do nothing on CPU.
    with jax.transfer_guard_host_to_device("disallow_explicit"):
      run.refresh_engine()
      fresh = run.engine_weights()
      jax.block_until_ready(fresh)
    assert [int(w.version) for w in fresh] == [2, 2] and [on(w) for w in fresh] == [set(devices[0:2]), set(devices[2:4])]
    print("OK")
""")


def _child(script):
  """Runs `script` in a fresh Python with 8 CPU devices and checks it said OK."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=900, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout, out.stdout
  return out.stdout


def test_tensor_two_engine_equals_one_device():
  print(_child(TENSOR))


def test_refresh_from_trainer_sharding_on_device():
  _child(REFRESH)


def test_refresh_from_fsdp8_makes_no_full_rematerialization():
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run([sys.executable, "-c", FSDP8_REFRESH], env=env, capture_output=True,
                       text=True, timeout=900, cwd=REPO)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
  assert "Involuntary full rematerialization" not in out.stderr, out.stderr[-3000:]


def test_placement_and_slots_over_engines():
  _child(PLACEMENT)


# --- one device -------------------------------------------------------------------------------


def _fused_before(cfg: ModelConfig, params):
  """Shapes of the fused matrices the engine held besides the plain weights before (q|k|v,
  gate|up and the head, in the snapshot's dtype): the engine layout's fused part on one
  device with no cast (the same matrices, reshaped `[E, 1, X]`)."""
  uncast = ModelConfig(**{**cfg.__dict__, "dtype": cfg.param_dtype})
  return jax.eval_shape(EngineLayout(uncast).relayout, params)[1]


def _model_bytes(params, dtype) -> int:
  """Bytes of the model's weights in the compute dtype (RMSNorm scales kept as they are)."""
  return sum(x.size * (x.dtype.itemsize if x.ndim == 1 else jnp.dtype(dtype).itemsize)
             for x in jax.tree.leaves(params))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_holds_one_copy_in_compute_dtype(small_model, dtype):
  """EngineParams is the model once, in compute dtype; before, it held the plain weights and
  the fused q/k/v, gate/up and head matrices besides."""
  cfg, graphdef, params = small_model
  cfg = ModelConfig(**{**cfg.__dict__, "dtype": dtype})
  engine = Engine(graphdef, cfg, SamplingParams(), max_slots=2, max_prefill_length=8, max_len=16,
                  **engine_settings(config_lib.defaults("tiny_addition").sampling))
  weights = engine.load_params(params, version=0)
  plain = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))  # float32 pi_theta
  held = engine_bytes(weights) - weights.version.nbytes
  assert held == _model_bytes(params, dtype)
  kinds = {x.dtype for x in jax.tree.leaves(weights.decode)}
  assert kinds == {jnp.dtype(dtype)}
  norms = {x.dtype for x in jax.tree.leaves(weights.params) if x.ndim == 1}
  assert norms == {jnp.dtype("float32")}  # read in float32 by the model: kept
  old = plain + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      _fused_before(cfg, params)))
  print(f"{dtype}: EngineParams {held} B = {held / _model_bytes(params, dtype):.3f}x the model in "
        f"{dtype}; before: {old} B = {old / _model_bytes(params, dtype):.2f}x")


def test_engine_bytes_of_a_real_model():
  """Qwen3-4B (abstract shapes): the engine's copy is the model once in bfloat16 (8.0 GB),
  not params plus fused matrices."""
  cfg = ModelConfig(**{**PRESETS["qwen3_4b"], "param_dtype": "float32", "dtype": "bfloat16"})
  _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  rest, fused = jax.eval_shape(EngineLayout(cfg).relayout, abstract)
  held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((rest, fused)))
  model = _model_bytes(abstract, "bfloat16")
  assert held == model
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  decode = _fused_before(cfg, abstract)
  old = size(abstract) + size(decode)  # before: the float32 snapshot as given, plus its fused copies
  print(f"qwen3_4b: EngineParams {held / 2**30:.2f} GiB = 1.00x the bf16 model; before: params "
        f"{size(abstract) / 2**30:.2f} GiB + fused {size(decode) / 2**30:.2f} GiB = {old / model:.2f}x")
  assert size(decode) > 0.6 * size(abstract)  # the second copy this removes: q, k, v, gate, up, head


def test_tensor_that_does_not_split_heads_is_a_config_error(small_model):
  cfg, graphdef, _ = small_model
  c = tiny.get_config("smoke")
  c.sampling.tensor = 3  # the model has 2 KV heads
  with pytest.raises(ConfigError, match=r"sampling.tensor=3: must divide model.num_kv_heads=2"):
    make_replicas(c, cfg, graphdef, SamplingParams())
  with pytest.raises(ConfigError, match="sampling.tensor=4"):
    EngineLayout(cfg, 4)


def test_too_few_devices_names_engines_and_tensor(small_model):
  cfg, graphdef, _ = small_model
  c = tiny.get_config("smoke")
  c.sampling.tensor = 2
  with pytest.raises(ConfigError, match=r"sampling.engines=1 x sampling.tensor=2 needs 2 devices"):
    make_replicas(c, cfg, graphdef, SamplingParams(), jax.local_devices()[:1])
