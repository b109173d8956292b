"""The model a run trains, built from its config: random init or a Hugging Face checkpoint.

    model_cfg, graphdef, params = init_model(config)              # one device, as always
    model_cfg, graphdef, params = init_model(config, mesh=mesh)   # created sharded

With a mesh, every weight is created straight into its sharding (config.sharding.rules
through `oapl_jax.sharding`): random weights under one `jax.jit(..., out_shardings=...)`
from the abstract model, checkpoint weights by `from_hf(..., mesh=, rules=)`, one block per
device. The values equal the unsharded ones bit for bit.

    model_config("qwen3_4b"), param_count("qwen3_4b")   # a preset's ModelConfig and size

(`model_config` and `param_count` of a preset live here, not in `presets.py`, which imports no
JAX or Flax.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from oapl_jax import sharding
from oapl_jax.errors import ConfigError
from oapl_jax.models import lora as lora_lib
from oapl_jax.models.hf import from_hf
from oapl_jax.models.lora import LoraConfig
from oapl_jax.models.presets import PRESETS
from oapl_jax.models.transformer import ModelConfig, Transformer


def init_model(config, *, mesh: Mesh | None = None, rules: sharding.Rules | None = None,
               param_dtype: str | None = None) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """(model_cfg, graphdef, params) of `config.model`: loaded from `model.path` (weights in
  `model.param_dtype`; its architecture must match config.model's fields), else initialised
  from `config.seed`.

  mesh: None = arrays on the default device (eager init); else each weight is created sharded
  over `mesh` by `rules` (default: config.sharding.rules). A weight dimension that does not
  divide over its mesh axes is a ValueError naming the weight.
  model_cfg is config.model's ModelConfig; params is the `nnx.Param` State, in
  `model.param_dtype` (master weights; `param_dtype` overrides it: a frozen LoRA base is
  held in `model.dtype`), and the graphdef computes in `model.dtype`, for a checkpoint as for
  a random init (a checkpoint's own dtype is not used).
  """
  model_cfg = ModelConfig.from_config(config.model)
  if mesh is not None and rules is None:
    rules = config.sharding.rules
  param_dtype = param_dtype or config.model.param_dtype
  if config.model.path is None:
    graphdef, params = init_params(dataclasses.replace(model_cfg, param_dtype=param_dtype),
                                   config.seed, mesh=mesh, rules=rules)
  else:
    model = from_hf(config.model.path, dtype=config.model.dtype,
                    param_dtype=param_dtype, mesh=mesh, rules=rules)
    check_same_architecture(model_cfg, model.cfg, config.model.path)
    params = nnx.state(model, nnx.Param)
    # the graphdef of config.model's ModelConfig: its attention_kernel, not the checkpoint's default
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=0))), nnx.Param)[0]
  return model_cfg, graphdef, params


def init_params(model_cfg: ModelConfig, seed: int, *, mesh: Mesh | None = None,
                rules: sharding.Rules | None = None) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params) of a `Transformer` initialised from `nnx.Rngs(params=seed)`.

  Without a mesh the model is built eagerly on the default device. With one, the abstract
  model (`nnx.eval_shape`, nothing allocated) gives each weight's NamedSharding and the init
  runs under `jax.jit(out_shardings=...)`, so each device creates only its own block.
  """
  def make() -> Transformer:
    return Transformer(model_cfg, rngs=nnx.Rngs(params=seed))

  if mesh is None:
    return nnx.split(make(), nnx.Param)
  graphdef, abstract = nnx.split(nnx.eval_shape(make), nnx.Param)
  shardings = sharding.param_shardings(abstract, mesh, rules)
  with jax.set_mesh(mesh):
    params = jax.jit(lambda: nnx.state(make(), nnx.Param), out_shardings=shardings)()
  return graphdef, params


def check_same_architecture(expected: ModelConfig, loaded: ModelConfig, path: str) -> None:
  """Refuses (ConfigError) a checkpoint whose architecture differs from config.model's fields."""
  skip = {"param_dtype", "dtype", "max_position_embeddings", "attention_kernel"}
  diffs = [f"config.model.{f.name}={getattr(expected, f.name)!r} but {path} has "
           f"{getattr(loaded, f.name)!r}" for f in dataclasses.fields(ModelConfig)
           if f.name not in skip and getattr(expected, f.name) != getattr(loaded, f.name)]
  if diffs:
    raise ConfigError("checkpoint of another model:\n  " + "\n  ".join(diffs))


def abstract_model(config, dtype=None) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """(model_cfg, graphdef, params as `jax.ShapeDtypeStruct`s on the default device) of
  `config.model`: the structure a checkpoint's weights are read into, nothing allocated.
  dtype: the leaves' dtype; None = `model.param_dtype` (pi_theta; the engines' snapshot
  pi_old is saved in `model.dtype`)."""
  model_cfg = ModelConfig.from_config(config.model)
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=config.seed))), nnx.Param)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return model_cfg, graphdef, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=device), abstract)


def param_shardings(config, mesh: Mesh, rules: sharding.Rules | None = None) -> nnx.State:
  """A NamedSharding for every weight of `config.model` over `mesh` (rules: default
  config.sharding.rules), as a State shaped like the params; nothing allocated."""
  model_cfg = ModelConfig.from_config(config.model)
  abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=0)))
  return sharding.param_shardings(abstract, mesh, config.sharding.rules if rules is None else rules)


def lora_of(config) -> LoraConfig | None:
  """The run's low-rank adapters (`config.model.lora`), None for full fine-tuning."""
  return LoraConfig.from_config(config.model)


def _lora_model(config) -> Transformer:
  """config.model's Transformer, its base abstract (`nnx.eval_shape`: in `model.dtype`, frozen)
  and the adapters attached (`lora.attach`, from config.seed): real under `jax.jit`, abstract
  under `nnx.eval_shape`."""
  model_cfg = ModelConfig.from_config(config.model)
  base = nnx.eval_shape(lambda: Transformer(dataclasses.replace(model_cfg, param_dtype=model_cfg.dtype),
                                            rngs=nnx.Rngs(params=config.seed)))
  return lora_lib.attach(base, lora_of(config), config.seed)


def lora_abstract(config) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, adapters, base) of the adapted model, abstract (nothing allocated): the
  trainer merges `nnx.merge(graphdef, adapters, base)`."""
  return nnx.split(nnx.eval_shape(lambda: _lora_model(config)), nnx.LoRAParam, nnx.Param)


def init_adapters(config, *, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, adapters) of `config.model.lora`: the adapters (A random, B zero, from
  config.seed) created straight into their shardings over `mesh`, the base not built; with
  `model.lora.init_from`, the PEFT adapter in that folder instead (`lora.read_peft`: checked
  against the rank, alpha, targets and base, a ConfigError otherwise), placed the same way."""
  graphdef, abstract, _ = lora_abstract(config)
  shardings = sharding.param_shardings(abstract, mesh, config.sharding.rules)
  init_from = config.model.lora.get("init_from")
  if init_from:
    tensors = lora_lib.read_peft(init_from, lora_of(config), ModelConfig.from_config(config.model),
                                 model_path=config.model.path,
                                 check_name=config.model.lora.get("init_from_check_name", True))
    host = lora_lib.from_peft(abstract, tensors)  # each process read the same file: its own blocks of it
    return graphdef, jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), host, shardings)

  def make():
    return nnx.state(_lora_model(config), nnx.LoRAParam)

  with jax.set_mesh(mesh):
    return graphdef, jax.jit(make, out_shardings=shardings)()


def model_config(preset: str | Mapping[str, Any] | ModelConfig) -> ModelConfig:
  """ModelConfig of a preset name (`presets.PRESETS`), a kwargs dict, or a ModelConfig
  (returned as is)."""
  if isinstance(preset, ModelConfig):
    return preset
  if isinstance(preset, str):
    if preset not in PRESETS:
      raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[preset]
  return ModelConfig(**preset)


def param_count(preset: str | Mapping[str, Any] | ModelConfig) -> int:
  """Number of weights of the model, from abstract shapes only (nothing is allocated)."""
  cfg = model_config(preset)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  shapes = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  return int(sum(np.prod(s.shape, dtype=np.int64) for s in shapes))
