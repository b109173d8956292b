"""Hugging Face checkpoints: from_hf/to_hf against transformers' PyTorch models, presets."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from conftest import NO_TORCH, torch_may_be_missing
from flax import nnx

from oapl_jax.models import ModelConfig, Transformer, from_hf, to_hf
from oapl_jax.models import hf as hf_lib
from oapl_jax.models.build import param_count
from oapl_jax.models.presets import PRESETS

if torch_may_be_missing():  # OAPL_NO_TORCH=1: a venv without torch on purpose skips this file
  torch = pytest.importorskip("torch", reason=NO_TORCH)
else:  # anywhere else a missing torch is a collection error: the run fails
  import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 64, 40
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
TOKENIZER_TEXT = {"tokenizer.json": '{"fake": "tokenizer"}', "chat_template.jinja": "{{ x }}"}


def _hf_model(family: str):
  """A tiny random transformers model of `family`, with every weight perturbed (so norms and
  biases are not their trivial init values)."""
  torch.manual_seed({"qwen3": 0, "qwen2": 1, "llama": 2}[family])
  if family == "qwen3":
    cfg = transformers.Qwen3Config(**COMMON, head_dim=8, rope_theta=1e4, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(cfg)
  elif family == "qwen2":
    cfg = transformers.Qwen2Config(**COMMON, rope_theta=1e4, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg)
  else:
    cfg = transformers.LlamaConfig(**COMMON, head_dim=8, rope_theta=100.0,
                                   rope_scaling=dict(LLAMA3_ROPE), max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (folder, tokens [2, SEQ], reference logits [2, SEQ, V]) for three tiny models."""
  out = {}
  tokens = np.random.RandomState(0).randint(0, VOCAB, (2, SEQ))
  for family in ("qwen3", "qwen2", "llama"):
    model = _hf_model(family)
    folder = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(folder)
    for name, text in TOKENIZER_TEXT.items():
      with open(os.path.join(folder, name), "w") as f:
        f.write(text)
    out[family] = (folder, tokens, _torch_logits(model, tokens))
  return out


def _logits(model, tokens) -> np.ndarray:
  return np.asarray(model(jnp.asarray(tokens)))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_logits_match_transformers(checkpoints, family):
  folder, tokens, ref = checkpoints[family]
  model = from_hf(folder)
  cfg = model.cfg
  assert (cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings) == {
      "qwen3": (True, False, True), "qwen2": (False, True, False),
      "llama": (False, False, False)}[family]
  np.testing.assert_allclose(_logits(model, tokens), ref, atol=1e-4, rtol=0)
  if family == "llama":  # The sequence outruns original_max_position_embeddings: scaling matters.
    assert cfg.rope_scaling_type == "llama3" and cfg.rope_original_max_len == 16 < SEQ
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(
        dataclasses.replace(cfg, rope_scaling_type=None), rngs=nnx.Rngs(0))))
    unscaled = nnx.merge(graphdef, nnx.state(model, nnx.Param))
    assert np.abs(_logits(unscaled, tokens) - ref).max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_to_hf_loads_in_transformers(checkpoints, family, tmp_path):
  folder, tokens, ref = checkpoints[family]
  to_hf(from_hf(folder), tmp_path)  # tokenizer files come from the remembered source folder
  with open(tmp_path / "config.json") as f:
    written = json.load(f)
  assert written["architectures"] == [
      {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[family]]
  for name, text in TOKENIZER_TEXT.items():
    assert (tmp_path / name).read_text() == text
  assert (tmp_path / "model.safetensors").exists() and not (tmp_path / hf_lib.INDEX_FILE).exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  np.testing.assert_allclose(_torch_logits(reloaded, tokens), ref, atol=1e-5, rtol=0)


def test_sharded_save_round_trips(checkpoints, tmp_path):
  folder, tokens, ref = checkpoints["qwen2"]
  model = from_hf(folder)
  to_hf(model, tmp_path, max_shard_bytes=8192)
  with open(tmp_path / hf_lib.INDEX_FILE) as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
  assert all((tmp_path / s).exists() for s in shards)
  np.testing.assert_allclose(_logits(from_hf(tmp_path), tokens), ref, atol=1e-4, rtol=0)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  np.testing.assert_allclose(_torch_logits(reloaded, tokens), ref, atol=1e-5, rtol=0)
  to_hf(model, tmp_path)  # saving again unsharded removes the stale shards
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_bfloat16(checkpoints, tmp_path):
  folder, tokens, ref = checkpoints["qwen3"]
  scale = np.abs(ref).max()
  model = from_hf(folder, dtype="bfloat16")
  assert model.embed[...].dtype == jnp.bfloat16 and model.cfg.dtype == "bfloat16"
  out = _logits(model, tokens)
  assert np.isfinite(out).all() and np.abs(out - ref).max() < 0.05 * scale
  to_hf(model, tmp_path)  # bf16 weights stay bf16 on disk and load back in both libraries
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
  from_file = from_hf(tmp_path)  # bf16 tensors read into float32
  assert from_file.embed[...].dtype == jnp.float32
  assert np.abs(_logits(from_file, tokens) - ref).max() < 0.05 * scale


_SHARDED_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec
    from oapl_jax.models import from_hf
    assert jax.device_count() == 8, jax.devices()
    folder = {folder!r}
    tokens = np.random.RandomState(0).randint(0, {vocab}, (2, {seq}))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rules = {{"embed": "data", "vocab_embed": "data", "q_heads": "model", "mlp": "model",
             "vocab": "model"}}
    plain = from_hf(folder)
    sharded = from_hf(folder, mesh=mesh, rules=rules)
    q = sharded.layers[0].attn.q_proj[...]
    assert q.sharding.spec == PartitionSpec("data", "model", None), q.sharding
    assert q.addressable_shards[0].data.shape == (16, 1, 8), q.addressable_shards[0].data.shape
    assert sharded.lm_head[...].sharding.spec == PartitionSpec("data", "model")
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
    for a, b in zip(leaves(plain), leaves(sharded)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(sharded(tokens)), np.asarray(plain(tokens)),
                               atol=1e-5, rtol=0)
    try:
      from_hf(folder, mesh=mesh, rules={{**rules, "kv_heads": "model"}})
      raise SystemExit("expected a divisibility error")
    except ValueError as e:
      assert "k_proj" in str(e) and "does not divide" in str(e), e
    print("SHARDED_OK")
""")


def test_load_sharded_on_8_fake_devices(checkpoints):
  folder = checkpoints["qwen2"][0]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
  script = _SHARDED_SCRIPT.format(folder=folder, vocab=VOCAB, seq=SEQ)
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0 and "SHARDED_OK" in result.stdout, result.stderr[-3000:]


def _llama_config_dict(layout: str) -> dict:
  """A hand-written Llama config.json in the transformers-4 or -5 rope layout."""
  base = dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=8,
              hidden_act="silu", max_position_embeddings=64, tie_word_embeddings=False)
  if layout == "v5":
    return dict(base, rope_parameters=dict(LLAMA3_ROPE, rope_theta=100.0))
  old_style = {("type" if k == "rope_type" else k): v for k, v in LLAMA3_ROPE.items()}
  return dict(base, rope_theta=100.0, rope_scaling=old_style)


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_config_layouts(checkpoints, layout, tmp_path):
  folder, tokens, ref = checkpoints["llama"]
  shutil.copy(os.path.join(folder, "model.safetensors"), tmp_path)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(_llama_config_dict(layout), f)
  model = from_hf(tmp_path)
  cfg = model.cfg
  assert (cfg.rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
          cfg.rope_high_freq_factor, cfg.rope_original_max_len) == (100.0, "llama3", 8.0, 1.0, 4.0, 16)
  np.testing.assert_allclose(_logits(model, tokens), ref, atol=1e-4, rtol=0)


def test_default_rope_in_both_layouts():
  v4 = dict(COMMON, architectures=["Qwen3ForCausalLM"], rope_theta=5e5, rope_scaling=None)
  v5 = dict(COMMON, architectures=["Qwen3ForCausalLM"],
            rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
  a, b = hf_lib.model_config_from_hf(v4), hf_lib.model_config_from_hf(v5)
  assert a == b and a.rope_theta == 5e5 and a.rope_scaling_type is None and a.head_dim == 8


def _rewrite_tensors(src: str, dst, edit) -> None:
  """Copies checkpoint folder `src` to `dst`, with `edit(tensors)` applied to its weights."""
  shutil.copytree(src, dst, dirs_exist_ok=True)
  file = os.path.join(dst, "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  edit(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype,name", [(jnp.float32, "float32"), (np.float32, "float32"),
                                        ("float32", "float32"), (jnp.bfloat16, "bfloat16"),
                                        (jnp.dtype("bfloat16"), "bfloat16"), (np.float16, "float16")],
                         ids=["jnp.float32", "np.float32", "name", "jnp.bfloat16", "jnp.dtype",
                              "np.float16"])
def test_dtype_as_jax_users_write_it(checkpoints, dtype, name):
  folder = checkpoints["qwen3"][0]
  model = from_hf(folder, dtype=dtype)
  assert model.embed[...].dtype == jnp.dtype(name)
  assert model.cfg.dtype == model.cfg.param_dtype == name  # one canonical name in the config
  cfg = ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, mlp_dim=8, param_dtype=dtype, dtype=dtype)
  assert (cfg.param_dtype, cfg.dtype) == (name, name)


@pytest.mark.parametrize("dtype", ["float8", 3, None, float, jnp.int8])
def test_unsupported_dtype_is_refused_by_name(checkpoints, dtype):
  folder = checkpoints["qwen3"][0]
  with pytest.raises(ValueError, match=r"dtype=.* is not supported; use one of \['bfloat16', "
                                       r"'float16', 'float32'\]"):
    from_hf(folder, dtype=dtype)
  with pytest.raises(ValueError, match=r"model\.param_dtype=.* is not supported"):
    ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, mlp_dim=8, param_dtype=dtype)


def test_errors(checkpoints, tmp_path):
  folder = checkpoints["qwen2"][0]
  name = "model.layers.1.mlp.up_proj.weight"

  _rewrite_tensors(folder, tmp_path / "missing", lambda t: t.pop(name))
  with pytest.raises(ValueError, match=f"'{name}' is missing"):
    from_hf(tmp_path / "missing")

  def reshape(t):
    t[name] = t[name][:, :-1]
  _rewrite_tensors(folder, tmp_path / "shape", reshape)
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(48, 31\), expected \(48, 32\)"):
    from_hf(tmp_path / "shape")

  def add_bias(t):
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  _rewrite_tensors(folder, tmp_path / "extra", add_bias)
  with pytest.raises(ValueError, match="o_proj.bias"):
    from_hf(tmp_path / "extra")

  def edit_config(sub, **changes):
    shutil.copytree(folder, tmp_path / sub)
    cfg = {**hf_lib.read_hf_config(folder), **changes}
    with open(tmp_path / sub / "config.json", "w") as f:
      json.dump(cfg, f)
    return tmp_path / sub

  with pytest.raises(ValueError, match="'MistralForCausalLM' is not supported"):
    from_hf(edit_config("arch", architectures=["MistralForCausalLM"], model_type="mistral"))
  with pytest.raises(ValueError, match="unknown rope type 'yarn'"):
    from_hf(edit_config("rope", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                 "factor": 4.0}))
  with pytest.raises(ValueError, match="dtype='int8' is not supported"):
    from_hf(folder, dtype="int8")
  with pytest.raises(ValueError, match="no config.json"):
    from_hf(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="rope_scaling_type"):
    ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, mlp_dim=8, rope_scaling_type="yarn")


def test_preset_param_counts():
  assert abs(param_count("qwen3_4b") - 4.02e9) < 0.01 * 4.02e9
  assert abs(param_count("r1_distill_qwen_14b") - 14.77e9) < 0.01 * 14.77e9
  assert abs(param_count("llama3_1_8b") - 8.03e9) < 0.01 * 8.03e9
  assert param_count("qwen3_8b") > param_count("qwen3_4b") > param_count("qwen3_1_7b")
  for name, kwargs in PRESETS.items():
    cfg = ModelConfig(**kwargs)
    assert cfg.num_heads % cfg.num_kv_heads == 0
    if not name.startswith("tiny_"):  # every published model here uses 128-wide heads
      assert cfg.head_dim == 128, name
