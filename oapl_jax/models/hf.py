"""Hugging Face checkpoints <-> our NNX `Transformer`.

* `from_hf(path)` reads a local HF folder (`config.json` + `model.safetensors`, or shards listed
  in `model.safetensors.index.json`) of a `Qwen3ForCausalLM`, `Qwen2ForCausalLM` or
  `LlamaForCausalLM`. The model is built abstractly (`nnx.eval_shape`, no weights allocated),
  then each weight is read from safetensors one tensor at a time, converted to our layout and
  placed on device — sharded over a `mesh` by its `logical_axes` when a mesh is given
  (`oapl_jax.sharding`).
* `to_hf(model, out_dir)` writes `config.json`, safetensors (sharded above `max_shard_bytes`)
  and the tokenizer files of the folder the model was loaded from, so that
  `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads it.

Layouts (ours vs Hugging Face's `nn.Linear` weights, which are `[out, in]`):

    embed         [V, E]     model.embed_tokens.weight         [V, E]
    lm_head       [E, V]     lm_head.weight                    [V, E]
    q_proj        [E, N, D]  ...self_attn.q_proj.weight        [N*D, E]   (k, v: K heads)
    q_bias        [N, D]     ...self_attn.q_proj.bias          [N*D]      (k, v: K heads)
    o_proj        [N, D, E]  ...self_attn.o_proj.weight        [E, N*D]
    gate/up_proj  [E, M]     ...mlp.gate_proj/up_proj.weight   [M, E]
    down_proj     [M, E]     ...mlp.down_proj.weight           [E, M]
    norms         [E] / [D]  ...layernorm / q_norm / k_norm    same
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh

from oapl_jax import sharding
from oapl_jax.models.names import dtype_name
from oapl_jax.models.transformer import ModelConfig, Transformer

ARCHITECTURES = {  # HF architecture -> model_type
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
# dtype name (names.DTYPE_NAMES) -> the NumPy type weights are read into.
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-architecture keys of the source config.json that `to_hf` carries over.
_KEPT_SOURCE_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                     "initializer_range", "use_cache")
# Buffers some old checkpoints store; recomputed from the config, so ignored on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SOURCE_ATTR = "hf_source_dir"  # Attribute of a loaded model: the folder it came from.


# ----------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed `config.json` of HF folder `path`."""
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise ValueError(f"{path}: no config.json (expected a Hugging Face model folder)")
  with open(file) as f:
    return json.load(f)


def hf_architecture(hf: Mapping[str, Any], source: str = "config.json") -> str:
  """The supported HF architecture named by `hf` (`architectures[0]`, else `model_type`)."""
  archs = hf.get("architectures") or []
  by_type = {t: a for a, t in ARCHITECTURES.items()}
  name = archs[0] if archs else by_type.get(hf.get("model_type"), hf.get("model_type"))
  if name not in ARCHITECTURES:
    raise ValueError(f"{source}: architecture {name!r} is not supported; "
                     f"supported: {sorted(ARCHITECTURES)}")
  return name


def _rope_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
  """ModelConfig RoPE kwargs from either config layout.

  transformers 5: `rope_parameters = {rope_theta, rope_type, factor, ...}`;
  transformers 4: top-level `rope_theta` and `rope_scaling = {rope_type | type, factor, ...}`.
  """
  params = hf.get("rope_parameters")
  if params:
    if any(isinstance(v, Mapping) for v in params.values()):
      raise ValueError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  else:
    params = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", 10000.0)
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported (only 1.0)")
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type == "default":
    return dict(rope_theta=float(theta))
  if rope_type != "llama3":
    raise ValueError(f"{source}: unknown rope type {rope_type!r}; supported: 'default', 'llama3'")
  original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
  for key, value in [("factor", params.get("factor")),
                     ("low_freq_factor", params.get("low_freq_factor")),
                     ("high_freq_factor", params.get("high_freq_factor")),
                     ("original_max_position_embeddings", original)]:
    if value is None:
      raise ValueError(f"{source}: rope type 'llama3' needs {key!r}")
  return dict(rope_theta=float(theta), rope_scaling_type="llama3",
              rope_scaling_factor=float(params["factor"]),
              rope_low_freq_factor=float(params["low_freq_factor"]),
              rope_high_freq_factor=float(params["high_freq_factor"]),
              rope_original_max_len=int(original))


def _check_supported(hf: Mapping[str, Any], arch: str, source: str) -> None:
  """Raises ValueError for HF options our transformer cannot represent."""
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
  if arch != "Qwen2ForCausalLM" and hf.get("attention_bias", False):
    raise ValueError(f"{source}: attention_bias=true (a bias on o_proj) is not supported for {arch}")
  if hf.get("mlp_bias", False):
    raise ValueError(f"{source}: mlp_bias=true is not supported")
  layer_types = hf.get("layer_types") or []
  if hf.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
    raise ValueError(f"{source}: sliding-window attention is not supported")


def model_config_from_hf(hf: Mapping[str, Any], *, dtype: Any = "float32",
                         source: str = "config.json") -> ModelConfig:
  """ModelConfig of an HF config dict; `dtype` (a name or a NumPy/JAX dtype, e.g.
  jnp.bfloat16) is both the weight and the compute dtype."""
  dtype = dtype_name(dtype)
  arch = hf_architecture(hf, source)
  _check_supported(hf, arch, source)
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
  missing = [k for k in required if hf.get(k) is None]
  if missing:
    raise ValueError(f"{source}: missing field(s) {missing}")
  heads = hf["num_attention_heads"]
  return ModelConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=arch == "Qwen3ForCausalLM", qkv_bias=arch == "Qwen2ForCausalLM",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings"),
      param_dtype=dtype, dtype=dtype, **_rope_fields(hf, source))


def architecture_of(cfg: ModelConfig) -> str:
  """HF architecture for a config: qk_norm -> Qwen3, qkv_bias -> Qwen2, else Llama."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("model.qk_norm and model.qkv_bias together have no Hugging Face "
                     "architecture (Qwen3's attention_bias also adds an o_proj bias)")
  if cfg.qk_norm:
    return "Qwen3ForCausalLM"
  return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config_from_model_config(cfg: ModelConfig,
                                source: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """An HF `config.json` dict (transformers-4 rope layout, which transformers 5 reads).

  `source` (the original config.json) contributes only token ids and similar
  non-architecture keys (`_KEPT_SOURCE_KEYS`).
  """
  arch = architecture_of(cfg)
  hf = {k: source[k] for k in _KEPT_SOURCE_KEYS if source and k in source}
  if cfg.max_position_embeddings is not None:
    hf["max_position_embeddings"] = cfg.max_position_embeddings
  hf.update(
      architectures=[arch], model_type=ARCHITECTURES[arch], vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
      tie_word_embeddings=cfg.tie_embeddings, torch_dtype=cfg.param_dtype,
      attention_dropout=0.0)
  if cfg.rope_scaling_type == "llama3":
    hf["rope_scaling"] = dict(
        rope_type="llama3", factor=cfg.rope_scaling_factor,
        low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position_embeddings=cfg.rope_original_max_len)
  if arch == "Qwen2ForCausalLM":
    hf.update(use_sliding_window=False, sliding_window=None)
  else:
    hf.update(attention_bias=False)
  if arch == "LlamaForCausalLM":
    hf.update(mlp_bias=False)
  return hf


# ----------------------------------------------------------------------------------------
# Tensor names and layouts


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one of our tensors (shape `ours`) is stored in an HF checkpoint."""
  hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # our shape -> HF shape
  to_ours: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]  # (HF array, our shape) -> ours
  to_hf: Callable[[np.ndarray], np.ndarray]  # ours -> HF array


SAME = Layout(lambda s: s, lambda a, s: a, lambda a: a)
TRANSPOSE = Layout(lambda s: s[::-1], lambda a, s: a.T, lambda a: a.T)
# ours [E, H, D] <-> HF [H*D, E]
HEADS_IN = Layout(lambda s: (s[1] * s[2], s[0]), lambda a, s: a.T.reshape(s),
                  lambda a: a.reshape(a.shape[0], -1).T)
# ours [N, D, E] <-> HF [E, N*D]
HEADS_OUT = Layout(lambda s: (s[2], s[0] * s[1]), lambda a, s: a.T.reshape(s),
                   lambda a: a.reshape(-1, a.shape[-1]).T)
# ours [H, D] <-> HF [H*D]
FLAT = Layout(lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s), lambda a: a.reshape(-1))

_TOP_LEVEL = {
    ("embed",): ("model.embed_tokens.weight", SAME),
    ("lm_head",): ("lm_head.weight", TRANSPOSE),
    ("final_norm", "weight"): ("model.norm.weight", SAME),
}
_IN_LAYER = {
    ("input_norm", "weight"): ("input_layernorm.weight", SAME),
    ("post_attn_norm", "weight"): ("post_attention_layernorm.weight", SAME),
    ("attn", "q_proj"): ("self_attn.q_proj.weight", HEADS_IN),
    ("attn", "k_proj"): ("self_attn.k_proj.weight", HEADS_IN),
    ("attn", "v_proj"): ("self_attn.v_proj.weight", HEADS_IN),
    ("attn", "o_proj"): ("self_attn.o_proj.weight", HEADS_OUT),
    ("attn", "q_bias"): ("self_attn.q_proj.bias", FLAT),
    ("attn", "k_bias"): ("self_attn.k_proj.bias", FLAT),
    ("attn", "v_bias"): ("self_attn.v_proj.bias", FLAT),
    ("attn", "q_norm", "weight"): ("self_attn.q_norm.weight", SAME),
    ("attn", "k_norm", "weight"): ("self_attn.k_norm.weight", SAME),
    ("mlp", "gate_proj"): ("mlp.gate_proj.weight", TRANSPOSE),
    ("mlp", "up_proj"): ("mlp.up_proj.weight", TRANSPOSE),
    ("mlp", "down_proj"): ("mlp.down_proj.weight", TRANSPOSE),
}


def hf_tensor(path: tuple) -> tuple[str, Layout]:
  """(HF tensor name, layout) of our parameter at `path`, e.g. ("layers", 0, "attn", "q_proj")."""
  path = tuple(path)
  if path in _TOP_LEVEL:
    return _TOP_LEVEL[path]
  if len(path) > 2 and path[0] == "layers" and path[2:] in _IN_LAYER:
    name, layout = _IN_LAYER[path[2:]]
    return f"model.layers.{path[1]}.{name}", layout
  raise ValueError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")


def _param_entries(model: nnx.Module) -> list[tuple[tuple, nnx.Variable]]:
  """(path, Param variable) of every weight of `model`, in a stable order."""
  return [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


# ----------------------------------------------------------------------------------------
# Loading


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file of folder `path` (single file or sharded index)."""
  single = os.path.join(path, SINGLE_FILE)
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(single):
    with safetensors.safe_open(single, framework="numpy") as f:
      return {k: single for k in f.keys()}
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  raise ValueError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


def _read_tensor(handles: dict, files: Mapping[str, str], name: str, hf_shape,
                 source: str) -> np.ndarray:
  """HF tensor `name` as numpy, after checking that it exists with shape `hf_shape`."""
  if name not in files:
    raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
  tensor = handles[files[name]].get_slice(name)
  got = tuple(tensor.get_shape())
  if got != tuple(hf_shape):
    raise ValueError(f"{source}: tensor {name!r} has shape {got}, expected {tuple(hf_shape)}")
  return handles[files[name]].get_tensor(name)


def from_hf(path: str | os.PathLike, *, dtype: Any = "float32", param_dtype: Any = None,
            mesh: Mesh | None = None, rules: sharding.Rules | None = None) -> Transformer:
  """Loads a local Hugging Face checkpoint folder into a `Transformer`.

  dtype: compute dtype: "float32", "bfloat16", "float16", or the NumPy/JAX dtype
  (jnp.bfloat16, np.float32, jnp.dtype("float16")). param_dtype: the dtype the weights are
  stored in (mixed precision: float32 master weights, bfloat16 compute); None = `dtype`.
  mesh, rules: with a mesh, each weight becomes a global array sharded by its logical_axes
  through `rules` (`(logical axis, mesh axes)` pairs as in config.sharding.rules, or a
  mapping; axes without a rule replicated: `oapl_jax.sharding`); a dimension that does not
  divide over its mesh axes is a ValueError naming the tensor.
  Only one tensor at a time is held on the host. The returned model remembers `path`
  (attribute `hf_source_dir`) so `to_hf` can copy its tokenizer files.
  """
  path = os.fspath(path)
  dtype = dtype_name(dtype)  # refused before any file is read
  param_dtype = dtype if param_dtype is None else dtype_name(param_dtype, "param_dtype")
  hf_cfg = read_hf_config(path)
  cfg = dataclasses.replace(
      model_config_from_hf(hf_cfg, dtype=dtype, source=os.path.join(path, "config.json")),
      param_dtype=param_dtype)
  files = _weight_files(path)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  flat = nnx.to_flat_state(state)
  expected = set()
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(safetensors.safe_open(f, framework="numpy"))
               for f in sorted(set(files.values()))}
    for p, var in flat:
      name, layout = hf_tensor(p)
      expected.add(name)
      shape = tuple(var.get_value().shape)
      hf_arr = _read_tensor(handles, files, name, layout.hf_shape(shape), path)
      host = np.ascontiguousarray(layout.to_ours(hf_arr, shape).astype(DTYPES[param_dtype]))
      del hf_arr
      var.set_value(sharding.place(host, var.get_metadata().get("logical_axes"), mesh, rules, name))
  ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
  unexpected = sorted(n for n in set(files) - expected - ignored
                      if not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    more = " ..." if len(unexpected) > 5 else ""
    raise ValueError(f"{path}: tensors the {hf_architecture(hf_cfg)} model has no place for: "
                     f"{unexpected[:5]}{more}")
  model = nnx.merge(graphdef, nnx.from_flat_state(flat))
  setattr(model, SOURCE_ATTR, path)
  return model


# ----------------------------------------------------------------------------------------
# Saving


def _to_host(x: jax.Array) -> np.ndarray:
  """Whole array on this host (gathered across processes when not fully addressable)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
  """Groups tensor indices, in order, into shards of at most `max_shard_bytes` each
  (a tensor bigger than that gets a shard of its own)."""
  shards, current, used = [], [], 0
  for i, size in enumerate(sizes):
    if current and used + size > max_shard_bytes:
      shards.append(current)
      current, used = [], 0
    current.append(i)
    used += size
  return shards + [current] if current else shards


def _shard_name(i: int, n: int) -> str:
  return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _remove_stale_weights(out_dir: str, keep: set[str]) -> None:
  """Deletes weight files of an earlier save into `out_dir` that this save did not write."""
  for f in os.listdir(out_dir):
    stale = f == SINGLE_FILE or f == INDEX_FILE or (f.startswith("model-") and f.endswith(".safetensors"))
    if stale and f not in keep:
      os.remove(os.path.join(out_dir, f))


def _copy_tokenizer_files(source_dir: str, out_dir: str) -> None:
  for f in TOKENIZER_FILES:
    src = os.path.join(source_dir, f)
    dst = os.path.join(out_dir, f)
    if os.path.isfile(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
      shutil.copyfile(src, dst)


def to_hf(model: Transformer, out_dir: str | os.PathLike, *, max_shard_bytes: int = 2**31,
          source_dir: str | os.PathLike | None = None) -> None:
  """Writes `model` as a Hugging Face checkpoint folder loadable by transformers.

  Files: `config.json`; `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json` when the weights exceed `max_shard_bytes`; and the tokenizer
  files (`TOKENIZER_FILES`) found in `source_dir` (default: the folder `from_hf` loaded the
  model from). Weights keep their dtype. Only one shard at a time is gathered on the host;
  in a multi-process run every process must call this, and process 0 writes.
  """
  cfg = model.cfg
  out_dir = os.fspath(out_dir)
  source_dir = source_dir if source_dir is not None else getattr(model, SOURCE_ATTR, None)
  source_cfg = None
  if source_dir is not None and os.path.isfile(os.path.join(source_dir, "config.json")):
    source_cfg = read_hf_config(source_dir)
  hf_cfg = hf_config_from_model_config(cfg, source_cfg)
  writer = jax.process_index() == 0
  entries = [(hf_tensor(p), var.get_value()) for p, var in _param_entries(model)]
  shards = plan_shards([x.size * x.dtype.itemsize for _, x in entries], max_shard_bytes)
  if writer:
    os.makedirs(out_dir, exist_ok=True)
  weight_map, written = {}, set()
  for i, shard in enumerate(shards):
    file = _shard_name(i, len(shards))
    tensors = {}
    for j in shard:
      (name, layout), x = entries[j]
      tensors[name] = np.ascontiguousarray(layout.to_hf(_to_host(x)))
      weight_map[name] = file
    if writer:
      safetensors.numpy.save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
      written.add(file)
    del tensors
  if not writer:
    return
  if len(shards) > 1:
    total = sum(x.size * x.dtype.itemsize for _, x in entries)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
    written.add(INDEX_FILE)
  _remove_stale_weights(out_dir, written)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  if source_dir is not None:
    _copy_tokenizer_files(os.fspath(source_dir), out_dir)
