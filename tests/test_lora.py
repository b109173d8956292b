"""Low-rank adapters (config.model.lora, oapl_jax/models/lora.py): zero init changes nothing,
a step moves only the adapters, sharded equals one device, the engine's merged weights keep
the log-prob contract, checkpoints resume bit for bit and refuse another base, and the PEFT
and merged exports reload in transformers / peft with the same logits."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from oapl_jax import train
from oapl_jax.checkpoint import OtherModelError
from oapl_jax.models import lora as lora_lib
from oapl_jax.models.transformer import Transformer
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import Engine, SamplingParams, rollout
from oapl_jax.sampling.engine import engine_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = lora_lib.LoraConfig(rank=4, alpha=8.0)


def _adapted(model: Transformer, seed: int = 0, b_scale: float = 0.0):
  """(graphdef, adapters, base) of `model` with adapters; B drawn at `b_scale` (0: the init)."""
  graphdef, adapters, base = nnx.split(lora_lib.attach(model, LORA, seed), nnx.LoRAParam, nnx.Param)
  if b_scale:
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: b_scale * jax.random.normal(next(keys), x.shape) if "lora_b" in jax.tree_util.keystr(p) else x,
        adapters)
  return graphdef, adapters, base


def _lora_config(rank=4):
  c = tiny.get_config("smoke")
  c.model.lora.rank, c.model.lora.alpha = rank, 8.0
  return c


def test_zero_init_adapters_leave_every_logit_and_the_merged_weights_bit_equal(small_model):
  cfg, graphdef, params = small_model
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11)))
  want = nnx.merge(graphdef, params)(tokens)
  lgraph, adapters, base = _adapted(nnx.merge(graphdef, params))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(params)))
  for remat in ("none", "full"):  # each against the plain model under the same policy
    got = nnx.merge(lgraph, adapters, base)(tokens, remat=remat)
    plain = nnx.merge(graphdef, params)(tokens, remat=remat)
    assert np.array_equal(np.asarray(got), np.asarray(plain)), remat
  merged = lora_lib.merged(base, adapters, LORA.scale)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))
  # and an adapter that is not zero does change them
  lgraph, adapters, base = _adapted(nnx.merge(graphdef, params), b_scale=0.05)
  assert not np.allclose(np.asarray(nnx.merge(lgraph, adapters, base)(tokens)), np.asarray(want), atol=1e-3)


def step_batch(c):
  """One step's batch of random rows (answers at positions 6-11, sampler log-probs -1, rewards 0
  or 1: non-zero advantages) for config `c` (also tests/test_quant.py's)."""
  from oapl_jax.rl.step import Batch  # noqa: PLC0415
  rng = np.random.default_rng(0)
  b, t = c.rl.groups_per_step * c.rl.group_size, 14
  tokens = rng.integers(3, c.model.vocab_size, (b, t)).astype(np.int32)
  mask = np.zeros((b, t - 1), np.float32)
  mask[:, 6:12] = 1.0
  return Batch(tokens=tokens, mask=mask, sampler_logprobs=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
               rewards=rng.integers(0, 2, b).astype(np.float32))


def test_a_train_step_moves_only_the_adapters(tmp_path):
  """One optimizer step of a LoRA run on a batch with non-zero advantages: the adapters move
  (B leaves zero), the frozen base is bit-equal, AdamW holds state for the adapters only."""
  c = _lora_config()
  r = train.Run(c, str(tmp_path))
  base_before = jax.tree.map(np.asarray, r.base)
  adapters_before = jax.tree.map(np.asarray, r.params)
  params, opt_state, m = r.train_step(r.params, r.opt_state, r.snapshot, step_batch(c), r.reference, r.base)
  assert m["step_skipped"] == 0.0 and float(m["grad_norm"]) > 0
  flat_new, flat_old = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(adapters_before))
  b_paths = [p for p in flat_new if p[-1] == "lora_b"]
  assert len(b_paths) == c.model.num_layers * 7
  for p in b_paths:  # every B leaves zero (A's first gradient is zero: it flows through B)
    assert not np.array_equal(np.asarray(flat_new[p].get_value()), flat_old[p].get_value()), p
  assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(r.base), jax.tree.leaves(base_before)))
  sizes = sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim)
  adapters = sum(x.size for x in jax.tree.leaves(params))
  assert sizes == 2 * adapters  # mu and nu of the adapters, nothing of the base
  assert adapters < sum(x.size for x in jax.tree.leaves(r.base)) / 4


SHARDED = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from configs import tiny
    from oapl_jax import sharding
    from oapl_jax.models import build
    from oapl_jax.rl.step import Batch, make_optimizer, make_train_step
    from oapl_jax.sampling import SamplingParams
    from oapl_jax.placement import seq_len

    def config(fsdp, tensor):
      c = tiny.get_config("smoke")
      c.model.lora.rank, c.model.lora.alpha = 4, 8.0
      c.rl.group_size, c.rl.groups_per_step, c.train.grad_accum = 4, 8, 2
      c.rl.old_logprobs, c.train.remat = "snapshot", "full"
      c.train.lr, c.train.warmup_ratio, c.train.eps = 1e-3, 0.0, 1e-3  # as tests/test_mesh_train.py
      c.mesh.fsdp, c.mesh.tensor = fsdp, tensor
      c.model.base_quant = sys.argv[1] if len(sys.argv) > 1 else "none"  # tests/test_quant.py: "int8"
      return c

    def one_step(c, devices):
      mesh = sharding.make_mesh(c.mesh, devices)
      _, _, base = build.init_model(c, mesh=mesh, param_dtype=c.model.dtype)
      graphdef, adapters = build.init_adapters(c, mesh=mesh)
      step = make_train_step(c, graphdef, make_optimizer(c.train, c.train.steps),
                             SamplingParams.from_config(c.sampling), mesh)
      base = step.base_of(base)
      assert any(x.dtype == np.int8 for x in jax.tree.leaves(base)) == (c.model.base_quant == "int8")
      key = iter(jax.random.split(jax.random.key(5), 1000))
      move = lambda t, s: jax.tree.map(lambda x: x + s * jax.random.normal(next(key), x.shape), t)
      params = step.place_params(move(adapters, 0.05))  # B != 0: A gets gradients too
      snapshot = step.snapshot_of(move(params, 0.01))
      assert [x.sharding for x in jax.tree.leaves(params)] == jax.tree.leaves(step.param_shardings)
      rng = np.random.default_rng(0)
      b, t = 32, seq_len(c)
      tokens = rng.integers(0, c.model.vocab_size, (b, t)).astype(np.int32)
      mask = np.zeros((b, t - 1), np.float32)
      for row, n in enumerate(rng.integers(1, t - 4, b)):
        mask[row, 3:3 + n] = 1.0
      sampler = np.where(mask > 0, -rng.uniform(0.1, 3.0, mask.shape), 0.0).astype(np.float32)
      batch = Batch(tokens=tokens, mask=mask, sampler_logprobs=sampler, rewards=rng.integers(0, 2, b).astype(np.float32))
      new, _, m = step(params, step.init_opt_state(params), snapshot, batch, None, base)
      return jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, new)

    assert jax.device_count() == 8
    want = one_step(config(1, 1), jax.devices()[:1])
    got = one_step(config(4, 2), jax.devices())
    assert abs(want[0]["loss"]) > 1e-4, want[0]
    for k in ("loss", "grad_norm", "snapshot_vs_sampler_abs"):
      np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, err_msg=k)
    for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    print("loss", want[0]["loss"], "grad norm", want[0]["grad_norm"])
    print("OK")
""")


def test_sharded_lora_step_equals_the_one_device_step():
  """fsdp 4 x tensor 2 (8 fake CPU devices), grad_accum 2, remat full: loss, grad norm and the
  updated adapters equal the one-device step (rtol 1e-5)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True,
                       timeout=900, cwd=REPO)
  assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-4000:]


def test_engine_samples_the_merged_weights_within_the_logprob_contract(small_model):
  """The engine holds base + scale A B (merged); the trainer applies the adapters: log-probs of
  the sampled answers agree to 1e-5 (float32), as without adapters (tests/test_engine.py)."""
  cfg, graphdef, params = small_model
  lgraph, adapters, base = _adapted(nnx.merge(graphdef, params), b_scale=0.05)
  sampling = SamplingParams(temperature=0.9, top_p=0.9)
  engine = Engine(graphdef, cfg, sampling, max_slots=8, max_prefill_length=16, max_len=40,
                  **engine_settings(tiny.get_config().sampling))
  merged = lora_lib.merged(base, adapters, LORA.scale)
  ro = rollout(engine, merged, [[1, 5, 6, 7], [1, 3, 4], [1, 9, 9, 2, 8]], group_size=4,
               max_new_tokens=12, eos_id=2, pad_id=0, key=jax.random.key(3))
  batch = make_batch(ro, np.zeros(ro.num_samples), seq_len=28, pad_id=0)
  logp = jax.jit(lambda a, t: token_logprobs(nnx.merge(lgraph, a, base), t, sampling)[0])(adapters, batch.tokens)
  mask = batch.mask > 0
  plain = jax.jit(lambda t: token_logprobs(nnx.merge(graphdef, params), t, sampling)[0])(batch.tokens)
  assert mask.sum() > 30
  assert np.abs(np.asarray(logp) - batch.sampler_logprobs)[mask].max() <= 1e-5
  assert np.abs(np.asarray(plain) - batch.sampler_logprobs)[mask].max() > 1e-3  # the adapters matter


def test_checkpoint_of_adapters_on_another_base_is_refused(tmp_path):
  c = _lora_config()
  r = train.Run(c, str(tmp_path))
  r.save()
  again = train.Run(c, str(tmp_path))
  assert again.restore_latest()  # the same base: resumes
  other = train.Run(c, str(tmp_path))
  other.set_base(jax.tree.map(lambda x: x * 1.01, other.base))
  with pytest.raises(OtherModelError) as e:
    other.restore_latest()
  msg = str(e.value)
  assert "another model" in msg and "config.model.base=" in msg and "sha256" in msg and "\n" not in msg, msg
  assert "hidden_size" not in msg


def _rows(path):
  keep = ("step", "loss", "grad_norm", "reward_mean", "entropy", "trainer_vs_sampler_abs")
  return [{k: row.get(k) for k in keep} for row in map(json.loads, open(path))]


def _main(workdir, cache, *extra):
  cmd = [sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke", f"--workdir={workdir}",
         "--config.model.lora.rank=4", "--config.train.steps=8", "--config.checkpoint.every=2",
         "--config.log.every=1", "--config.log.progress=False", "--config.seed=3",
         "--config.warmup.steps=200", "--config.warmup.noisy_steps=50",  # a base that earns rewards
         f"--config.warmup.cache_dir={cache}", *extra]
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow  # CI: test_reliability's kill / SIGTERM resumes; a LoRA checkpoint read back (below)
def test_a_lora_run_killed_and_resumed_is_the_straight_run(tmp_path):
  """kill -9 mid-RL, the same command again: the metrics (losses, rewards, grad norms) and the
  final adapters' evaluation are the straight run's, bit for bit; the base is rebuilt (warm-up)
  and checked against the checkpoint's sha256."""
  cache = tmp_path / "cache"
  straight = _main(tmp_path / "straight", cache)
  out, err = straight.communicate(timeout=900)
  assert straight.returncode == 0, err[-3000:]
  metrics = tmp_path / "killed" / "metrics.jsonl"
  proc = _main(tmp_path / "killed", cache)
  t0 = time.time()
  while not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() - t0 < 900
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = _main(tmp_path / "killed", cache)
  out, err = resumed.communicate(timeout=900)
  assert resumed.returncode == 0, err[-3000:]
  assert "resumed from step" in out + err
  want = _rows(tmp_path / "straight" / "metrics.jsonl")
  assert sum(abs(r["loss"]) > 0 for r in want) >= 3, want  # the adapters are trained
  assert _rows(metrics) == want
  got = json.load(open(tmp_path / "killed" / "summary.json"))["eval_after"]
  assert got == json.load(open(tmp_path / "straight" / "summary.json"))["eval_after"]


def test_peft_and_merged_exports_reload_in_transformers_with_the_same_logits(tmp_path, requires_peft):
  import peft  # noqa: PLC0415  (requires_peft: a failure in CI where it is missing, else a skip)
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  from oapl_jax.models.hf import from_hf, to_hf  # noqa: PLC0415
  from oapl_jax.models.tiny_hf import make_tiny_hf  # noqa: PLC0415

  base_dir = make_tiny_hf(str(tmp_path / "base"))
  model = from_hf(base_dir)
  lgraph, adapters, base = _adapted(model, b_scale=0.05)
  tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 13))
  ours = np.asarray(nnx.merge(lgraph, adapters, base)(jnp.asarray(tokens)))

  lora_lib.to_peft(adapters, LORA, tmp_path / "adapter", base_model=base_dir)
  hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    theirs = with_adapter(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)

  to_hf(nnx.merge(nnx.graphdef(from_hf(base_dir)), lora_lib.merged(base, adapters, LORA.scale)),
        str(tmp_path / "merged"))
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), torch_dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = merged(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  assert np.abs(ours - np.asarray(model(jnp.asarray(tokens)))).max() > 1e-3  # the adapters matter


@pytest.mark.parametrize("arg, topology, most_gib", [("lora", "t4x1", 9.0), ("lora", "v5e-1", 9.0),
                                                     ("lora_4b", "a100-40gx1", 28.5)])
def test_gsm8k_lora_variants_fit_their_devices(arg, topology, most_gib):
  """The planner counts the frozen base, the merged weights and the adapters' state: Qwen3-0.6B
  with adapters fits a T4 / v5e-1 (full training does not fit a T4 with margin), Qwen3-4B a
  40 GB A100."""
  from configs import gsm8k  # noqa: PLC0415
  from oapl_jax import plan  # noqa: PLC0415
  c = gsm8k.get_config(arg)
  c.mesh.topology = topology
  p = plan.make_plan(c)
  names = {i.name: i.nbytes for i in p.items}
  assert names["frozen base"] == names["merged weights"] > 20 * names["master weights"]
  assert names["optimizer state"] == 2 * names["master weights"] + 8  # mu, nu (+ step counts)
  assert p.fits and p.total / 2**30 < most_gib, p.format()
  if arg == "lora":
    full = gsm8k.get_config()
    full.mesh.topology = topology
    assert plan.make_plan(full).total > p.total + 5 * 2**30  # full training: 14.5 GiB


def _command(module, workdir, *extra):
  out = subprocess.run([sys.executable, "-m", module, "--config=configs/tiny.py:smoke", f"--workdir={workdir}",
                        "--config.model.lora.rank=4", "--config.model.lora.alpha=8.0",
                        "--config.warmup.steps=0", "--config.warmup.noisy_steps=0", *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  return out


def test_evaluate_and_export_read_a_lora_checkpoint(tmp_path):
  """`oapl_jax.evaluate` and `oapl_jax.export` rebuild the base, check its sha256 and merge the
  checkpoint's adapters: the evaluation is the run's own, the exported HF weights are the
  merged ones and `<out>/adapter` holds the adapters; another base is refused in one line."""
  from oapl_jax.models.hf import from_hf  # noqa: PLC0415
  c = _lora_config()
  c.warmup.steps = c.warmup.noisy_steps = 0  # the base is the seed's init (train.Run alone does no warm-up)
  run = tmp_path / "run"
  r = train.Run(c, str(run))
  r.params = jax.tree.map(lambda x: x + 0.05, r.params)  # adapters that change the policy
  r.save()
  want = {k: v for k, v in r.evaluate(r.params, "run").items() if k.startswith("pass@")}
  merged = jax.tree.map(np.asarray, r.engine_copy(r.params))
  out = _command("oapl_jax.evaluate", run)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout[out.stdout.index("{"):])
  assert {k: v for k, v in got.items() if k.startswith("pass@")} == want
  out = _command("oapl_jax.export", run, f"--out={tmp_path / 'hf'}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert os.path.isfile(tmp_path / "hf" / "adapter" / "adapter_model.safetensors")
  exported = nnx.state(from_hf(tmp_path / "hf"), nnx.Param)
  assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(merged)))
  out = _command("oapl_jax.evaluate", run, "--config.seed=1")  # another random base
  assert out.returncode != 0 and "config.model.base=" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("setting, value, needle", [
    ("rank", -1, "config.model.lora.rank=-1"),
    ("alpha", 0.0, "config.model.lora.alpha=0.0"),
    ("targets", ("q_proj", "qkv"), "config.model.lora.targets="),
])
def test_bad_lora_settings_are_refused_in_one_line(setting, value, needle):
  from oapl_jax.config import ConfigError, validate  # noqa: PLC0415
  c = _lora_config()
  c.model.lora[setting] = value
  with pytest.raises(ConfigError) as e:
    validate(c)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_lora_in_remote_and_offline_modes_is_accepted():
  from oapl_jax.config import validate  # noqa: PLC0415
  c = _lora_config()
  for mode in ("remote", "offline"):  # tests/test_remote_lora.py, tests/test_lora_offline.py
    c.rl.mode = mode
    validate(c)
