"""The sharding rules table (config.sharding.rules, oapl_jax/sharding.py) and models.build.

Eight-device checks run in a child process: JAX fixes its CPU device count when it starts.
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from configs import tiny
from oapl_jax import config as config_lib
from oapl_jax import sharding
from oapl_jax.config import ConfigError, validate
from oapl_jax.models import ModelConfig, Transformer, to_hf
from oapl_jax.models.build import init_model, init_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every kind of weight -> its PartitionSpec under the default rules (fsdp over E, tensor over
# F and heads, the vocabulary over both with the embedding's E whole; head width and norms
# replicated).
EXPECTED = {
    "embed": (("tensor", "fsdp"), None), "lm_head": (None, ("tensor", "fsdp")),
    "q_proj": ("fsdp", "tensor", None), "k_proj": ("fsdp", "tensor", None),
    "v_proj": ("fsdp", "tensor", None), "o_proj": ("tensor", None, "fsdp"),
    "q_bias": ("tensor", None), "k_bias": ("tensor", None), "v_bias": ("tensor", None),
    "gate_proj": ("fsdp", "tensor"), "up_proj": ("fsdp", "tensor"), "down_proj": ("tensor", "fsdp"),
    "q_norm": (None,), "k_norm": (None,), "input_norm": (None,), "post_attn_norm": (None,),
    "final_norm": (None,),
}


def _kind(path) -> str:
  """The EXPECTED key of a parameter path: ("layers", 0, "attn", "q_norm", "weight") -> "q_norm"."""
  return str(path[-2] if path[-1] == "weight" else path[-1])


def _every_weight_config():
  """defaults() of a tiny model with every kind of weight: QK-norm, qkv bias, untied head."""
  c = config_lib.defaults("tiny_qwen2")
  c.model.qk_norm = True
  return c


def _flat(params):
  return [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(params)]


def _bit_equal(a, b) -> bool:
  fa, fb = _flat(a), _flat(b)
  return [p for p, _ in fa] == [p for p, _ in fb] and all(
      x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
      for (_, x), (_, y) in zip(fa, fb))


def test_default_rules_give_each_weight_its_spec():
  c = _every_weight_config()
  abstract = nnx.eval_shape(lambda: Transformer(ModelConfig.from_config(c.model), rngs=nnx.Rngs(0)))
  seen = set()
  for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    spec = sharding.logical_to_spec(var.get_metadata()["logical_axes"], c.sharding.rules)
    assert spec == PartitionSpec(*EXPECTED[_kind(path)]), (path, spec)
    seen.add(_kind(path))
  assert seen == set(EXPECTED)


def test_rules_as_pairs_or_a_mapping():
  axes = ("embed", "mlp", "other")
  want = PartitionSpec(("data", "fsdp"), "tensor", None)
  assert sharding.logical_to_spec(axes, (("embed", ("data", "fsdp")), ("mlp", "tensor"))) == want
  assert sharding.logical_to_spec(axes, {"embed": ["data", "fsdp"], "mlp": ("tensor",)}) == want
  assert sharding.logical_to_spec(axes, (("embed", ()),)) == PartitionSpec(None, None, None)
  assert sharding.logical_to_spec(axes, None) == PartitionSpec(None, None, None)
  with pytest.raises(ValueError, match="'embed' has two rules"):
    sharding.logical_to_spec(axes, (("embed", "fsdp"), ("embed", None)))


def test_a_spec_that_does_not_fit_the_mesh_is_refused_by_weight_name():
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  with pytest.raises(ValueError, match="w: sharding rules name mesh axes \\['model'\\]"):
    sharding.named_sharding("w", (4, 4), ("embed",), mesh, {"embed": "model"})
  with pytest.raises(ValueError, match="w: mesh axes \\['fsdp'\\] would shard two dimensions"):
    sharding.named_sharding("w", (4, 4), ("embed", "mlp"), mesh, {"embed": "fsdp", "mlp": "fsdp"})


def _refused(rules, match: str) -> None:
  c = tiny.get_config()
  c.sharding.rules = rules
  with pytest.raises(ConfigError, match=match):
    validate(c)


def test_default_rules_cover_every_logical_axis_and_are_valid():
  from oapl_jax.models.names import LOGICAL_AXES
  c = tiny.get_config()
  assert {logical for logical, _ in c.sharding.rules} == set(LOGICAL_AXES) | {"batch"}
  assert dict(c.sharding.rules)["batch"] == ("data", "fsdp")  # a train step's batch rows
  c.sharding.rules = c.sharding.rules + (("activations", ("data", "fsdp")), ("cache", ()))
  validate(c)  # tuples of mesh axes, and rules for axes weights do not carry, are fine


def test_a_rule_naming_an_unknown_mesh_axis_is_refused():
  rules = tiny.get_config().sharding.rules
  i = [logical for logical, _ in rules].index("embed")
  _refused(rules[:i] + (("embed", "fsdpp"),) + rules[i + 1:],
           rf"config\.sharding\.rules\[{i}\]=\('embed', 'fsdpp'\): mesh axes 'fsdpp'")
  n = len(rules)  # the index of a rule appended to the table
  _refused(rules + (("cache", ("data", "model")),), rf"config\.sharding\.rules\[{n}\]=.*'model'")
  _refused(rules + (("cache", ("data", "data")),), rf"config\.sharding\.rules\[{n}\]=.*distinct")


def test_every_logical_axis_needs_a_rule_or_none():
  rules = tuple(r for r in tiny.get_config().sharding.rules if r[0] != "norm")
  _refused(rules, r"config\.sharding\.rules=.*no rule for logical axes \['norm'\]")
  c = tiny.get_config()
  c.sharding.rules = rules + (("norm", None),)
  validate(c)


def test_malformed_or_repeated_rules_are_refused():
  rules = tiny.get_config().sharding.rules
  _refused(rules + (("embed", None),), rf"config\.sharding\.rules\[{len(rules)}\]=.*'embed' already has a rule")
  _refused(rules + (("cache",),), rf"config\.sharding\.rules\[{len(rules)}\]=\('cache',\): must be a pair")


def _todays_init_model(config):
  """train.init_model as it was before models.build (random init branch): the reference."""
  model = Transformer(ModelConfig.from_config(config.model), rngs=nnx.Rngs(params=config.seed))
  return nnx.split(model, nnx.Param)


@pytest.mark.parametrize("seed", [0, 1])
def test_init_model_without_a_mesh_is_todays_init(seed):
  c = tiny.get_config()
  c.seed = seed
  model_cfg, graphdef, params = init_model(c)
  want_graphdef, want = _todays_init_model(c)
  assert model_cfg == ModelConfig.from_config(c.model) and graphdef == want_graphdef
  assert _bit_equal(params, want)


def test_jitted_init_equals_eager_init_bit_for_bit():
  """A one-device mesh: the init runs under jax.jit(out_shardings=...), values as eager."""
  c = _every_weight_config()
  c.model.param_dtype = "bfloat16"
  cfg = ModelConfig.from_config(c.model)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  graphdef, params = init_params(cfg, 3, mesh=mesh, rules=c.sharding.rules)
  want_graphdef, want = init_params(cfg, 3)
  assert graphdef == want_graphdef and _bit_equal(params, want)


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
  """A tiny_qwen2 Hugging Face folder (random weights of seed 5; no tokenizer)."""
  folder = str(tmp_path_factory.mktemp("tiny_qwen2"))
  to_hf(Transformer(ModelConfig.from_config(config_lib.defaults("tiny_qwen2").model),
                    rngs=nnx.Rngs(params=5)), folder)
  return folder


def test_init_model_loads_a_checkpoint_and_refuses_another_model(qwen2_checkpoint):
  from oapl_jax.models import from_hf
  c = config_lib.defaults("tiny_qwen2")
  c.model.path = qwen2_checkpoint
  model_cfg, _, params = init_model(c)
  assert model_cfg == ModelConfig.from_config(c.model)
  assert _bit_equal(params, nnx.state(from_hf(qwen2_checkpoint), nnx.Param))
  c.model.hidden_size = 32
  with pytest.raises(ConfigError, match="checkpoint of another model:\n  config.model.hidden_size=32 "
                     f"but {qwen2_checkpoint} has 64"):
    init_model(c)


EIGHT_DEVICES = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec
    from oapl_jax import config as config_lib, sharding
    from oapl_jax.models.build import init_model

    assert jax.device_count() == 8, jax.devices()
    folder, expected = sys.argv[1], eval(sys.argv[2])
    mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 2), sharding.MESH_AXES)  # fsdp 4 x tensor 2
    kind = lambda path: str(path[-2] if path[-1] == "weight" else path[-1])
    flat = lambda params: [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(params)]

    def check(c):  # sharded as the rules say, equal to the one-device model bit for bit
      _, graphdef, plain = init_model(c)
      _, sharded_graphdef, sharded = init_model(c, mesh=mesh)
      for (path, x), (same_path, y) in zip(flat(sharded), flat(plain)):
        spec = PartitionSpec(*expected[kind(path)])
        assert path == same_path and x.sharding.spec == spec, (path, x.sharding)
        split = [int(np.prod([mesh.shape[n] for n in ((a,) if isinstance(a, str) else a or ())]))
                 for a in spec]
        assert x.addressable_shards[0].data.shape == tuple(d // s for d, s in zip(x.shape, split))
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), path
      tokens = np.arange(12).reshape(2, 6)
      np.testing.assert_allclose(np.asarray(nnx.merge(sharded_graphdef, sharded)(tokens)),
                                 np.asarray(nnx.merge(graphdef, plain)(tokens)), atol=1e-5, rtol=0)

    def refused(c):  # K = 2 key/value heads over fsdp x tensor = 8 shards
      c.sharding.rules = tuple(r for r in c.sharding.rules if r[0] != "kv_heads") + (
          ("kv_heads", ("fsdp", "tensor")),)
      try:
        init_model(c, mesh=mesh)
      except ValueError as e:
        msg = str(e)  # the first weight with a K dimension: k_bias ("layers/0/attn/k_bias", HF name)
        assert "k_proj.bias" in msg or "attn/k_bias" in msg, msg
        assert "dimension 2 of shape" in msg and "does not divide" in msg, msg
      else:
        raise SystemExit("expected a divisibility error")

    c = config_lib.defaults("tiny_qwen2")
    c.model.qk_norm = True  # every kind of weight (no Hugging Face architecture has both)
    for dtype in ("float32", "bfloat16"):
      c.model.param_dtype = dtype
      check(c)
    refused(c)
    c = config_lib.defaults("tiny_qwen2")
    c.model.path = folder  # from_hf(mesh=, rules=config.sharding.rules)
    check(c)
    refused(c)
    print("OK")
""")


def test_init_and_load_sharded_on_8_fake_devices(qwen2_checkpoint):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run([sys.executable, "-c", EIGHT_DEVICES, qwen2_checkpoint, repr(EXPECTED)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout
