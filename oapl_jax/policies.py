"""The policies a run's checkpoints hold, as its engines sample them (the evaluate, generate
and export commands read them; nothing else of the run is loaded).

    step, weights, meta, model_cfg, graphdef = restore_policy(config, workdir, "theta")

"theta" is pi_theta (saved in model.param_dtype: the master weights), "snapshot" pi_old (saved
in model.dtype). Under model.lora a checkpoint holds adapters: `restore_adapters` rebuilds the
frozen base as the run made it (`frozen_base`), refuses a checkpoint trained on another base (its
sha256 differs), and `restore_policy` returns the base merged with the adapters.
"""

from __future__ import annotations

import jax

from oapl_jax import checkpoint
from oapl_jax.models import build, quant
from oapl_jax.models.lora import merged

POLICIES = {"theta": "params", "snapshot": "snapshot"}  # a policy's name -> its checkpoint item


def restore_policy(config, workdir: str, policy: str):
  """(step, weights, meta, model_cfg, graphdef) of the newest good checkpoint's `policy`; a
  UserError if there is no checkpoint. Under model.lora the weights are the frozen base merged
  with the policy's adapters, in model.dtype, as the run's engines sampled them."""
  lora = build.lora_of(config)
  if lora is not None:
    step, adapters, base, meta, model_cfg, graphdef = restore_adapters(config, workdir, policy)
    return step, merged(base, adapters, lora.scale), meta, model_cfg, graphdef
  model_cfg, graphdef, abstract = build.abstract_model(
      config, dtype=config.model.dtype if policy == "snapshot" else None)
  step, weights, meta = checkpoint.restore_tree(config, workdir, POLICIES[policy], abstract,
                                                model_cfg.architecture())
  return step, weights, meta, model_cfg, graphdef


def restore_adapters(config, workdir: str, policy: str):
  """model.lora: (step, adapters, base, meta, model_cfg, base graphdef) of the newest good
  checkpoint's `policy` (adapters as saved: "theta" in model.param_dtype, "snapshot" in
  model.dtype)."""
  checkpoint.checkpoints_of(config, workdir)  # before the base is rebuilt (a warm-up may take minutes)
  model_cfg, _, _ = build.abstract_model(config)
  graphdef, base = frozen_base(config)
  lora = build.lora_of(config)
  abstract = build.lora_abstract(config)[1]  # model.param_dtype
  if policy == "snapshot":
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, config.model.dtype), abstract)
  model_meta = {**model_cfg.architecture(), "lora": lora.record(),
                "base": checkpoint.base_record(config, base)}
  step, adapters, meta = checkpoint.restore_tree(config, workdir, POLICIES[policy], abstract, model_meta)
  return step, adapters, base, meta, model_cfg, graphdef


def frozen_base(config):
  """model.lora: (graphdef, base) of the frozen base a run trains its adapters on, made as
  `loop.Run` makes it: config.model's weights in model.dtype (model.path, or the seed's init),
  warmed up when `warmup.steps` (read from the cache when it is there), then quantised as
  model.base_quant says (`quant.quantize_base`: what the run's checkpoints record the sha256 of)."""
  from oapl_jax import warmup  # noqa: PLC0415
  from oapl_jax.placement import seq_len  # noqa: PLC0415
  from oapl_jax.tasks import make_task  # noqa: PLC0415
  _, graphdef, base = build.init_model(config, param_dtype=config.model.dtype)
  if config.warmup.steps:
    task, tokenizer = make_task(config)
    base, _ = warmup.base_model(config, graphdef, base, task, tokenizer, seq_len=seq_len(config))
  mode = config.model.get("base_quant", "none")
  if mode != "none":
    base = jax.jit(lambda b: quant.as_frozen_base(b, mode, config.model.dtype))(base)  # as the trainer's
  return graphdef, base
