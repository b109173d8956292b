"""The memory planner (oapl_jax/plan.py) and `python -m oapl_jax.main --dry_run`.

Hand-checked numbers (weights, AdamW state, KV cache) on the real presets; the dry run of the
paper's configs on their pods, in a child process, in under a minute; a plan that does not fit
refused in one line naming the setting; and the calibration of the analytic activation model
against the compiled train step's `memory_analysis()` on tiny models (figures printed: run
with `-s` to see them).
"""

import contextlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import code, math, tiny
from oapl_jax import config as config_lib
from oapl_jax import plan as plan_lib
from oapl_jax.models.transformer import ModelConfig, Transformer
from oapl_jax.topology import TOPOLOGIES, GiB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The paper's configs as they fit their pods: the engines spread over the devices (one engine
# of 256 slots would hold the whole KV cache: 612 GiB for math, 1.7 TiB for code), and code's
# micro-batches of 64 rows (grad_accum 32) so they divide over its 64 fsdp shards.
MATH_V5P_64 = ["--config=configs/math.py", "--config.mesh.topology=v5p-64",
               "--config.sampling.engines=8", "--config.sampling.tensor=4"]
CODE_V5P_128 = ["--config=configs/code.py", "--config.mesh.topology=v5p-128",
                "--config.sampling.engines=16", "--config.sampling.tensor=4",
                "--config.train.grad_accum=32"]


def _main(*args) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "oapl_jax.main", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=300)


def _config(module, topology: str, **overrides):
  c = module.get_config()
  c.mesh.topology = topology
  for dotted, value in overrides.items():
    section, name = dotted.split("__")
    c[section][name] = value
  config_lib.validate(c, dry_run=True)
  return c


def _item(plan, name: str) -> int:
  return next(i.nbytes for i in plan.items if i.name == name)


# --- the dry run -------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [MATH_V5P_64, CODE_V5P_128], ids=["math_v5p-64", "code_v5p-128"])
def test_dry_run_prints_the_plan_and_exits_0_in_under_a_minute(args, tmp_path):
  start = time.perf_counter()
  out = _main(*args, "--dry_run")
  seconds = time.perf_counter() - start
  print(out.stdout)
  assert out.returncode == 0, out.stderr[-2000:]
  assert seconds < 60, f"dry run took {seconds:.0f} s"
  for name in ("master weights", "optimizer state", "gradients", "engine snapshot", "KV cache",
               "activations", "log-prob kernel", "total", "headroom"):
    assert name in out.stdout
  assert "fits" in out.stdout and "DOES NOT FIT" not in out.stdout


def test_a_plan_that_does_not_fit_exits_2_naming_max_slots():
  out = _main(*MATH_V5P_64, "--config.sampling.max_slots=100000", "--dry_run")
  assert out.returncode == 2
  assert "DOES NOT FIT" in out.stdout  # the plan is printed first
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "KV cache" in last and "sampling.max_slots" in last


def test_workdir_is_required_without_dry_run():
  out = _main("--config=configs/tiny.py:smoke")
  assert out.returncode != 0 and "--workdir is required" in out.stderr


# --- hand-checked numbers ----------------------------------------------------------------------


def _hand_count(m) -> tuple[int, int]:
  """(weights, of which RMSNorm weights) of config.model `m`, counted by hand."""
  e, n, k, d, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  norms = m.num_layers * (2 * e + (2 * d if m.qk_norm else 0)) + e
  layer = 2 * e * n * d + 2 * e * k * d + 3 * e * f + ((n + 2 * k) * d if m.qkv_bias else 0)
  return m.vocab_size * e * (1 if m.tie_embeddings else 2) + m.num_layers * layer + norms, norms


def test_weights_and_adamw_state_per_device_by_hand():
  """Qwen3-4B on v5p-64 (fsdp 32): every matrix and the embedding are split over "embed"
  (fsdp), the RMSNorm weights (2 [E] per layer, [D] q/k norms, the final [E]) are replicated."""
  c = _config(math, "v5p-64", sampling__engines=8, sampling__tensor=4)
  plan = plan_lib.make_plan(c)
  count, norms = _hand_count(c.model)
  assert round(count / 1e9, 2) == 4.02  # Qwen3-4B
  assert plan.mesh == {"data": 1, "fsdp": 32, "tensor": 1}
  assert _item(plan, "master weights") == (count - norms) * 4 // 32 + norms * 4
  adam = _item(plan, "optimizer state")  # mu and nu like the weights, plus step counts
  assert 2 * _item(plan, "master weights") <= adam <= 2 * _item(plan, "master weights") + 64
  assert _item(plan, "trainer snapshot") == _item(plan, "master weights") // 2  # bfloat16
  assert _item(plan, "gradients") == 2 * _item(plan, "master weights")  # accum 8: sum + one


def test_engine_items_by_hand():
  """An engine on one device holds all of pi_old in bfloat16; the KV cache is the closed form
  2 L (slots / engines) (K / tensor) D M bytes(bf16)."""
  c = _config(code, "v5p-128", sampling__engines=16, sampling__tensor=1, train__grad_accum=32)
  m, s = c.model, c.sampling
  plan = plan_lib.make_plan(c)
  assert round(_hand_count(m)[0] / 1e9, 2) == 14.77  # R1-Distill-Qwen-14B
  assert _item(plan, "engine snapshot") == _hand_count(m)[0] * 2
  c = _config(code, "v5p-128", sampling__engines=16, sampling__tensor=4, train__grad_accum=32)
  m, s = c.model, c.sampling
  kv = _item(plan_lib.make_plan(c), "KV cache")
  assert kv == 2 * m.num_layers * (256 // 16) * (8 // 4) * m.head_dim * (4096 + 32000) * 2
  assert kv == 2 * 48 * 16 * 2 * 128 * 36096 * 2


def test_host_window_bytes_by_hand():
  """A process's host memory for one window of answers (`plan.host_window_bytes`): math.py on
  v5p-64 (8 hosts of 4 chips: 8 processes) samples rl.window_rollouts = 10 rollouts of 32 groups
  x G = 8 answers, a process its share: 10 x 32 / 8 = 40 groups = 320 answers. Each is held
  twice: by the engines (a token, int32, and a log-prob, float32, per answer position: 16,384
  positions) and as the trainer's row (tokens int32, mask and log-probs float32 per position of
  prompt + answer: 1,024 + 16,384), plus 16 B of per-answer scalars."""
  c = _config(math, "v5p-64", sampling__engines=8, sampling__tensor=4)
  plan = plan_lib.make_plan(c)
  assert plan.processes == 8
  per_answer = 16_384 * (4 + 4) + (1_024 + 16_384) * (4 + 4 + 4) + 16
  assert per_answer == 339_984
  assert plan.host_bytes == 320 * per_answer == 108_794_880
  assert f"{plan.host_bytes:,}" in plan.format() and "320 answers" in plan.host_note
  # a share that does not divide rounds up: 320 groups over 3 processes -> 107 groups each
  assert plan_lib.host_window_bytes(c, 3)[0] == 107 * 8 * per_answer


def test_host_window_bytes_covers_the_buffers_a_rollout_allocates():
  """The count above against the arrays the code allocates for configs/tiny.py:smoke's window
  (one rollout of 6 groups x 8 answers): the engines' answer buffers (`rollout._Answers`) and
  the trainer's rows (`logprobs.make_batch`), within 10%."""
  import types  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  from oapl_jax.placement import seq_len  # noqa: PLC0415
  from oapl_jax.rl.logprobs import make_batch  # noqa: PLC0415
  from oapl_jax.sampling.rollout import _Answers  # noqa: PLC0415
  c = tiny.get_config("smoke")
  n, g = 6 * 8, 8
  answers = _Answers(n, c.sampling.max_new_tokens, pad_id=0)
  answers.lengths[:] = 3
  rollout = types.SimpleNamespace(num_samples=n, group_size=g, prompts=[[1, 2, 3, 4]] * 6,
                                  answers=answers.tokens, logprobs=answers.logprobs,
                                  lengths=answers.lengths, finish=answers.finish, versions=answers.versions,
                                  model=answers.model)
  rows = make_batch(rollout, np.zeros(n), seq_len=seq_len(c), pad_id=0)
  allocated = (sum(a.nbytes for a in vars(answers).values() if isinstance(a, np.ndarray))
               + sum(a.nbytes for a in rows.as_dict().values()))
  planned = plan_lib.host_window_bytes(c, 1)[0]
  assert planned == n * (8 * 6 + 12 * 14 + 16)
  assert 0.9 * allocated <= planned <= 1.1 * allocated, (planned, allocated)


def test_engines_are_counted_over_all_processes_as_the_run_places_them():
  """v5p-128 is 16 hosts of 4 devices (one process each): sampling.engines counts the replicas of
  all of them (placement.local_engines), so 16 engines of 4 devices fill every host and fewer
  engines than hosts, or more engine devices than a host has, are refused as the run refuses them."""
  assert TOPOLOGIES["v5p-128"].processes == 16 and TOPOLOGIES["v5e-8"].processes == 1
  plan = plan_lib.make_plan(_config(code, "v5p-128", sampling__engines=16, sampling__tensor=4,
                                    train__grad_accum=32))
  assert plan.shared and plan.mesh["fsdp"] == 64
  for engines, tensor, match in ((1, 4, "multiple of the 16 processes"), (16, 8, "has 4 per process")):
    with pytest.raises(config_lib.ConfigError, match=f"config.sampling.engines={engines}: .*{match}"):
      plan_lib.make_plan(_config(code, "v5p-128", sampling__engines=engines, sampling__tensor=tensor,
                                 train__grad_accum=32))


@pytest.mark.parametrize("module, topology, hosts", [(math, "v5p-64", 8), (code, "v5p-128", 16)])
def test_shipped_configs_pass_every_check_before_the_first_step_on_their_pod(module, topology, hosts):
  """The paper's configs as shipped, on their pods (hosts of 4 devices, one process each): the
  checks the run makes before its first step, with the process count it would see, pass; the
  dry run prints the per-host figures."""
  from oapl_jax import placement  # noqa: PLC0415
  from oapl_jax.rl.loop import check_processes  # noqa: PLC0415
  from oapl_jax.rl.step import check_batch_divides  # noqa: PLC0415
  from oapl_jax.sampling.layout import check_tensor  # noqa: PLC0415
  c = _config(module, topology)
  plan = plan_lib.make_plan(c)
  assert plan.fits and plan.processes == hosts
  assert check_processes(c, hosts) == c.rl.groups_per_step  # whole groups per engine replica
  split = placement.split_devices(c, 4, hosts)
  assert len(split.engines) == placement.local_engines(c, hosts) * c.sampling.tensor <= 4
  check_batch_divides(c, plan.mesh)
  check_tensor(ModelConfig.from_config(c.model), c.sampling.tensor)
  assert placement.engine_slots(c) >= max(c.rl.group_size, c.eval.samples_per_problem)
  assert f"hosts: {hosts} (one process each) of 4 devices; each runs 1 engine(s)" in plan.format()


@pytest.mark.parametrize("topology, overrides, fits", [
    ("h200x8", dict(sampling__engines=2), True),
    ("h100x8", dict(sampling__engines=2), False),  # the KV cache of 256 slots does not fit
    ("h100x8", dict(sampling__engines=2, sampling__max_slots=64), True),
])
def test_math_on_one_8_gpu_node_with_the_documented_overrides(topology, overrides, fits):
  """docs/scaling.md's overrides for one 8-GPU node (one process of 8 devices)."""
  assert plan_lib.make_plan(_config(math, topology, **overrides)).fits == fits


def test_activation_settings_move_the_plan_the_right_way():
  base = _config(math, "v5p-64", sampling__engines=8, sampling__tensor=4)
  act = lambda **o: _item(plan_lib.make_plan(_config(math, "v5p-64", sampling__engines=8,  # noqa: E731
                                                     sampling__tensor=4, **o)), "activations")
  full, dots, none = act(train__remat="full"), act(train__remat="dots"), act(train__remat="none")
  assert full < dots < none
  assert act(train__grad_accum=4) > 1.9 * full  # 2 rows per device instead of 1
  assert act(train__attn_block=4096) > act(train__attn_block=512)
  tile = lambda t: _item(plan_lib.make_plan(_config(math, "v5p-64", sampling__engines=8,  # noqa: E731
                                                    sampling__tensor=4, train__logprob_tile=t)),
                         "log-prob kernel")
  vocab_shard = base.model.vocab_size // 32  # the vocabulary over tensor 1 x fsdp 32 (v5p-64)
  # a tile holds the micro-batch's 32 rows (every fsdp device shares the head's rows: head_rows)
  assert plan_lib.head_rows(base, {"data": 1, "fsdp": 32, "tensor": 1}) == 32
  assert tile(2048) - tile(512) == plan_lib.LOGPROB_TILE_COPIES * 32 * 1536 * vocab_shard * 4


def test_mesh_axes_resolve_against_the_topology():
  assert plan_lib.resolve_mesh({"data": 2, "fsdp": -1, "tensor": 2}, 32) == {"data": 2, "fsdp": 8, "tensor": 2}
  with pytest.raises(config_lib.ConfigError, match="mesh.fsdp=-1"):
    plan_lib.resolve_mesh({"data": 3, "fsdp": -1, "tensor": 1}, 32)
  with pytest.raises(config_lib.ConfigError, match="config.mesh"):
    plan_lib.resolve_mesh({"data": 2, "fsdp": 2, "tensor": 2}, 32)


def test_micro_batches_that_do_not_divide_are_refused_naming_grad_accum():
  c = _config(code, "v5p-128", train__grad_accum=64)  # 32-row micro-batches over 64 shards
  with pytest.raises(config_lib.ConfigError, match="train.grad_accum=64"):
    plan_lib.make_plan(c)


def test_unknown_topology_is_refused():
  c = math.get_config()
  c.mesh.topology = "v5p-63"
  with pytest.raises(config_lib.ConfigError, match="mesh.topology"):
    config_lib.validate(c, dry_run=True)


def test_dry_run_validation_skips_only_the_file_checks():
  c = math.get_config()  # no task.train_path / eval_path / model.path
  with pytest.raises(config_lib.ConfigError, match="task.train_path"):
    config_lib.validate(c)
  config_lib.validate(c, dry_run=True)
  c.train.b1 = 1.5
  with pytest.raises(config_lib.ConfigError, match="train.b1"):
    config_lib.validate(c, dry_run=True)


def test_without_a_known_memory_there_is_no_check():
  """On CPU (no topology) the plan is made, says the memory is unknown, and is not checked."""
  c = tiny.get_config("smoke")
  plan = plan_lib.make_plan(c)
  assert plan.device_bytes is None and plan.fits and "unknown" in plan.format()
  assert plan_lib.check(c) is None


def test_train_run_refuses_a_run_that_does_not_fit_before_touching_the_workdir(tmp_path):
  from oapl_jax import train  # noqa: PLC0415
  c = tiny.get_config("smoke")
  c.mesh.topology = "v5e-8"  # 16 GiB per device
  c.sampling.max_slots = 2_000_000  # a KV cache of ~27 GiB on one engine
  with pytest.raises(plan_lib.PlanError, match="sampling.max_slots"):
    train.run(c, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


# --- calibration: the activation model vs the compiled train step ------------------------------

# The analytic model (gradients + activations + log-prob kernel) against the compiled step's
# temp bytes, on tiny models with the attention block and the log-prob tile at least as long as
# a micro-batch (so the blockwise / tiled code and the plain code hold the same blocks).
BAND = (0.5, 2.0)
SHAPES = {  # name: (vocab, hidden, mlp, layers, rows, tokens, accum, compute dtype)
    "mlp": (256, 64, 512, 3, 16, 128, 1, "float32"),
    "mlp_bf16": (256, 64, 512, 3, 16, 128, 1, "bfloat16"),  # float32 master weights
    "vocab": (4096, 64, 256, 2, 16, 128, 2, "float32"),
}


def _tiny_step_config(vocab, hidden, mlp, layers, rows, tokens, accum, dtype, remat):
  c = tiny.get_config("smoke")
  c.model.update(vocab_size=vocab, hidden_size=hidden, mlp_dim=mlp, num_layers=layers,
                 num_heads=4, num_kv_heads=2, head_dim=hidden // 4, dtype=dtype)
  c.rl.group_size, c.rl.groups_per_step, c.train.grad_accum = 4, rows // 4, accum
  c.sampling.max_prompt_len, c.sampling.max_new_tokens = 8, tokens - 8
  c.train.remat, c.train.attn_block, c.train.logprob_tile = remat, tokens, rows * tokens
  return c


def compiled_temp_bytes(c, mesh=None) -> int:
  """Temp bytes per device of the real train step (`make_train_step`) compiled for config `c`
  (on one device, or on `mesh`), from abstract arguments (nothing allocated)."""
  from oapl_jax.rl.step import Batch, make_optimizer, make_train_step  # noqa: PLC0415
  from oapl_jax.sampling.processing import SamplingParams  # noqa: PLC0415
  cfg = ModelConfig.from_config(c.model)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  optimizer = make_optimizer(c.train, c.train.steps)
  step = make_train_step(c, graphdef, optimizer, SamplingParams.from_config(c.sampling),
                         *([] if mesh is None else [mesh]))
  # The step is a jitted function of a [B, ...] batch, or (trainer on a mesh) a TrainStep whose
  # `jitted` takes the batch as [accum, B / accum, ...] under its mesh.
  jitted = getattr(step, "jitted", step)
  rows, t, accum = c.rl.groups_per_step * c.rl.group_size, plan_lib.seq_len(c), c.train.grad_accum
  lead = (accum, rows // accum) if hasattr(step, "jitted") else (rows,)
  sds = jax.ShapeDtypeStruct
  batch = Batch(tokens=sds(lead + (t,), jnp.int32), mask=sds(lead + (t - 1,), jnp.float32),
                sampler_logprobs=sds(lead + (t - 1,), jnp.float32), rewards=sds(lead, jnp.float32))
  mesh = getattr(step, "mesh", None)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    lowered = jitted.lower(params, jax.eval_shape(optimizer.init, params), params, batch, None, None)
  return lowered.compile().memory_analysis().temp_size_in_bytes


def _predicted(c) -> dict:
  return plan_lib.train_temp_bytes(c, {"data": 1, "fsdp": 1, "tensor": 1})


_MEASURED = {}


def _measure(shape: str, remat: str) -> tuple[int, int]:
  """(compiled temp bytes, predicted) of SHAPES[shape] under `remat`, printed."""
  if (shape, remat) not in _MEASURED:
    c = _tiny_step_config(*SHAPES[shape], remat)
    pred = _predicted(c)
    temp = compiled_temp_bytes(c)
    print(f"\ncalibration {shape} remat={remat}: compiled temp {temp / 1e6:.2f} MB, predicted "
          f"{sum(pred.values()) / 1e6:.2f} MB ({', '.join(f'{k} {v / 1e6:.2f}' for k, v in pred.items())}),"
          f" ratio {temp / sum(pred.values()):.2f}")
    _MEASURED[shape, remat] = (temp, sum(pred.values()))
  return _MEASURED[shape, remat]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_activation_model_matches_the_compiled_step(shape):
  temp, pred = _measure(shape, "none")
  assert BAND[0] <= temp / pred <= BAND[1], f"compiled {temp} vs predicted {pred}"


def _per_layer(remat: str, layers=(2, 6)) -> tuple[float, float]:
  """(compiled, predicted) temp bytes per extra layer of the "mlp" shape under `remat`: the
  difference between `layers[1]` and `layers[0]` layers, divided by the layers added. This is
  what the remat policy bounds: at 36-48 layers it is most of the activations."""
  out = []
  for n in layers:
    c = _tiny_step_config(*SHAPES["mlp"], remat)
    c.model.num_layers = n
    out.append((compiled_temp_bytes(c), sum(_predicted(c).values())))
  added = layers[1] - layers[0]
  per_layer = ((out[1][0] - out[0][0]) / added, (out[1][1] - out[0][1]) / added)
  print(f"\ncalibration per layer, remat={remat}: compiled {per_layer[0] / 1e6:.2f} MB, "
        f"predicted {per_layer[1] / 1e6:.2f} MB, ratio {per_layer[0] / per_layer[1]:.2f}")
  return per_layer


@pytest.mark.parametrize("remat", ["none", "full", pytest.param("dots", marks=pytest.mark.slow)])
def test_activation_model_per_layer_matches_the_compiled_step(remat):
  """The bytes each layer adds, compiled vs predicted (the step applies train.remat)."""
  if remat != "none":
    temp, _ = _measure("mlp", remat)
    assert temp < 0.99 * _measure("mlp", "none")[0], f"train.remat={remat!r} saved nothing"
  compiled, predicted = _per_layer(remat)
  assert BAND[0] <= compiled / predicted <= BAND[1], (
      f"each layer adds {compiled:.0f} bytes compiled vs {predicted:.0f} predicted under "
      f"remat={remat!r}. (Known on XLA:CPU: with the layers in a Python loop, the rematerialised "
      "forward is scheduled early and remat saves little; layers in a lax.scan keep it bounded.)")


# CI: "dots" here (one more compile, ~20 s) is the reduced form of the per-layer "dots" case
# above (four compiles, ~45 s: -m slow); an everything-saveable "dots" policy fails it.
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_activation_model_matches_the_compiled_step_with_remat(remat):
  temp, pred = _measure("mlp", remat)
  none_temp, _ = _measure("mlp", "none")
  assert temp < 0.99 * none_temp, f"train.remat={remat!r} saved nothing"
  assert BAND[0] <= temp / pred <= BAND[1], f"compiled {temp} vs predicted {pred}"


def sharded_calibration(shape: str) -> tuple[int, int]:
  """(compiled temp bytes per device, predicted) of SHAPES[shape] with 32 rows in one
  micro-batch on an fsdp mesh over all devices (run in a child process with 8 CPU devices)."""
  from oapl_jax import sharding  # noqa: PLC0415
  c = _tiny_step_config(*SHAPES[shape], "none")
  c.rl.groups_per_step, c.train.grad_accum = 8, 1  # 32 rows: 4 per device
  mesh = sharding.make_mesh(c.mesh, jax.devices())
  pred = plan_lib.train_temp_bytes(c, {"data": 1, "fsdp": len(jax.devices()), "tensor": 1})
  return compiled_temp_bytes(c, mesh), sum(pred.values())


def test_activation_model_matches_the_sharded_step_on_8_devices():
  """Per device on an fsdp-8 mesh the activations are those of a micro-batch's rows / 8: the
  plan assumes GSPMD keeps the blocks' activations split by rows. (A child process compiling
  the step on 8 devices, nothing run: 15-18 s here on 2 loaded cores, so CI runs it whole; the
  planner's rows left unsplit by hand put the ratio at 0.14.)"""
  code = "import json, sys; sys.path.insert(0, 'tests'); import test_plan as T; " \
         "print('RESULT', json.dumps(T.sharded_calibration('mlp')))"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  temp, pred = json.loads(out.stdout.split("RESULT", 1)[1])
  print(f"\ncalibration mlp on fsdp 8: compiled temp {temp / 1e6:.2f} MB per device, predicted "
        f"{pred / 1e6:.2f} MB, ratio {temp / pred:.2f}")
  assert BAND[0] <= temp / pred <= BAND[1], (
      f"compiled {temp} bytes per device vs predicted {pred}: are the blocks' activations split "
      "by rows (with_sharding_constraint over the batch axes)? Without it GSPMD may keep "
      "[B, T, F] MLP activations of the whole micro-batch on every device")


def test_auto_topology_is_this_machines_devices_and_small_devices_are_named():
  """`mesh.topology="auto"` plans for the devices this process finds (as None does; on CPU
  their memory is unknown, so nothing is checked); the one-chip topologies a Colab or
  single-GPU user has are named, and a run too big for one is refused naming the setting."""
  c = tiny.get_config()
  c.mesh.topology = "auto"
  config_lib.validate(c, dry_run=True)
  plan = plan_lib.make_plan(c)
  assert plan.topology.startswith("local cpu x") and plan.device_bytes is None and plan.fits
  assert plan_lib.check(c) is None  # CPU: no limit to check against
  assert TOPOLOGIES["v5e-1"].devices == 1 and TOPOLOGIES["v5e-1"].device_bytes == 16 * GiB
  assert TOPOLOGIES["l4x1"].device_bytes == int(24e9) and TOPOLOGIES["t4x1"].devices == 1
  big = math.get_config()
  big.mesh.topology, big.sampling.engines, big.sampling.tensor = "l4x1", 1, 1
  with pytest.raises(plan_lib.PlanError, match=r"l4x1 devices have 22\.35 GiB.*change "):
    plan_lib.check(big)


@pytest.mark.parametrize("topology, overrides, copy", [
    ("v5p-64", {}, False),  # head_dim 128, 17,408 positions: the cache writes stay in place
    ("v5p-64", dict(sampling__max_new_tokens=16100), True),  # 17,124 positions: not whole tiles
    ("v5p-64", dict(model__head_dim=64), True),  # D = 64: XLA:TPU's layout is not the kernel's
    ("h200x8", dict(sampling__engines=2, model__head_dim=64), False),  # compiled for TPU only
])
def test_the_decode_loop_copies_its_cache_where_tpu_compiles_showed_it(topology, overrides, copy):
  """docs/memory.md 'Compiled for the pod': the decode loop's second KV cache on TPU."""
  plan = plan_lib.make_plan(_config(math, topology, **overrides))
  assert _item(plan, "decode loop copy") == (_item(plan, "KV cache") if copy else 0)
