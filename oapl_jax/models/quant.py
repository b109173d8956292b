"""A quantised frozen base for low-rank adapter runs (`model.base_quant`, QLoRA-style).

    base = quantize_base(base, "int8")     # the block projections as `QArray`s, the rest as is
    w = base["layers"][0]["attn"]["q_proj"][...]   # dequantised on use: int8 * scale

Under `model.lora` the base is frozen, so its block projections (q/k/v/o, gate/up/down: nearly
all of a model's bytes besides the embedding) can be held as int8 with one float32 scale per
output channel: a `QArray`, a pytree of (`values` int8, `scale` float32) that reads as the
dequantised weight rounded to the base's dtype. The model's code is unchanged: a projection is
read as `self.q_proj[...]`, which on a `QArray` dequantises. The embedding, the head and the
norms stay in `model.dtype`.

Symmetric per-output-channel int8: scale = max |w| over the input axes / 127, values =
round(w / scale), clipped to [-127, 127]. The contraction axes of each projection are its
leading ones (`IN_AXES`): `[E, N, D]` q_proj reduces E, `[N, D, E]` o_proj reduces N and D.

Both sides of OAPL's log-prob contract see the same quantised base: the trainer computes
`x deq(Wq) + scale x A B`; the engines sample from `merged`, deq(Wq) + scale A B in float32,
rounded once to `model.dtype`, where deq(Wq) is the `model.dtype` array the QArray reads as: the
contract is the bf16-base run's, with the dequantised base as the base. The engines' weights
are therefore `model.dtype` as in a bf16-base run: what the quantised base saves is the trainer's
copy of the base (with `model.lora.merge="in_refresh"` and `sampling.release_weights`, the only
base copy on a shared device while the trainer steps); sampling from int8 weights is not done.

Why not qwix: it quantises by intercepting the einsum calls of modules it is given, where the
frozen base here must also pass through the engine's re-layout, the remat scans' stacking and
the LoRA merge, each of which reads weights as arrays; a pytree that reads as its dequantised
array goes through all of them with a handful of lines, and its bytes are what the planner
counts from the abstract state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from oapl_jax.models.names import BASE_QUANTS

IN_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1,
           "down_proj": 1}  # how many leading axes each projection contracts (reduced per scale)
_LIMIT = {"int8": 127}


@struct.dataclass
class QArray:
  """A weight held as int8 `values` (the weight's shape) and float32 `scale` (the weight's
  shape with its input axes 1). It reads as the array round(values * scale) in `dtype` (the
  base's dtype, `model.dtype`): indexing (`w[...]`) gives that array, `astype` casts it, and
  `shape`, `ndim` and `dtype` are its. So a quantised base is, to every reader, a `model.dtype`
  base whose values are the dequantised ones."""

  values: jax.Array
  scale: jax.Array
  dtype_name: str = struct.field(pytree_node=False)  # the base's dtype, what it reads as

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self):
    return jnp.dtype(self.dtype_name)

  def dequantize(self) -> jax.Array:
    return (self.values.astype(jnp.float32) * self.scale.astype(jnp.float32)).astype(self.dtype)

  def __getitem__(self, index) -> jax.Array:
    return self.dequantize()[index]

  def astype(self, dtype) -> jax.Array:
    return self.dequantize().astype(dtype)


def is_qarray(x) -> bool:
  return isinstance(x, QArray)


def quantize(w: jax.Array, in_axes: int, mode: str = "int8") -> QArray:
  """`w` as a QArray: one scale per output channel over its first `in_axes` axes."""
  limit = _LIMIT[mode]
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=tuple(range(in_axes)), keepdims=True)
  scale = jnp.where(amax > 0, amax / limit, 1.0)
  values = jnp.clip(jnp.round(w32 / scale), -limit, limit).astype(jnp.int8)
  return QArray(values, scale, jnp.dtype(w.dtype).name)


def _target(path) -> str | None:
  """The projection a base path holds (`layers/3/attn/q_proj`), or None."""
  name = str(path[-1])
  return name if path and path[0] == "layers" and name in IN_AXES else None


def quantize_base(base: nnx.State, mode: str) -> nnx.State:
  """`base` (a model's `nnx.Param` State) with each block projection a QArray (mode "int8"),
  the rest as it is; mode "none": `base` itself. Jit it to quantise on the devices."""
  if mode == "none":
    return base
  if mode not in _LIMIT:
    raise ValueError(f"model.base_quant={mode!r} is not one of {BASE_QUANTS}")
  out = []
  for path, var in nnx.to_flat_state(base):
    target = _target(path)
    w = var.get_value()
    out.append((path, var.replace(quantize(w, IN_AXES[target], mode)) if target and not is_qarray(w) else var))
  return nnx.from_flat_state(out)


def as_frozen_base(weights: nnx.State, mode: str, dtype) -> nnx.State:
  """A model's weights as a LoRA run's frozen base: cast to `dtype` (model.dtype), then
  quantised as `mode` says. The one recipe the trainer and every command use, so their bases
  (and sha256s) are equal bit for bit."""
  return quantize_base(jax.tree.map(lambda x: x.astype(dtype), weights), mode)


def dequantized(base: nnx.State, dtype) -> nnx.State:
  """`base` with each QArray read back as an array of `dtype` (what the engines load)."""
  return nnx.from_flat_state([(p, v.replace(v.get_value().astype(dtype)) if is_qarray(v.get_value()) else v)
                              for p, v in nnx.to_flat_state(base)])


def shardings(plain: nnx.State, mode: str, dtype) -> nnx.State:
  """The NamedShardings of a base quantised from `dtype` weights, from the plain base's
  (`plain`, a State of NamedSharding): a QArray's values as the weight, its scale the same with
  the input axes unsplit (they are 1 long)."""
  if mode == "none":
    return plain
  out = []
  for path, var in nnx.to_flat_state(plain):
    s = var.get_value()
    target = _target(path)
    if target and isinstance(s, NamedSharding):
      spec = tuple(s.spec)
      n = IN_AXES[target]
      scale_spec = PartitionSpec(*([None] * n), *spec[n:])
      s = QArray(s, NamedSharding(s.mesh, scale_spec), jnp.dtype(dtype).name)
    out.append((path, var.replace(s)))
  return nnx.from_flat_state(out)


def abstract(plain: nnx.State, mode: str) -> nnx.State:
  """The quantised base's `jax.ShapeDtypeStruct`s from the plain base's (no sharding)."""
  return jax.eval_shape(lambda b: quantize_base(b, mode), plain)


def nbytes(base: nnx.State) -> int:
  """Bytes of a (quantised or not) base's arrays, concrete or abstract."""
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(base)))
