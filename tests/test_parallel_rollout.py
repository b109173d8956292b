"""parallel_rollout over two host devices (its own process: the device count is fixed at start)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from oapl_jax.models import ModelConfig, Transformer
    from oapl_jax.rl.logprobs import make_batch, token_logprobs
    from oapl_jax.sampling import Engine, SamplingParams, rollout
    from oapl_jax.sampling.parallel import parallel_rollout, shard_engines

    assert len(jax.devices()) == 2, jax.devices()
    cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, qk_norm=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.embed[...] = model.embed[...] * 15.0
    graphdef, params = nnx.split(model, nnx.Param)
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    make = lambda: Engine(graphdef, cfg, sampling, max_slots=4, max_prefill_length=8, max_len=20)
    shards = shard_engines(make, params)
    assert [s[0] for s in shards] == jax.devices()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 40, size=int(rng.integers(2, 8)))) for _ in range(5)]
    kw = dict(group_size=2, max_new_tokens=10, eos_id=1, pad_id=0)
    key = jax.random.key(7)
    ro = parallel_rollout(shards, prompts, key=key, **kw)
    again = parallel_rollout(shards, prompts, key=key, **kw)
    assert ro.prompts == prompts and ro.num_samples == 10
    np.testing.assert_array_equal(ro.answers, again.answers)  # deterministic given the key
    for i, (device, engine, weights) in enumerate(shards):  # row order: shard i has prompts i::2
      alone = rollout(engine, weights, prompts[i::2], key=jax.random.fold_in(key, i), **kw)
      rows = np.concatenate([np.arange(p * 2, p * 2 + 2) for p in range(i, 5, 2)])
      np.testing.assert_array_equal(ro.lengths[rows], alone.lengths)
      for r, a in zip(rows, range(alone.num_samples)):
        n = alone.lengths[a]
        np.testing.assert_array_equal(ro.answers[r, :n], alone.answers[a, :n])
    batch = make_batch(ro, np.zeros(10), seq_len=20, pad_id=0)  # the log-prob contract, merged
    logp, _ = token_logprobs(nnx.merge(graphdef, params), batch["tokens"], sampling)
    err = np.abs(np.where(batch["mask"] > 0, np.asarray(logp) - batch["sampler_logprobs"], 0)).max()
    assert err <= 1e-5, err
    print("OK", err)
""")


def test_parallel_rollout_on_two_host_devices():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout
