"""Low-rank adapters (LoRA) on the transformer's projections, built on Flax NNX's `nnx.LoRA`.

    lora = LoraConfig(rank=16, alpha=32.0, targets=TARGETS)
    model = attach(Transformer(cfg, rngs=nnx.Rngs(params=0)), lora, seed=0)
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, nnx.Param)

Each targeted projection W of every block gets an `Adapter` (an `nnx.LoRA`: `lora_a` `[in, r]`
from a variance-scaling init, `lora_b` `[r, out]` zeros, both `nnx.LoRAParam`) and computes
`x W + (alpha / r) (x A) B`; `in` and `out` are W's input and output dimensions flattened (q_proj
`[E, N, D]`: E -> N*D, head-major as Hugging Face's q_proj rows). The adapters are attached after
the base is built, from their own random stream, so the base is the same weights with or
without them, and at init (B = 0) every output is the base's, bit for bit. `nnx.LoRAParam` is
a subclass of `nnx.Param`: split the adapters first (`nnx.split(model, nnx.LoRAParam,
nnx.Param)`). The trainer differentiates the adapters only; the base is frozen.

Why Flax NNX's LoRA and not qwix: the projections here are multi-axis einsums over weights that
the engine re-lays out (`sampling/layout.py`), and the remat path stacks each block's weights into
one scan; an adapter module beside each weight keeps both as they are, where qwix intercepts
the einsum calls by module path. A quantised base (model.base_quant) is `models/quant.py`'s.

The engine never sees adapters: at a refresh it samples from `merged(base, adapters)`, the base
weights plus the scaled product, computed in float32 and rounded once to the base's dtype
(docs/design.md "Low-rank adapters" for why merge and not apply). `to_peft` writes the adapters
in PEFT's format (loaded by `peft.PeftModel.from_pretrained` onto the Hugging Face model);
`to_hf(nnx.merge(base_graphdef, merged(...)))` writes merged weights.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.errors import ConfigError
from oapl_jax.models.names import LORA_TARGETS
from oapl_jax.models.quant import is_qarray
from oapl_jax.models.transformer import ADAPTER_SUFFIX as SUFFIX
from oapl_jax.models.transformer import ModelConfig, Transformer

TARGETS = LORA_TARGETS  # every projection of a block
ATTENTION_TARGETS = TARGETS[:4]  # q, k, v, o: in `Attention`; the rest in `MLP`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Rank, scale and targets of the adapters (config.model.lora)."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS
  param_dtype: str = "float32"  # the adapters' (and their AdamW state's) dtype

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"model.lora.targets={self.targets!r}: each must be one of {TARGETS}")
    if self.rank < 1:
      raise ValueError(f"model.lora.rank={self.rank} must be >= 1")

  @classmethod
  def from_config(cls, model) -> "LoraConfig | None":
    """The adapters of an ml_collections `config.model` section; None when `model.lora.rank`
    is 0 (full fine-tuning)."""
    lora = model.get("lora")
    if lora is None or not lora.rank:
      return None
    return cls(rank=int(lora.rank), alpha=float(lora.alpha), targets=tuple(lora.targets),
               param_dtype=model.param_dtype)

  def record(self) -> dict:
    """What a checkpoint records of the adapters."""
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
            "param_dtype": self.param_dtype}


class Adapter(nnx.LoRA):
  """`nnx.LoRA` without a base module, its output scaled by alpha / rank (in the compute dtype)."""

  def __init__(self, *args, scale: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.scale = scale

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x) * jnp.asarray(self.scale, self.dtype)


def _shape(cfg: ModelConfig, target: str) -> tuple[int, int, str, str]:
  """(in_features, out_features, in logical axis, out logical axis) of a target's W flattened."""
  e, f = cfg.hidden_size, cfg.mlp_dim
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"q_proj": (e, q, "embed", "q_heads"), "k_proj": (e, kv, "embed", "kv_heads"),
          "v_proj": (e, kv, "embed", "kv_heads"), "o_proj": (q, e, "q_heads", "embed"),
          "gate_proj": (e, f, "embed", "mlp"), "up_proj": (e, f, "embed", "mlp"),
          "down_proj": (f, e, "mlp", "embed")}[target]


def attach(model: Transformer, lora: LoraConfig, seed: int) -> Transformer:
  """`model` with an `Adapter` beside each targeted projection of every block (attributes
  `<target>_lora` of the block's `attn` / `mlp`), initialised from `seed` alone: the base's
  weights are not touched and its random stream not consumed."""
  cfg = model.cfg
  rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 0x10A))  # the adapters' own stream
  for layer in model.layers:
    for target in lora.targets:
      n_in, n_out, in_axis, out_axis = _shape(cfg, target)
      module = layer.attn if target in ATTENTION_TARGETS else layer.mlp
      setattr(module, target + SUFFIX, Adapter(
          n_in, lora.rank, n_out, scale=lora.scale, dtype=cfg.dtype, param_dtype=lora.param_dtype,
          rngs=rngs, a_metadata={"logical_axes": (in_axis, None)},
          b_metadata={"logical_axes": (None, out_axis)}))
  return model


def _targets_of(adapters) -> dict[tuple, tuple[jax.Array, jax.Array]]:
  """{base weight path: (A, B)} of an adapters State (paths `.../q_proj_lora/lora_a`)."""
  flat = dict(nnx.to_flat_state(adapters))
  out = {}
  for path in flat:
    if path[-1] == "lora_a":
      owner, name = path[:-2], path[-2][:-len(SUFFIX)]
      out[(*owner, name)] = (flat[path].get_value(), flat[(*path[:-1], "lora_b")].get_value())
  return out


def delta(a: jax.Array, b: jax.Array, scale: float, shape) -> jax.Array:
  """scale * A B in float32, shaped as the base weight `shape`."""
  return (scale * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))).reshape(shape)


def merged(base, adapters, scale: float):
  """The base weights State with each adapted weight replaced by W + scale * A B: A and B
  rounded to W's dtype first (the compute dtype, in which the trainer applies them: pi_old is
  the adapters in it), the product and sum in float32, rounded once to W's dtype. The engines'
  weights; at B = 0 exactly W. Jit it with the base's shardings to merge on the devices.
  A quantised base (`quant.QArray` weights, model.base_quant) comes out as plain arrays of its
  dtype: each W is the array its QArray reads as."""
  targets = _targets_of(adapters)
  out = []
  for path, var in nnx.to_flat_state(base):
    w = var.get_value()
    if tuple(path) in targets:
      w = merge_weight(w, *targets[tuple(path)], scale)
    elif is_qarray(w):
      w = w.dequantize()
    out.append((path, var.replace(w)))
  return nnx.from_flat_state(out)


def merge_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """One weight of `merged`: W + scale * A B, A and B rounded to W's dtype, the product and the
  sum in float32, rounded once to W's dtype (also the refresh's per-layer merge under
  model.lora.merge="in_refresh": `sampling.layout.MergeOnLoad`, the same values bit for bit)."""
  a, b = a.astype(w.dtype), b.astype(w.dtype)
  return (w.astype(jnp.float32) + delta(a, b, scale, w.shape)).astype(w.dtype)


def targets_of(adapters) -> dict[tuple, tuple[jax.Array, jax.Array]]:
  """{base weight path: (A, B)} of an adapters State."""
  return _targets_of(adapters)


# --- PEFT export -------------------------------------------------------------------------------

_HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
              "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
              "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}


def to_peft(adapters, lora: LoraConfig, out_dir: str | os.PathLike, *,
            base_model: str | None = None) -> None:
  """Writes `adapters` as a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors)
  for the Hugging Face model of the base: `peft.PeftModel.from_pretrained(hf_model, out_dir)`.
  PEFT's lora_A.weight is `[r, in]` and lora_B.weight `[out, r]` (torch Linear layout), so A and
  B are written transposed, in float32; its scale is lora_alpha / r, as here."""
  from safetensors.numpy import save_file  # noqa: PLC0415

  os.makedirs(out_dir, exist_ok=True)
  tensors = {}
  for path, (a, b) in _targets_of(adapters).items():
    if path[0] != "layers":
      raise ValueError(f"adapter at {'/'.join(map(str, path))} is not in a block")
    prefix = f"base_model.model.model.layers.{path[1]}.{_HF_MODULE[path[-1]]}"
    tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(a), np.float32).T)
    tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(b), np.float32).T)
  save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "target_modules": sorted(lora.targets), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base_model}
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)


# --- PEFT import (config.model.lora.init_from) --------------------------------------------------

_PEFT_PREFIX = "base_model.model.model.layers."
_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "qk_norm", "qkv_bias", "tie_embeddings")


def _same_base_name(theirs: str, ours: str) -> bool:
  """Whether PEFT's `base_model_name_or_path` and model.path may name one model: the same
  folder, or the same last path component (a Hub id `Qwen/Qwen3-0.6B` and a local
  `/data/Qwen3-0.6B`), case aside."""
  if os.path.realpath(theirs) == os.path.realpath(ours):
    return True
  last = lambda p: os.path.basename(os.path.normpath(p)).lower()  # noqa: E731
  return last(theirs) == last(ours)


def read_peft(path: str, lora: LoraConfig, cfg: ModelConfig, *, model_path: str | None = None,
              check_name: bool = True) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
  """The adapters of the PEFT LoRA adapter folder `path` (adapter_config.json and
  adapter_model.safetensors, as `PeftModel.save_pretrained` and `to_peft` write them), as
  {(layer, target): (A `[in, r]`, B `[r, out]`)} in float32 (PEFT's torch Linear layout
  transposed), for the base `cfg` and the adapters `lora` (config.model.lora).

  Refused, each with a one-line ConfigError naming config.model.lora.init_from and the file: a
  missing or unreadable file; another adapter kind or a LoRA variant this model does not
  compute (DoRA, rsLoRA, per-module ranks or alphas, biases, fan_in_fan_out, extra trained
  modules); r, lora_alpha or target_modules other than model.lora's rank, alpha and targets; a
  tensor missing, extra or of another shape; and where it can be told, another base: the
  named base_model_name_or_path is a local folder whose config.json is another architecture,
  or (check_name) its last path component differs from model.path's."""
  from safetensors.flax import load_file  # noqa: PLC0415  (bfloat16 too, which NumPy lacks)

  where = f"config.model.lora.init_from={path!r}"
  config_file = os.path.join(path, "adapter_config.json")
  weights_file = os.path.join(path, "adapter_model.safetensors")

  def refuse(file, why):
    return ConfigError(f"{where}: {file}: {why}")

  if not os.path.isdir(path):
    raise ConfigError(f"{where}: no such folder (a PEFT LoRA adapter: adapter_config.json and "
                      "adapter_model.safetensors)")
  try:
    with open(config_file) as f:
      peft = json.load(f)
    if not isinstance(peft, dict):
      raise ValueError("not a JSON object")
  except FileNotFoundError:
    raise refuse(config_file, "missing (a PEFT adapter folder holds adapter_config.json)") from None
  except (OSError, ValueError) as e:
    raise refuse(config_file, f"unreadable: {e}".replace("\n", " ")) from None

  def field(key, default=None):
    return peft.get(key, default)

  if field("peft_type") != "LORA":
    raise refuse(config_file, f"peft_type={field('peft_type')!r}: only 'LORA' adapters start a run")
  unsupported = [(k, field(k)) for k, ok in (
      ("use_dora", lambda v: not v), ("use_rslora", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
      ("bias", lambda v: v in (None, "none")), ("rank_pattern", lambda v: not v),
      ("alpha_pattern", lambda v: not v), ("modules_to_save", lambda v: not v),
      ("layers_to_transform", lambda v: v is None), ("use_qalora", lambda v: not v),
      ("lora_bias", lambda v: not v)) if not ok(field(k))]
  if unsupported:
    shown = ", ".join(f"{k}={v!r}" for k, v in unsupported)
    raise refuse(config_file, f"{shown}: not a plain LoRA (x W + alpha/r x A B on whole projections), "
                 "which is all model.lora computes")
  if field("r") != lora.rank:
    raise refuse(config_file, f"r={field('r')!r} but config.model.lora.rank={lora.rank}")
  alpha = field("lora_alpha")
  if not isinstance(alpha, (int, float)) or float(alpha) != float(lora.alpha):
    raise refuse(config_file, f"lora_alpha={alpha!r} but config.model.lora.alpha={lora.alpha}")
  targets = field("target_modules")
  if isinstance(targets, str):  # a regex or a single name in PEFT; only an exact list is compared
    targets = [targets]
  if not isinstance(targets, (list, tuple)) or set(targets) != set(lora.targets):
    raise refuse(config_file, f"target_modules={field('target_modules')!r} but "
                 f"config.model.lora.targets={tuple(lora.targets)!r} (the same set is needed)")

  named = field("base_model_name_or_path")
  if isinstance(named, str) and named:
    if os.path.isfile(os.path.join(named, "config.json")):  # a local base: its architecture is known
      from oapl_jax.models.hf import model_config_from_hf, read_hf_config  # noqa: PLC0415
      try:
        theirs = model_config_from_hf(read_hf_config(named))
      except (OSError, ValueError) as e:
        raise refuse(config_file, f"base_model_name_or_path={named!r}: its config.json is unreadable: "
                     f"{e}".replace("\n", " ")) from None
      diffs = [f"{k} {getattr(theirs, k)!r} (this run's model: {getattr(cfg, k)!r})"
               for k in _ARCH_FIELDS if getattr(theirs, k) != getattr(cfg, k)]
      if diffs:
        raise refuse(config_file, f"trained on another base: base_model_name_or_path={named!r} has "
                     + ", ".join(diffs))
    if check_name and model_path and not _same_base_name(named, model_path):
      raise refuse(config_file, f"trained on another base: base_model_name_or_path={named!r}, this "
                   f"run's config.model.path={model_path!r} (the same base under another name: "
                   "--config.model.lora.init_from_check_name=False)")

  if not os.path.isfile(weights_file):
    other = [n for n in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, n))]
    why = (f"missing ({other[0]} is there: save it with safe_serialization=True)" if other
           else "missing")
    raise refuse(weights_file, why)
  try:
    tensors = load_file(weights_file)
  except Exception as e:  # noqa: BLE001  (safetensors raises its own and OSError kinds)
    raise refuse(weights_file, f"unreadable: {type(e).__name__}: {e}".replace("\n", " ")) from None

  out, left = {}, dict(tensors)
  for layer in range(cfg.num_layers):
    for target in lora.targets:
      n_in, n_out, _, _ = _shape(cfg, target)
      prefix = f"{_PEFT_PREFIX}{layer}.{_HF_MODULE[target]}"
      pair = []
      for kind, want in (("lora_A", (lora.rank, n_in)), ("lora_B", (n_out, lora.rank))):
        name = f"{prefix}.{kind}.weight"
        if name not in left:
          raise refuse(weights_file, f"no tensor {name} (layer {layer} {target}: the base has "
                       f"{cfg.num_layers} layers, targets {tuple(lora.targets)})")
        x = left.pop(name)
        if tuple(x.shape) != want:
          raise refuse(weights_file, f"{name} has shape {tuple(x.shape)}, this base and rank need "
                       f"{want} (another base, or another rank)")
        pair.append(np.asarray(jnp.asarray(x, jnp.float32)).T)
      out[(layer, target)] = (pair[0], pair[1])
  if left:
    name = sorted(left)[0]
    rest = name[len(_PEFT_PREFIX):].split(".") if name.startswith(_PEFT_PREFIX) else []
    if rest and rest[0].isdigit() and int(rest[0]) >= cfg.num_layers:
      why = f"trained on another base: {name} is in layer {rest[0]}, the base has {cfg.num_layers} layers"
    else:
      why = f"{name} (and {len(left) - 1} more) adapt nothing model.lora computes"
    raise refuse(weights_file, why)
  return out


def from_peft(abstract, tensors: dict[tuple, tuple[np.ndarray, np.ndarray]]):
  """An adapters State shaped as `abstract` (`lora_abstract`'s adapters) holding `tensors`
  (`read_peft`), as host arrays in each leaf's dtype."""
  out = []
  for path, var in nnx.to_flat_state(abstract):
    layer, target = path[1], path[-2][:-len(SUFFIX)]
    a, b = tensors[(layer, target)]
    x = a if path[-1] == "lora_a" else b
    out.append((path, var.replace(np.asarray(x, var.get_value().dtype))))
  return nnx.from_flat_state(out)
