"""config.model.lora.init_from: a PEFT LoRA adapter folder starts a run's adapters. One written
by the real `peft` library on a tiny local Hugging Face base gives the run those adapters and
peft's merged model's logits; one written by `oapl_jax.export` comes back bit for bit; each
mismatch (rank, alpha, targets, a shape, another base, a missing or unreadable file) is refused
in one line naming the setting and the file."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from oapl_jax import sharding, train
from oapl_jax.errors import ConfigError
from oapl_jax.models import build
from oapl_jax.models import lora as lora_lib
from oapl_jax.models.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  from oapl_jax.models.tiny_hf import make_tiny_hf  # noqa: PLC0415
  return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_base"))


def _config(base_dir, init_from=None, **lora):
  c = tiny.get_config("smoke")
  c.model.update(PRESETS["tiny_qwen3"])
  c.model.preset, c.model.path = "tiny_qwen3", base_dir
  c.warmup.steps = c.warmup.noisy_steps = 0
  c.model.lora.rank, c.model.lora.alpha, c.model.lora.targets = RANK, ALPHA, TARGETS
  c.model.lora.update(lora)
  c.model.lora.init_from = init_from
  return c


def _flat(adapters) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(adapters)}


def _ours_written(base_dir, out_dir, seed=1):
  """A PEFT adapter folder written by the project's own `to_peft` (as `oapl_jax.export` does),
  adapters random in A and B; returns the adapters State."""
  graphdef, abstract, _ = build.lora_abstract(_config(base_dir))
  keys = iter(jax.random.split(jax.random.key(seed), 1000))
  adapters = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), abstract)
  lora_lib.to_peft(adapters, lora_lib.LoraConfig(RANK, ALPHA, TARGETS), out_dir, base_model=base_dir)
  return adapters


def test_a_peft_adapter_starts_a_run_with_its_tensors_and_peft_s_logits(tmp_path, base_dir, requires_peft):
  """peft (get_peft_model, A and B random: init_lora_weights=False) saves an adapter on the tiny
  base; train.Run with init_from holds it as its adapters (pi_theta and pi_old), and the run's
  model gives the logits of peft's merged model (merge_and_unload) within 1e-4 (float32 both
  sides; the worst gap here is printed)."""
  import peft  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  from safetensors.numpy import load_file  # noqa: PLC0415

  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
  with_adapter = peft.get_peft_model(hf, peft.LoraConfig(
      r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0, init_lora_weights=False))
  with_adapter.save_pretrained(str(tmp_path / "adapter"))
  merged = with_adapter.merge_and_unload().eval()
  tokens = np.random.default_rng(0).integers(0, PRESETS["tiny_qwen3"]["vocab_size"], (2, 13))
  with torch.no_grad():
    theirs = merged(torch.tensor(tokens)).logits.numpy()

  r = train.Run(_config(base_dir, str(tmp_path / "adapter")), str(tmp_path / "run"))
  file = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  got = _flat(r.params)
  assert len(got) == 2 * 2 * len(TARGETS) == len(file)
  for path, value in got.items():
    layer, module, kind = path[1], path[-2][:-len("_lora")], path[-1]
    name = (f"base_model.model.model.layers.{layer}.{lora_lib._HF_MODULE[module]}."
            f"{'lora_A' if kind == 'lora_a' else 'lora_B'}.weight")
    np.testing.assert_array_equal(value, file[name].T, err_msg=name)
  for x, y in zip(jax.tree.leaves(r.snapshot), jax.tree.leaves(r.params)):  # pi_old starts there too
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ours = np.asarray(nnx.merge(r.graphdef, r.params, r.base)(jnp.asarray(tokens)))
  gap = np.abs(ours - theirs).max()
  print("logits vs peft's merged model: max abs gap", gap)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  plain = nnx.merge(r.engine_graphdef, r.base)(jnp.asarray(tokens))
  assert np.abs(ours - np.asarray(plain)).max() > 1e-2  # the adapters matter


def test_an_exported_adapter_starts_a_run_with_the_same_adapters(tmp_path):
  """oapl_jax.export of a LoRA checkpoint (a random base: exported beside the adapter as
  <out>/base, which the adapter names), then init_from=<out>/adapter: the new run's adapters are
  the checkpoint's, bit for bit."""
  c = tiny.get_config("smoke")
  c.warmup.steps = c.warmup.noisy_steps = 0
  c.model.lora.rank, c.model.lora.alpha = RANK, ALPHA
  r = train.Run(c, str(tmp_path / "run"))
  keys = iter(jax.random.split(jax.random.key(3), 1000))
  r.params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), r.params)
  r.save()
  # the command (its absl flags would clash with oapl_jax.generate's in this process)
  out = subprocess.run([sys.executable, "-m", "oapl_jax.export", "--config=configs/tiny.py:smoke",
                        f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}",
                        f"--config.model.lora.rank={RANK}", f"--config.model.lora.alpha={ALPHA}",
                        "--config.warmup.steps=0", "--config.warmup.noisy_steps=0"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  c.model.lora.init_from = str(tmp_path / "hf" / "adapter")
  again = train.Run(c, str(tmp_path / "again"))
  want, got = _flat(r.params), _flat(again.params)
  assert want.keys() == got.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def _mesh():
  return sharding.make_mesh(tiny.get_config("smoke").mesh, jax.devices()[:1])


def test_init_from_on_a_mesh_places_the_file_s_adapters(tmp_path, base_dir):
  want = _flat(_ours_written(base_dir, tmp_path / "adapter"))
  _, adapters = build.init_adapters(_config(base_dir, str(tmp_path / "adapter")), mesh=_mesh())
  got = _flat(adapters)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def _edit_json(folder, **changes):
  path = os.path.join(folder, "adapter_config.json")
  cfg = json.load(open(path))
  cfg.update(changes)
  json.dump(cfg, open(path, "w"))


def _edit_tensors(folder, fn):
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  path = os.path.join(folder, "adapter_model.safetensors")
  tensors = load_file(path)
  fn(tensors)
  save_file(tensors, path)


_Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _other_base(folder, base_dir):
  """An adapter naming a local base of another architecture (3 layers)."""
  other = os.path.join(os.path.dirname(folder), "other_base")
  os.makedirs(other, exist_ok=True)
  hf = json.load(open(os.path.join(base_dir, "config.json")))
  json.dump({**hf, "num_hidden_layers": 3}, open(os.path.join(other, "config.json"), "w"))
  _edit_json(folder, base_model_name_or_path=other)


# (what is wrong, how the folder is made so, the config's lora settings, words the line must hold)
REFUSALS = [
    ("rank", None, {"rank": 8}, ["r=4 but config.model.lora.rank=8", "adapter_config.json"]),
    ("alpha", None, {"alpha": 16.0}, ["lora_alpha=8.0 but config.model.lora.alpha=16.0", "adapter_config.json"]),
    ("targets", None, {"targets": ("q_proj", "v_proj")}, ["target_modules=", "config.model.lora.targets=",
                                                          "adapter_config.json"]),
    ("shape", lambda d, _: _edit_tensors(d, lambda t: t.update({f"{_Q0}.lora_B.weight": np.zeros((32, RANK), np.float32)})),
     {}, [f"{_Q0}.lora_B.weight has shape (32, 4)", "(64, 4)", "adapter_model.safetensors"]),
    ("missing tensor", lambda d, _: _edit_tensors(d, lambda t: t.pop(f"{_Q0}.lora_A.weight")), {},
     [f"no tensor {_Q0}.lora_A.weight", "adapter_model.safetensors"]),
    ("a layer the base lacks", lambda d, _: _edit_tensors(d, lambda t: t.update(
        {f"base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight": np.zeros((RANK, 64), np.float32)})),
     {}, ["another base", "layer 2, the base has 2 layers", "adapter_model.safetensors"]),
    ("another base's architecture", _other_base, {}, ["another base", "num_layers 3 (this run's model: 2)",
                                                       "adapter_config.json"]),
    ("another base's name", lambda d, _: _edit_json(d, base_model_name_or_path="Qwen/Qwen3-0.6B"), {},
     ["another base", "'Qwen/Qwen3-0.6B'", "init_from_check_name=False", "adapter_config.json"]),
    ("DoRA", lambda d, _: _edit_json(d, use_dora=True), {}, ["use_dora=True", "adapter_config.json"]),
    ("no folder", lambda d, _: shutil.rmtree(d), {}, ["no such folder"]),
    ("no adapter_config.json", lambda d, _: os.remove(os.path.join(d, "adapter_config.json")), {},
     ["adapter_config.json: missing"]),
    ("unreadable adapter_config.json", lambda d, _: open(os.path.join(d, "adapter_config.json"), "w").write("{r: 4"),
     {}, ["adapter_config.json: unreadable"]),
    ("no weights", lambda d, _: os.remove(os.path.join(d, "adapter_model.safetensors")), {},
     ["adapter_model.safetensors: missing"]),
    ("unreadable weights", lambda d, _: open(os.path.join(d, "adapter_model.safetensors"), "wb").write(b"\x07" * 40),
     {}, ["adapter_model.safetensors: unreadable"]),
]


@pytest.mark.parametrize("what, spoil, lora, needles", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_mismatched_or_unreadable_adapter_is_refused_in_one_line(tmp_path, base_dir, what, spoil, lora, needles):
  folder = str(tmp_path / "adapter")
  _ours_written(base_dir, folder)
  if spoil:
    spoil(folder, base_dir)
  with pytest.raises(ConfigError) as e:
    build.init_adapters(_config(base_dir, folder, **lora), mesh=_mesh())
  msg = str(e.value)
  assert msg.startswith(f"config.model.lora.init_from={folder!r}: ") and "\n" not in msg, msg
  for needle in needles:
    assert needle in msg, (needle, msg)


def test_the_name_check_can_be_turned_off_and_init_from_needs_a_rank(tmp_path, base_dir):
  from oapl_jax.config import validate  # noqa: PLC0415
  folder = str(tmp_path / "adapter")
  want = _flat(_ours_written(base_dir, folder))
  _edit_json(folder, base_model_name_or_path="someone/renamed-tiny")
  _, adapters = build.init_adapters(_config(base_dir, folder, init_from_check_name=False), mesh=_mesh())
  assert _flat(adapters).keys() == want.keys()
  c = _config(base_dir, folder, rank=0)
  with pytest.raises(ConfigError, match=r"config.model.lora.init_from='.*': needs model.lora.rank > 0"):
    validate(c)
