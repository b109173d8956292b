"""model.lora.merge (issue 63 point 2): "in_refresh" keeps no merged copy of the weights between
refreshes (the engines' refresh merges each layer as it lays it out) and gives the run of "kept"
bit for bit; the planner's bytes differ by the merged copy; `gsm8k.py:lora_4b_l4` fits an L4."""

import gc
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from configs import tiny
from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(merge: str):
  c = tiny.get_config("smoke")
  c.model.lora.rank, c.model.lora.alpha, c.model.lora.merge = 4, 8.0, merge
  c.train.lr = 2e-2  # the adapters move far in a few steps: pi_old's merged weights differ from the base
  return c


def _held_bytes(before: list) -> int:
  """Bytes of the device arrays alive now that were not in `before` (a list of the arrays alive
  earlier, held so that their ids are not reused)."""
  gc.collect()
  old = {id(x) for x in before}
  return sum(x.nbytes for x in jax.live_arrays() if id(x) not in old and not x.is_deleted())


def _run(merge: str, tmp_path) -> dict:
  """Six steps (refreshes after steps 3 and 6) of a tiny LoRA run; its metrics, the engines'
  weights after each refresh, and the bytes the run holds on the devices after the last."""
  c = _config(merge)
  config_lib.validate(c)
  gc.collect()
  before = jax.live_arrays()  # a run made earlier in this process may leave arrays behind
  r = train.Run(c, str(tmp_path / merge))
  metrics, engines = [], []
  for _ in range(c.train.steps):
    metrics.append(r.step())
    if r.counters.step % c.rl.lag == 0:
      engines.append(jax.tree.map(np.asarray, r.engine_weights()))
  r.wait()
  base = sum(x.nbytes for x in jax.tree.leaves(r.base))
  held = _held_bytes(before)
  r.close()
  return {"metrics": metrics, "engines": engines, "held": held, "base": base, "run": r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora_merge")
  kept = _run("kept", tmp)
  kept.pop("run")
  gc.collect()
  return kept, _run("in_refresh", tmp)


KEYS = ("loss", "reward_mean", "grad_norm", "answer_length", "trainer_vs_sampler_abs", "policy_version")


def test_in_refresh_merge_is_the_kept_merge_bit_for_bit(runs):
  """Same losses, rewards, grad norms, trainer/engine log-prob gaps at every step, and the
  engines' weights after each refresh bit-equal; the adapters moved pi_old off the base (the
  merge matters: a refresh that left the adapters out fails here)."""
  kept, fused = runs
  assert [{k: m[k] for k in KEYS} for m in fused["metrics"]] == [{k: m[k] for k in KEYS} for m in kept["metrics"]]
  assert sum(abs(m["loss"]) > 0 for m in kept["metrics"]) >= 3
  assert len(kept["engines"]) == len(fused["engines"]) == 2
  for got, want in zip(fused["engines"], kept["engines"]):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert x.dtype == y.dtype and np.array_equal(x, y)
  r = fused["run"]
  unmerged = r.sampler.replicas.load_params(r.base, version=r.counters.version)  # the base alone
  diffs = [np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max()
           for x, y in zip(jax.tree.leaves(unmerged), jax.tree.leaves(fused["engines"][-1]))]
  assert max(diffs) > 1e-3


def test_in_refresh_holds_one_merged_copy_less(runs):
  """On the devices after a refresh and its rollout: "in_refresh" holds exactly the base's bytes
  (the merged copy, model.dtype) less than "kept"."""
  kept, fused = runs
  assert kept["base"] == fused["base"] > 0
  assert kept["held"] - fused["held"] == kept["base"], (kept["held"], fused["held"], kept["base"])


def test_the_planner_counts_the_merged_copy_only_when_kept():
  """lora_4b on an L4: "kept" plans the merged copy and does not fit; "in_refresh" (lora_4b_l4)
  plans no merged copy but one block's merge at the refresh, and fits."""
  from configs import gsm8k  # noqa: PLC0415
  from oapl_jax import plan  # noqa: PLC0415
  plans = {}
  for arg in ("lora_4b", "lora_4b_l4"):
    c = gsm8k.get_config(arg)
    c.mesh.topology = "l4x1"
    plans[arg] = plan.make_plan(c)
  kept = {i.name: i.nbytes for i in plans["lora_4b"].items}
  fused = {i.name: i.nbytes for i in plans["lora_4b_l4"].items}
  assert kept["merged weights"] == kept["frozen base"] > 7 * 2**30
  assert "merged weights" not in fused and "refresh merge" not in kept
  assert 0 < fused["refresh merge"] < kept["frozen base"] / 10  # one of 36 blocks, in f32
  assert set(kept) - {"merged weights"} == set(fused) - {"refresh merge"}
  assert all(kept[k] == fused[k] for k in kept if k != "merged weights")
  assert (plans["lora_4b"].total - plans["lora_4b_l4"].total
          == kept["merged weights"] - fused["refresh merge"])
  assert not plans["lora_4b"].fits and plans["lora_4b_l4"].fits, plans["lora_4b_l4"].format()


def test_a_bad_merge_setting_is_refused_in_one_line():
  c = _config("merged")
  with pytest.raises(ConfigError, match="model.lora.merge"):
    config_lib.validate(c)


MESH = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from configs import tiny
    from oapl_jax import sharding
    from oapl_jax.models import build, lora
    from oapl_jax.sampling.layout import EngineLayout, MergeOnLoad, engine_mesh, load_weights

    assert jax.device_count() == 4
    c = tiny.get_config("smoke")
    c.model.lora.rank, c.model.lora.alpha, c.model.dtype = 4, 8.0, "bfloat16"
    c.mesh.fsdp = 4
    mesh = sharding.make_mesh(c.mesh, jax.devices())
    cfg, _, base = build.init_model(c, mesh=mesh, param_dtype=c.model.dtype)
    _, adapters = build.init_adapters(c, mesh=mesh)
    keys = iter(jax.random.split(jax.random.key(3), 1000))
    moved = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    adapters = jax.device_put(moved, jax.tree.map(lambda x: x.sharding, adapters))
    scale = c.model.lora.alpha / c.model.lora.rank
    merged = jax.jit(lambda b, a: lora.merged(b, a, scale),
                     out_shardings=jax.tree.map(lambda x: x.sharding, base))(base, adapters)
    layout = EngineLayout(cfg, tensor=2, rules=c.sharding.rules)
    meshes = [engine_mesh(jax.devices()[0:2]), engine_mesh(jax.devices()[2:4])]
    want = load_weights(merged, 1, layout, meshes)
    got = load_weights(MergeOnLoad(base, adapters, scale), 1, layout, meshes)
    plain = load_weights(base, 1, layout, meshes)
    for g, w, p in zip(got, want, plain):
      for x, y, z in zip(jax.tree.leaves(g), jax.tree.leaves(w), jax.tree.leaves(p)):
        assert x.sharding == y.sharding and x.dtype == y.dtype == z.dtype
        assert np.array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    moved = [np.abs(np.asarray(x, np.float32) - np.asarray(z, np.float32)).max()
             for x, z in zip(jax.tree.leaves(got[0]), jax.tree.leaves(plain[0]))]
    assert max(moved) > 1e-3, moved
    print("OK")
""")


def test_in_refresh_merge_on_a_mesh_in_bfloat16():
  """A bfloat16 base sharded fsdp 4 over 4 devices, two engines of tensor 2: the refresh's merge
  gives each engine the weights `lora.merged` then the re-layout give, bit for bit, shardings
  alike."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  out = subprocess.run([sys.executable, "-c", MESH], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
