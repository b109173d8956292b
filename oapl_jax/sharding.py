"""Logical axes -> mesh axes -> `NamedSharding`s: the functions of the one sharding table.

Every weight of the transformer carries `logical_axes` metadata, one name per dimension
(`("embed", "mlp")`; the names: `models.names.LOGICAL_AXES`). One table, the config's
`sharding.rules`, maps each logical axis to mesh axes, as MaxText's `logical_axis_rules` do:

    (("embed", "fsdp"), ("vocab", "tensor"), ("head_dim", None), ...)

A rule's mesh axes are a mesh axis name, a tuple of names (the dimension is split over their
product) or None (replicated); a logical axis without a rule is replicated too. The functions
here accept the rules as those pairs or as a mapping `{logical axis: mesh axes}`.

    spec = logical_to_spec(("embed", "mlp"), rules)       # PartitionSpec("fsdp", "tensor")
    shardings = param_shardings(abstract_model, mesh, rules)  # for jax.jit(out_shardings=...)
    array = place(host_array, axes, mesh, rules, name)    # one host array onto the mesh

A weight dimension that does not divide over its mesh axes is refused, naming the weight.

The trainer's mesh (`make_mesh`) has the axes `MESH_AXES` = ("data", "fsdp", "tensor") with
the sizes of `config.mesh` (-1 = all remaining devices); batch rows of a train step are split
over the mesh axes of the "batch" rule (`batch_axes`: ("data", "fsdp") by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from oapl_jax.errors import ConfigError
from oapl_jax.topology import MESH_AXES  # The mesh axes a rule may name (config.sharding.rules).

MeshAxes = Union[str, tuple[str, ...], None]  # One rule's value.
Rules = Union[Mapping[str, MeshAxes], Iterable[tuple[str, MeshAxes]]]


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor) sizes of `mesh_cfg` (config.mesh) over `num_devices` devices: the
  one axis set to -1 takes all remaining devices. A product other than `num_devices` is a
  ConfigError naming the mesh settings and the device count."""
  sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
  settings = ", ".join(f"mesh.{a}={v}" for a, v in zip(MESH_AXES, sizes))
  fixed = int(np.prod([v for v in sizes if v != -1]))
  if -1 in sizes and fixed > 0 and num_devices % fixed == 0:
    sizes[sizes.index(-1)] = num_devices // fixed
  if -1 in sizes or int(np.prod(sizes)) != num_devices:
    raise ConfigError(f"config.mesh ({settings}): the product of the mesh axes must equal the "
                      f"trainer's {num_devices} devices")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices) -> Mesh:
  """The trainer's mesh over `devices` (a list of jax devices), axes `MESH_AXES` with the
  sizes of `mesh_cfg` (config.mesh; see `mesh_shape`). Axis types Auto: GSPMD places the
  activations (Explicit axes refuse einsums with a sharded contraction)."""
  devices = list(devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=(AxisType.Auto,) * len(shape))


def process_rows(rows_sharding, rows: int) -> np.ndarray:
  """Where each process's rows land in a global `[rows, ...]` array that
  `jax.make_array_from_process_local_data(rows_sharding, local_rows)` assembles: entry
  `p * n + j` (n = rows / processes) is the global row of process p's j-th local row, which
  fills its devices' row blocks in increasing order. On a TPU slice a process's devices need
  not be contiguous on the mesh's batch axes (v5p-64's fsdp axis runs over processes
  0, 2, 4, 6, 0, ...), so this is not `arange(rows)`. A ValueError if the processes do not hold
  equal, disjoint shares (a batch axis that replicates across processes)."""
  owned: dict[int, set[int]] = {}
  for device, index in rows_sharding.devices_indices_map((rows,)).items():
    owned.setdefault(device.process_index, set()).update(range(*index[0].indices(rows)))
  shares = [sorted(owned[p]) for p in sorted(owned)]
  flat = np.concatenate(shares)
  if len(flat) != rows or len(set(flat.tolist())) != rows:
    raise ValueError(f"the batch sharding {rows_sharding.spec} does not give each of the "
                     f"{len(shares)} processes its own rows of {rows}")
  return flat


def batch_axes(rules: Rules | None) -> MeshAxes:
  """The mesh axes batch rows are split over: the "batch" rule's (None = replicated)."""
  return rules_dict(rules).get("batch")


def batch_shards(mesh: Mesh | Mapping[str, int], rules: Rules | None) -> int:
  """How many shards the rows of a batch are split into on `mesh` (a Mesh, or its axis sizes
  `{"data": 2, ...}`): the product of `batch_axes`."""
  return axis_shards(mesh, rules, "batch")


def axis_shards(mesh: Mesh | Mapping[str, int], rules: Rules | None, logical: str) -> int:
  """How many shards a dimension with logical axis `logical` is split into on `mesh` (a Mesh,
  or its axis sizes): the product of the sizes of its rule's mesh axes (1: replicated)."""
  sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
  return int(np.prod([sizes.get(n, 1) for n in spec_names(rules_dict(rules).get(logical))]))


def _mesh_axes(value: Any) -> MeshAxes:
  """A rule's value normalised: a name, a tuple of two or more names, or None."""
  if value is None or isinstance(value, str):
    return value
  names = tuple(value)
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def rules_dict(rules: Rules | None) -> dict[str, MeshAxes]:
  """`rules` as `{logical axis: mesh axes}`: from a mapping, or from `(logical, mesh axes)`
  pairs (a logical axis named twice is a ValueError). None = no rules (all replicated)."""
  pairs = (rules or {}).items() if isinstance(rules, Mapping) or rules is None else rules
  table = {}
  for logical, value in pairs:
    if logical in table:
      raise ValueError(f"sharding rules: logical axis {logical!r} has two rules")
    table[logical] = _mesh_axes(value)
  return table


def logical_to_spec(axes: Iterable[str | None], rules: Rules | None) -> PartitionSpec:
  """PartitionSpec of a weight with logical `axes`: each axis mapped through `rules`
  (an axis with no rule, or None, is replicated)."""
  table = rules_dict(rules)
  return PartitionSpec(*(table.get(a) for a in axes))


def spec_names(entry: MeshAxes) -> tuple[str, ...]:
  """The mesh axis names of one PartitionSpec entry."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def check_fits(name: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
  """Refuses, naming weight `name`, a spec whose mesh axes the mesh lacks, that uses one mesh
  axis for two dimensions, or that splits a dimension into a number of shards not dividing it."""
  used = []
  for dim, entry in zip(shape, spec):
    names = spec_names(entry)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
      raise ValueError(f"{name}: sharding rules name mesh axes {missing} that the mesh "
                       f"{dict(mesh.shape)} does not have")
    twice = [n for n in names if n in used]
    if twice:
      raise ValueError(f"{name}: mesh axes {twice} would shard two dimensions of shape "
                       f"{tuple(shape)} (spec {spec}); change the sharding rules")
    used += names
    shards = int(np.prod([mesh.shape[n] for n in names]))
    if dim % shards:
      raise ValueError(f"{name}: dimension {dim} of shape {tuple(shape)} does not divide over "
                       f"mesh axes {names} ({shards} shards); change the sharding rules")


def named_sharding(name: str, shape: tuple[int, ...], axes: Iterable[str | None] | None,
                   mesh: Mesh, rules: Rules | None) -> NamedSharding:
  """NamedSharding of weight `name` (shape `shape`, logical `axes`; None = replicated) over
  `mesh`, after `check_fits`."""
  spec = logical_to_spec(axes or (), rules)
  check_fits(name, shape, spec, mesh)
  return NamedSharding(mesh, spec)


def _flat_params(tree: nnx.Module | nnx.State) -> list[tuple[tuple, nnx.Variable]]:
  """(path, Param) of every weight of a module (abstract or not) or of a State of Params."""
  state = tree if isinstance(tree, nnx.State) else nnx.state(tree, nnx.Param)
  return [(tuple(p), v) for p, v in nnx.to_flat_state(state)]


def param_shardings(tree: nnx.Module | nnx.State, mesh: Mesh, rules: Rules | None) -> nnx.State:
  """A NamedSharding for every `nnx.Param` of `tree` (a module, e.g. from `nnx.eval_shape`,
  or a State of its Params), from each Param's `logical_axes` through `rules`.

  Returns a State with the structure of `nnx.state(module, nnx.Param)` whose Variables hold
  NamedShardings, so it can be the in/out_shardings of a jitted function of that State.
  A dimension that does not divide over its mesh axes is a ValueError naming the weight
  (path "layers/0/attn/k_proj").
  """
  out = []
  for path, var in _flat_params(tree):
    name = "/".join(map(str, path))
    shape = tuple(var.get_value().shape)
    sharding = named_sharding(name, shape, var.get_metadata().get("logical_axes"), mesh, rules)
    out.append((path, var.replace(sharding)))
  return nnx.from_flat_state(out)


def place(host: np.ndarray, axes: Iterable[str | None] | None, mesh: Mesh | None,
          rules: Rules | None, name: str) -> jax.Array:
  """Device array of host array `host`: on the default device without a mesh, else a global
  array sharded over `mesh` by its logical `axes` (each device reads only its own block)."""
  if mesh is None:
    return jax.numpy.asarray(host)
  sharding = named_sharding(name, host.shape, axes, mesh, rules)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
