"""Engine replicas (`sampling.engines`): sampling split over devices, in the sampler and the loop.

Two-device checks run in a child process: JAX fixes its CPU device count when it starts.
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.sampling import Engine, SamplingParams, rollout
from oapl_jax.sampling.engine import engine_settings
from oapl_jax.sampling.parallel import Replicas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAMPLER = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from oapl_jax.models import ModelConfig, Transformer
    from oapl_jax.rl.logprobs import make_batch, token_logprobs
    from oapl_jax import config as config_lib
    from oapl_jax.sampling import Engine, SamplingParams, rollout
    from oapl_jax.sampling.engine import engine_settings
    from oapl_jax.sampling.parallel import Replicas

    assert len(jax.devices()) == 2, jax.devices()
    defaults = engine_settings(config_lib.defaults("tiny_addition").sampling)
    cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, qk_norm=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.embed[...] = model.embed[...] * 15.0
    graphdef, params = nnx.split(model, nnx.Param)
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    make = lambda mesh: Engine(graphdef, cfg, sampling, max_slots=4, max_prefill_length=8,
                               max_len=20, mesh=mesh, **defaults)
    replicas = Replicas(make, 2)
    assert replicas.devices == jax.devices()
    weights = replicas.load_params(params, version=3)
    on = lambda w: {d for x in jax.tree.leaves(w) for d in x.devices()}
    assert [on(w) for w in weights] == [{d} for d in jax.devices()]
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 40, size=int(rng.integers(2, 8)))) for _ in range(5)]
    kw = dict(group_size=2, max_new_tokens=10, eos_id=1, pad_id=0)
    key = jax.random.key(7)
    ro = replicas.rollout(weights, prompts, key=key, **kw)
    again = replicas.rollout(weights, prompts, key=key, **kw)
    assert ro.prompts == prompts and ro.num_samples == 10
    assert (ro.versions == 3).all()
    np.testing.assert_array_equal(ro.answers, again.answers)  # deterministic given the key
    # prompt p's key is fold_in(key, p) whichever replica samples it: one engine, all prompts,
    # gives the same answers as two
    single = rollout(replicas.engines[0], weights[0], prompts, key=key, **kw)
    np.testing.assert_array_equal(ro.answers, single.answers)
    np.testing.assert_array_equal(ro.lengths, single.lengths)
    prompt_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, np.arange(5, dtype=np.uint32))
    # ... whichever slot it lands in (above, an answer may sit in the same slot in both runs, so a
    # key that depended on the slot would pass): an engine of 2 slots, one group at a time, so
    # answer g of every prompt is in slot g, given the prompts in another order with their own
    # keys, gives the replicas' answers (there prompts 0 and 3 sit in slots 2-3)
    narrow = Engine(graphdef, cfg, sampling, max_slots=2, max_prefill_length=8, max_len=20,
                    mesh=replicas.meshes[1], **defaults)
    order = [4, 1, 3, 0, 2]
    moved = rollout(narrow, narrow.load_params(params, version=3), [prompts[p] for p in order],
                    key=prompt_keys[np.array(order)], **kw)
    rows = np.concatenate([np.arange(p * 2, p * 2 + 2) for p in order])
    np.testing.assert_array_equal(moved.lengths, ro.lengths[rows])
    np.testing.assert_array_equal(moved.answers, ro.answers[rows])
    for i in range(2):  # row order: replica i has prompts i::2, with their own keys
      alone = rollout(replicas.engines[i], weights[i], prompts[i::2], key=prompt_keys[i::2], **kw)
      rows = np.concatenate([np.arange(p * 2, p * 2 + 2) for p in range(i, 5, 2)])
      np.testing.assert_array_equal(ro.lengths[rows], alone.lengths)
      for r, a in zip(rows, range(alone.num_samples)):
        n = alone.lengths[a]
        np.testing.assert_array_equal(ro.answers[r, :n], alone.answers[a, :n])
    batch = make_batch(ro, np.zeros(10), seq_len=20, pad_id=0)  # the log-prob contract, merged
    logp, _ = token_logprobs(nnx.merge(graphdef, params), batch.tokens, sampling)
    err = np.abs(np.where(batch.mask > 0, np.asarray(logp) - batch.sampler_logprobs, 0)).max()
    assert err <= 1e-5, err
    one = replicas.rollout(weights, prompts[:1], key=key, **kw)  # fewer prompts than replicas
    alone = rollout(replicas.engines[0], weights[0], prompts[:1], key=key, **kw)
    np.testing.assert_array_equal(one.answers, alone.answers)
    print("OK", err)
""")

# The loop with two engines, the way `python -m oapl_jax.main` starts it: host devices requested
# before JAX starts. A straight run and one stopped, checkpointed and resumed end the same.
# Then async mode: the engine samples on device 1 while the trainer trains on device 0.
LOOP = textwrap.dedent("""
    import sys
    from oapl_jax.placement import request_host_devices
    request_host_devices(2)
    import jax, numpy as np
    from configs import tiny
    from oapl_jax import train

    assert len(jax.devices()) == 2, jax.devices()
    out = sys.argv[1]
    c = tiny.get_config("smoke")
    c.sampling.engines, c.rl.lag, c.rl.groups_per_step, c.rl.groups_per_rollout = 2, 4, 2, 5
    c.sampling.max_slots *= 2  # a total over the engines: each keeps the smoke run's slots
    straight = train.Run(c, out + "/straight")
    metrics = [straight.step() for _ in range(6)]
    assert all(m["engine_mismatch_abs"] < 1e-5 for m in metrics if "engine_mismatch_abs" in m)
    first = train.Run(c, out + "/resumed")
    for _ in range(3):
      first.step()
    assert len(first.buffer) > 0  # the checkpoint carries a non-empty buffer
    first.save()
    second = train.Run(c, out + "/resumed")
    assert second.restore_latest() and second.counters.step == 3
    for _ in range(3):
      second.step()
    assert second.counters.version == straight.counters.version == 1
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(second.params, straight.params) and same(second.snapshot, straight.snapshot)
    on = lambda w: {d for x in jax.tree.leaves(w) for d in x.devices()}
    assert [on(w) for w in second.engine_weights()] == [{d} for d in jax.devices()]
    c.sampling.engines, c.rl.mode = 1, "async"  # the engine on device 1, the trainer on device 0
    overlapped = train.Run(c, out + "/async")
    assert overlapped.sampler.replicas.devices == [jax.devices()[1]]
    metrics = [overlapped.step() for _ in range(4)]
    assert metrics[0]["engine_mismatch_abs"] < 1e-5
    assert on(overlapped.params) == {jax.devices()[0]}
    overlapped.close()
    print("OK")
""")


def _child(script, *args, xla_flags=None):
  """Runs `script` in a fresh Python (JAX on CPU; XLA_FLAGS as given) and checks it said OK."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                       text=True, timeout=900, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout


def test_replicas_on_two_host_devices():
  _child(SAMPLER, xla_flags="--xla_force_host_platform_device_count=2")


def test_loop_with_two_engines_is_reproducible_and_resumes(tmp_path):
  _child(LOOP, str(tmp_path))  # the child asks for its host devices itself, as main does


def test_one_replica_is_a_plain_rollout(small_model):
  cfg, graphdef, params = small_model
  make = lambda mesh: Engine(graphdef, cfg, SamplingParams(temperature=0.8), max_slots=4,  # noqa: E731
                             max_prefill_length=8, max_len=20, mesh=mesh,
                             **engine_settings(config_lib.defaults("tiny_addition").sampling))
  replicas = Replicas(make, 1)
  prompts, key = [[3, 4, 5], [6, 7]], jax.random.key(1)
  kw = dict(group_size=2, max_new_tokens=8, eos_id=1, pad_id=0)
  got = replicas.rollout(params, prompts, key=key, **kw)
  want = rollout(replicas.engine, params, prompts, key=key, **kw)
  np.testing.assert_array_equal(got.answers, want.answers)
  np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_more_engines_than_devices_is_a_clear_error(smoke_config, tmp_path):
  smoke_config.sampling.engines = len(jax.local_devices()) + 1
  smoke_config.sampling.max_slots = 8 * smoke_config.sampling.engines  # a total over the engines
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    train.Run(smoke_config, str(tmp_path))
