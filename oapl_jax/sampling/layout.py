"""The engine's copy of the weights: one copy, in the compute dtype, laid out for decode on a
`tensor` sub-mesh; and the refresh that makes it from the trainer's pi_theta, on device.

Layout (`EngineParams`, T = `sampling.tensor` devices per engine replica):
  decode  {"layers": L x {"qkv": `[E, T, (N + 2K) / T * D]`, "gate_up": `[E, T, 2F / T]`},
           "head": `[E, V]`}: the matrices a decode step multiplies by, fused (one matmul for
           q, k, v; one for gate, up). Slice t of axis 1 holds tensor shard t's query heads, then
           its key heads, then its value heads (`[E, T, 2F / T]`: its gate columns, then its up
           columns), so splitting axis 1 over the "tensor" mesh axis gives each device whole
           heads (Megatron). The decode step (`decode.py`) multiplies by exactly these; with
           T = 1, slice 0 is the plain q | k | v (gate | up) columns side by side.
  params  the model's `nnx.State`, with the weights held in `decode` set to None: q/k/v_proj,
          gate/up_proj and, if tied, the embedding (the head is its transpose). So no weight is
          held twice: about the model's size in compute dtype (`engine_bytes`). Prefill rebuilds
          the plain weights as slices of the fused ones (`plain_params`, transient, inside jit;
          a tied embedding: the head transposed, transient, once per prefill call).
Weights are cast to `model.dtype` (the compute dtype), except the RMSNorm scales (the only 1-D
weights; the model reads them in float32): each weight then holds exactly the values a
`model.dtype` forward pass of pi_theta multiplies by.

Shardings: the config's `sharding.rules` with the "data" and "fsdp" mesh axes dropped
(`engine_rules`: decode weights are not fsdp-sharded; Tunix `get_default_sharding(
is_sampling=True)`, MaxText `inference.yml`), on a mesh `("tensor",)` of one replica's T devices.
The KV cache is split over KV heads only (the "kv_heads" rule; MaxText `cache_heads`).

The refresh (`load_weights`), at each lag refresh, for all replicas at once:
  1. one jitted re-layout on the devices pi_theta lies on (any trainer sharding): cast, fuse,
     and reshard to a staging sharding, a mesh `("replica", "tensor")` over those devices whose
     rows are the replicas' own devices where they are among them: an all-gather over fsdp, on
     device (not `jax.device_put` across layouts, which goes through the host: docs/design.md "The engine on a mesh, and the refresh");
  2. each replica's arrays are assembled from the staging shards with the same index
     (`jax.make_array_from_single_device_arrays`): the replica's own buffers when it lives on
     the trainer's devices (sync mode: no copy at all), else a device-to-device copy of each
     shard (async mode: engines on their own devices).
A LoRA run with model.lora.merge="in_refresh" hands step 1 the frozen base and the adapters
(`MergeOnLoad`): each adapted weight is merged in its layer's turn, so no merged copy of the
base is made (`lora.merge_weight`: the values `lora.merged` gives, bit for bit).
No host transfer: tested under `jax.transfer_guard_host_to_device("disallow_explicit")` and
its device-to-host twin (tests/test_engine_mesh.py, the loop's own refresh included; the plain
`transfer_guard("disallow")` would not refuse a shard routed through numpy).
A weight the engine splits over "tensor" while the trainer splits its embedding dimension goes
through one intermediate sharding in step 1 (`EngineLayout.staging_steps`), so XLA does not
gather it whole onto every device. The version stamp is made on
device too (a constant of a tiny jitted function).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oapl_jax import sharding as sharding_lib
from oapl_jax.errors import ConfigError
from oapl_jax.models import lora as lora_lib
from oapl_jax.models.transformer import ModelConfig

FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # held in `decode`, not `params`
ENGINE_MESH_AXES = ("tensor",)  # an engine replica's mesh; replicas are the data axis


@struct.dataclass
class EngineParams:
  """Weights as an engine holds them (module docstring): `params` (the model's `nnx.State`
  without the fused weights), `version` (int32 `[]`: the policy version stamped on answers; an
  array leaf, so a new snapshot reuses every compiled function) and `decode` (fused matrices).
  """

  params: Any
  version: jax.Array
  decode: Any


@dataclasses.dataclass(frozen=True, eq=False)
class MergeOnLoad:
  """A frozen base and low-rank adapters, given to the refresh in place of merged weights
  (model.lora.merge="in_refresh"): `load_weights` merges each adapted weight inside its
  re-layout, layer by layer in the order the layers are laid out (`EngineLayout.relayout`), so
  no merged copy of the whole base exists on the devices, only one layer's in transit. The
  values are `lora.merged`'s bit for bit (`lora.merge_weight`). base: the base's `nnx.State`
  (model.dtype, the trainer's shardings); adapters: the adapters' State (same mesh); scale:
  alpha / rank. Compared by identity (`Sampler.load` lays out one object once per version)."""

  base: Any
  adapters: Any
  scale: float


def engine_rules(rules) -> dict:
  """`rules` (config.sharding.rules) with the mesh axes other than "tensor" dropped: the
  engine's weights are split over heads / MLP / vocabulary only, and replicated over the rest."""
  out = {}
  for logical, axes in sharding_lib.rules_dict(rules).items():
    kept = tuple(a for a in sharding_lib.spec_names(axes) if a in ENGINE_MESH_AXES)
    out[logical] = kept[0] if len(kept) == 1 else (kept or None)
  return out


def engine_mesh(devices) -> Mesh:
  """One engine replica's mesh: its devices on the "tensor" axis."""
  return Mesh(np.array(list(devices)), ENGINE_MESH_AXES)


def check_tensor(cfg: ModelConfig, tensor: int) -> None:
  """Refuses a tensor count that does not split the heads and the MLP width (each device
  decodes whole KV heads with their query heads, and whole MLP columns), naming
  `sampling.tensor`."""
  for name in ("num_kv_heads", "num_heads", "mlp_dim"):
    if getattr(cfg, name) % tensor:
      raise ConfigError(f"sampling.tensor={tensor}: must divide model.{name}={getattr(cfg, name)} "
                        "(an engine's devices split the attention heads and the MLP)")


def _is_norm(value) -> bool:
  """RMSNorm scales: the model's only 1-D weights, read in float32 (kept in their dtype)."""
  return value.ndim == 1


def _placed(x: jax.Array, *shardings) -> jax.Array:
  """x constrained to each of `shardings` in turn (None: skipped)."""
  for step in shardings:
    if step is not None:
      x = jax.lax.with_sharding_constraint(x, step)
  return x


def _staged(target: NamedSharding, e: int) -> NamedSharding:
  """The step a fused part `[E, T, X]` takes on its way to `target` (E whole): E split over the
  staging mesh's "replica" axis, as `EngineLayout.staging_steps` does for the unfused weights (from
  the trainer's fsdp split of E straight to `target`, XLA:SPMD gathers the part whole)."""
  replicas = dict(zip(target.mesh.axis_names, target.mesh.devices.shape)).get("replica", 1)
  spec = list(target.spec) + [None] * (3 - len(target.spec))
  if replicas == 1 or spec[0] is not None or e % replicas:
    return target
  return NamedSharding(target.mesh, PartitionSpec("replica", *spec[1:]))


class EngineLayout:
  """The engine layout of one model on T = `tensor` devices (module docstring): the re-layout
  from the trainer's `nnx.State` (`relayout`), back to plain weights (`plain_params`), and
  the shardings of both and of the KV cache on a replica's mesh.

  rules: the config's `sharding.rules` (fsdp/data dropped here); None = all replicated.
  """

  def __init__(self, cfg: ModelConfig, tensor: int = 1, rules=None):
    check_tensor(cfg, tensor)
    self.cfg, self.tensor, self.rules = cfg, tensor, engine_rules(rules)
    self._jitted = {}  # staging mesh -> jitted relayout

  def _fused_path(self, path: tuple) -> bool:
    return path[-1] in FUSED or (self.cfg.tie_embeddings and path == ("embed",))

  def _spec(self, *logical) -> PartitionSpec:
    return sharding_lib.logical_to_spec(logical, self.rules)

  # --- the re-layout (traced inside jit) --------------------------------------------------

  def _cast(self, x: jax.Array) -> jax.Array:
    return x if _is_norm(x) else x.astype(self.cfg.dtype)

  def relayout(self, params: nnx.State, via: dict | None = None, out=None,
               merge: tuple | None = None) -> tuple[nnx.State, dict]:
    """pi_theta's `nnx.State` (any dtype) -> (`EngineParams.params`, `EngineParams.decode`).

    via: {path: NamedSharding} a weight passes through on its way to its engine sharding
    (`staging_steps`), or None. out: the result's shardings (the jitted refresh's), or None.
    merge: (adapters State, scale) or None: `params` is a frozen base and each adapted weight
    is merged (`lora.merge_weight`) after its layer's barrier, in the layer's turn (`MergeOnLoad`).

    The layers are laid out in turn (chained by `optimization_barrier`, their results
    constrained to `out`): a layer's weights are gathered once the layer before has its fused
    matrices. Left to itself, XLA:TPU schedules every layer's gathers before the copies into the
    engine's layout, and all layers' gathered weights are alive at once. Only the fused
    matrices are chained: with the unfused weights (o_proj, down_proj) in the chain too, each
    was gathered into a buffer of its own and copied to the result at the end, all layers' at
    once (code.py: 1.68 GiB). Refresh temp per device, compiled for v5p: math.py 1.12 -> 0.22
    GiB, code.py 4.52 -> 0.53 GiB (`plan.refresh_bytes`). The same values bit for bit."""
    cfg, t = self.cfg, self.tensor
    flat = list(nnx.to_flat_state(params))
    value = {tuple(p): self._cast(v.get_value()) for p, v in flat}
    via = via or {}
    for path, step in via.items():  # a layer's weights take their step in their turn (below)
      if path[0] != "layers":
        value[path] = jax.lax.with_sharding_constraint(value[path], step)
    e = cfg.hidden_size
    split = lambda w: w.reshape(e, t, -1)  # [E, ...] -> [E, T, .../T]: tensor shard t's columns  # noqa: E731
    out_rest = ({tuple(p): v.get_value() for p, v in nnx.to_flat_state(out[0])} if out else {})
    pairs = {} if merge is None else lora_lib.targets_of(merge[0])  # {base path: (A, B)}
    layers, done = [], None
    for i in range(cfg.num_layers):
      own = [p for p in value if p[:2] == ("layers", i)]
      adapted = [p for p in own if p in pairs]
      ab = [pairs[p] for p in adapted]
      if done is not None:  # layer i is gathered after layer i-1 is fused: one layer in transit
        done, mine, ab = jax.lax.optimization_barrier((done, [value[p] for p in own], ab))
        value.update(zip(own, mine))
      for p, (a, b) in zip(adapted, ab):  # merged in the layer's turn: one layer's merge alive
        value[p] = lora_lib.merge_weight(value[p], a, b, merge[1])
      for p in own:  # the unfused weights: by way of their staging step to their engine sharding
        value[p] = _placed(value[p], via.get(p), out_rest.get(p))
      attn = [value[("layers", i, "attn", n)] for n in ("q_proj", "k_proj", "v_proj")]
      mlp = [value[("layers", i, "mlp", n)] for n in ("gate_proj", "up_proj")]
      shard = out[1]["layers"][i] if out else {}
      part = lambda w, name: _placed(  # noqa: E731  (each part placed as its fused matrix will be)
          split(w), *((_staged(shard[name], e), shard[name]) if out else ()))
      layer = {"qkv": jnp.concatenate([part(w, "qkv") for w in attn], axis=2),  # [E, T, (N+2K)/T*D]
               "gate_up": jnp.concatenate([part(w, "gate_up") for w in mlp], axis=2)}  # [E, T, 2F/T]
      layers.append(layer)
      done = layer  # the fused matrices only (docstring)
    head = value[("embed",)].T if cfg.tie_embeddings else value[("lm_head",)]  # [E, V]
    rest = nnx.from_flat_state([(p, v.replace(None if self._fused_path(tuple(p)) else value[tuple(p)]))
                                for p, v in flat])
    return rest, {"layers": layers, "head": head}

  def plain_params(self, params: nnx.State, decode: dict, embed: jax.Array | None = None) -> nnx.State:
    """The full `nnx.State` again (inside jit: the fused weights' slices, transient).

    embed: a tied model's embedding `[V, E]`, the head transposed. Made by a jitted function of
    its own and passed in (`Engine.prefill_batch`), it is a row-major array as the trainer's
    embedding is, so prefill's LM head is the same matmul bit for bit (a transpose inside this
    jit lets XLA fold it into the matmul, which changes the summation order: 6e-7 at batch 1).
    """
    cfg, t = self.cfg, self.tensor
    e, n, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    nq, nk = n // t * d, k // t * d
    plain = {}
    for i, layer in enumerate(decode["layers"]):
      qkv, gu = layer["qkv"], layer["gate_up"]  # [E, T, (N+2K)/T*D], [E, T, 2F/T]
      plain[("layers", i, "attn", "q_proj")] = qkv[..., :nq].reshape(e, n, d)
      plain[("layers", i, "attn", "k_proj")] = qkv[..., nq:nq + nk].reshape(e, k, d)
      plain[("layers", i, "attn", "v_proj")] = qkv[..., nq + nk:].reshape(e, k, d)
      plain[("layers", i, "mlp", "gate_proj")] = gu[..., :f // t].reshape(e, f)
      plain[("layers", i, "mlp", "up_proj")] = gu[..., f // t:].reshape(e, f)
    if cfg.tie_embeddings:
      plain[("embed",)] = embed  # [V, E]
    return nnx.from_flat_state([(p, v.replace(plain[tuple(p)]) if tuple(p) in plain else v)
                                for p, v in nnx.to_flat_state(params)])

  # --- shardings ------------------------------------------------------------------------

  def shardings(self, params: nnx.State, mesh: Mesh) -> tuple[nnx.State, dict]:
    """NamedShardings on `mesh` of `relayout(params)`'s two parts (params: pi_theta's State,
    concrete or abstract). A dimension that does not split is a ConfigError naming the weight."""
    def named(name, shape, axes):
      try:
        return sharding_lib.named_sharding(name, shape, axes, mesh, self.rules)
      except ValueError as err:
        raise ConfigError(f"sampling.tensor={self.tensor}: {err}") from None

    rest = []
    for path, var in nnx.to_flat_state(params):
      path = tuple(path)
      s = None if self._fused_path(path) else named(
          "/".join(map(str, path)), tuple(var.get_value().shape), var.get_metadata().get("logical_axes"))
      rest.append((path, var.replace(s)))
    cfg, t = self.cfg, self.tensor
    e, n, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    layers = [{"qkv": named(f"layers/{i}/qkv", (e, t, (n + 2 * k) // t * d), ("embed", "kv_heads", None)),
               "gate_up": named(f"layers/{i}/gate_up", (e, t, 2 * f // t), ("embed", "mlp", None))}
              for i in range(cfg.num_layers)]
    head = named("head", (e, cfg.vocab_size), ("vocab_embed", "vocab"))
    return nnx.from_flat_state(rest), {"layers": layers, "head": head}

  def staging_steps(self, params: nnx.State, stage: Mesh) -> dict:
    """{path: NamedSharding on `stage`}: for each weight the engine keeps unfused and splits
    over "tensor" (o_proj by heads, down_proj by MLP columns) while the trainer splits its
    embedding dimension (fsdp), that dimension split over the "replica" axis on the way.

    Resharded straight from the trainer's split to the engine's (a copy when the dtype does
    not change), XLA:SPMD finds no efficient path and gathers the whole weight onto every
    device ("involuntary full rematerialization", seen with fsdp 8 x tensor-2 engines); through
    this step it is an all-to-all then an all-gather over the replicas, and the temp memory
    is the weight's engine shard, not the whole weight."""
    replicas = dict(zip(stage.axis_names, stage.devices.shape)).get("replica", 1)
    rest, _ = self.shardings(params, stage)
    steps = {}
    for (path, var), (_, target) in zip(nnx.to_flat_state(params), nnx.to_flat_state(rest)):
      target, axes = target.get_value(), var.get_metadata().get("logical_axes") or ()
      if target is None or replicas == 1 or "embed" not in axes:
        continue
      spec = list(target.spec) + [None] * (len(axes) - len(target.spec))
      dim = axes.index("embed")
      if (spec[dim] is None and any(a is not None for a in spec)
          and var.get_value().shape[dim] % replicas == 0):
        spec[dim] = "replica"
        steps[tuple(path)] = NamedSharding(stage, PartitionSpec(*spec))
    return steps

  def jitted_relayout(self, stage: Mesh, out_shardings, params: nnx.State, scale: float | None = None):
    """`relayout` jitted onto the staging mesh `stage` (one compile per trainer sharding),
    through the `staging_steps` of `params` (worked out once, with the compile). scale: not
    None: the function takes (base, adapters) and merges them (`MergeOnLoad`)."""
    key = stage if scale is None else (stage, scale)
    if key not in self._jitted:
      via = self.staging_steps(params, stage)
      if scale is None:
        fn = functools.partial(self.relayout, via=via, out=out_shardings)
      else:
        fn = lambda base, adapters: self.relayout(base, via=via, out=out_shardings,  # noqa: E731
                                                  merge=(adapters, scale))
      self._jitted[key] = jax.jit(fn, out_shardings=out_shardings)
    return self._jitted[key]

  def cache_specs(self) -> tuple[PartitionSpec, PartitionSpec]:
    """PartitionSpecs of one layer's keys `[S, K, D, M]` and values `[S, K, M, D]`: K only."""
    kv = self._spec("kv_heads")[0]
    return PartitionSpec(None, kv, None, None), PartitionSpec(None, kv, None, None)


def engine_bytes(weights: EngineParams) -> int:
  """Bytes of an `EngineParams`' arrays (all shards: the global arrays' sizes)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))


# --- the refresh ----------------------------------------------------------------------------


def _source_devices(params) -> list:
  """The devices pi_theta's arrays lie on: in its mesh's order where it has one (the trainer's
  mesh; on a TPU slice that is the torus' order, not the ids'), else sorted by id."""
  devices = set()
  for x in jax.tree.leaves(params):
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
      return list(x.sharding.mesh.devices.flat)
    devices |= set(x.sharding.device_set) if isinstance(x, jax.Array) else set()
  return sorted(devices or {jax.devices()[0]}, key=lambda d: d.id)


def in_device_order(shardings, order: list):
  """The same PartitionSpecs on meshes of the same shapes and axes whose devices are listed in
  `order` (the same devices): a jitted program's arguments and results must list their
  devices in one order, and the staging mesh's differs from the trainer mesh's when the
  replicas' device groups are not runs of the trainer mesh's order (a TPU slice's torus order
  is not the ids' order). `jax.device_put` to these moves each block on device (a jitted
  permutation of the shards; JAX's reshard for a new device order), not through the host."""
  def move(s):
    mesh = Mesh(np.array(order).reshape(s.mesh.devices.shape), s.mesh.axis_names,
                axis_types=s.mesh.axis_types)
    return NamedSharding(mesh, s.spec)

  return jax.tree.map(move, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def staging_mesh(source: list, meshes: list[Mesh], tensor: int, *,
                 in_source_order: bool = False) -> Mesh:
  """A mesh `("replica", "tensor")` over the `source` devices (where pi_theta lies) whose first
  rows are the replicas' own device groups that lie among them, so those replicas' shards are
  made in place. Source devices that do not split into groups of `tensor` give a staging mesh
  of whole copies (tensor axis of size 1; each replica's shards are then cut from them)."""
  if len(source) % tensor:
    return Mesh(np.array(source).reshape(-1, 1), ("replica", "tensor"))
  rows, used = [], set()
  for mesh in meshes:
    group = list(mesh.devices.flat)
    if set(group) <= set(source) - used:
      rows.append(group)
      used |= set(group)
  rest = [d for d in source if d not in used]
  rows += [rest[i:i + tensor] for i in range(0, len(rest), tensor)]
  if in_source_order:  # multi-host: the devices in pi_theta's order, as jit wants them there
    rows.sort(key=lambda row: source.index(row[0]))
  return Mesh(np.array(rows), ("replica", "tensor"))


def _on_mesh(shardings, mesh: Mesh):
  """The same PartitionSpecs on another mesh (whose axes include their names)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def _index_key(index: tuple, shape: tuple) -> tuple:
  return tuple(s.indices(n) for s, n in zip(index, shape))


def _assemble(staged: jax.Array, dst: NamedSharding) -> jax.Array:
  """`staged` as an array with sharding `dst`, built from its shards with no host transfer:
  a device's own shard when it holds the right one, else a device-to-device copy of (a cut of)
  a shard holding that index."""
  shape = staged.shape
  shards = staged.addressable_shards
  buffers = []
  for device, index in dst.addressable_devices_indices_map(shape).items():
    want = _index_key(index, shape)
    exact = [s for s in shards if _index_key(s.index, shape) == want]
    mine = [s for s in exact if s.device == device]
    if mine:
      buffers.append(mine[0].data)
    elif exact:
      buffers.append(jax.device_put(exact[0].data, device))
    else:  # a whole copy (staging tensor axis of size 1): cut this device's block on its device
      whole = next(s for s in shards if all(a == (0, n, 1) for a, n in zip(_index_key(s.index, shape), shape)))
      buffers.append(jax.device_put(_block(whole.data, want), device))
  return jax.make_array_from_single_device_arrays(shape, dst, buffers)


@functools.partial(jax.jit, static_argnums=1)
def _block(x: jax.Array, bounds: tuple) -> jax.Array:
  """x's block `bounds` ((start, stop, step) per dimension), cut on x's device (static bounds:
  no index leaves the host)."""
  return jax.lax.slice(x, [b[0] for b in bounds], [b[1] for b in bounds], [b[2] for b in bounds])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stamp(version: int, sharding: NamedSharding) -> jax.Array:
  """int32 `[]` array `version` made on device: a constant of the compiled function, so no
  host-to-device transfer (one small compile per new version, i.e. per refresh)."""
  return jax.lax.with_sharding_constraint(jnp.full((), version, jnp.int32), sharding)


def load_weights(params: nnx.State, version: int, layout: EngineLayout,
                 meshes: list[Mesh], groups: list[list] | None = None) -> list[EngineParams]:
  """pi_theta (`params`, an `nnx.State` in any dtype and trainer sharding) as `EngineParams`
  on each replica mesh in `meshes`, stamped `version`: the refresh (module docstring).

  groups: multi-host, every process's replica device groups (`Replicas.global_groups`), so
  every process builds the same staging mesh and runs the same re-layout program; each then
  assembles its own replicas (`meshes`) from its own shards.

  params may be a `MergeOnLoad` (a base and adapters): merged inside the re-layout."""
  merge = params if isinstance(params, MergeOnLoad) else None
  adapters = None
  if merge is not None:
    params, adapters = merge.base, merge.adapters
  source = _source_devices(params)
  stage = staging_mesh(source, meshes if groups is None else [engine_mesh(g) for g in groups],
                       layout.tensor, in_source_order=groups is not None)
  order = list(stage.devices.flat)
  if order != source:  # the re-layout's argument must list its devices as its result does
    params = jax.device_put(params, in_device_order(
        jax.tree.map(lambda x: x.sharding, params), order))
    if adapters is not None:
      adapters = jax.device_put(adapters, in_device_order(
          jax.tree.map(lambda x: x.sharding, adapters), order))
  rest_s, decode_s = layout.shardings(params, stage)
  replicated = NamedSharding(stage, PartitionSpec())
  if merge is None:
    staged_rest, staged_decode = layout.jitted_relayout(stage, (rest_s, decode_s), params)(params)
  else:
    staged_rest, staged_decode = layout.jitted_relayout(
        stage, (rest_s, decode_s), params, merge.scale)(params, adapters)
  staged = EngineParams(staged_rest, _stamp(int(version), replicated), staged_decode)
  out = []
  for mesh in meshes:
    dst = EngineParams(_on_mesh(rest_s, mesh), NamedSharding(mesh, PartitionSpec()),
                       _on_mesh(decode_s, mesh))
    out.append(jax.tree.map(_assemble, staged, dst))
  return out

