"""Memory planner: bytes per device of a run's state and activations, against a topology.

    plan = make_plan(config)   # from abstract shapes only: nothing read, nothing allocated
    print(plan.format())       # item, bytes per device, where / phase, note; total, headroom
    check(config)              # PlanError (one line naming the setting) if it does not fit

`python -m oapl_jax.main --config=... --dry_run` prints the plan and exits; `train.run`
calls `check` before it allocates anything. docs/memory.md states the model and its
calibration.

Where the numbers come from:
* weights: `nnx.eval_shape` of the Transformer gives every weight's shape and logical axes;
  `config.sharding.rules` (through `oapl_jax.sharding.logical_to_spec`) give its
  PartitionSpec; a device holds the block of each dimension divided by its mesh axes' sizes.
  The trainer's copies (float32 master weights, gradients, pi_old in model.dtype) use the
  trainer's mesh; the engines' copy uses the engines' own rules (`sampling.layout.engine_rules`:
  every mesh axis but "tensor" dropped), on an engine's `sampling.tensor` devices.
* optimizer state: `jax.eval_shape(optimizer.init)` of the abstract weights; each leaf that
  mirrors a weight (AdamW's mu, nu) is laid out as that weight.
* KV cache and the sampler's arrays: closed forms of the engine's buffers (`kv_cache_bytes`,
  `sampler_bytes`).
* activations and the log-prob kernel: an analytic model of one micro-batch's forward and
  backward under train.remat, train.attn_block and train.logprob_tile (`activation_bytes`,
  `logprob_bytes`), checked against the compiled step's memory_analysis() (tests/test_plan.py).

Devices: `config.mesh.topology` names one of `topology.TOPOLOGIES` (its device count resolves
the -1 mesh axis; its hosts are the run's processes), else this run's devices, whose memory is
`memory_stats()["bytes_limit"]` where the backend reports one (not on CPU: the plan is then
printed but not checked). Items are on the trainer's devices or on an engine's, live for the
whole run ("state") or while that side works ("step"); `Plan` adds them up for the fullest
device as `placement.split_devices` places trainer and engines (sync mode shares the devices
and takes turns; async splits them).

The topologies (`oapl_jax/topology.py`) and where the run puts its trainer and engines
(`oapl_jax/placement.py`) are the run's own: the planner reads the same facts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from oapl_jax import placement, sharding
from oapl_jax.errors import ConfigError, UserError
from oapl_jax.models.transformer import ModelConfig, Transformer
from oapl_jax.placement import seq_len
from oapl_jax.sampling.layout import engine_rules  # the engines' own rules (no TensorFlow)
from oapl_jax.topology import LOCAL, GiB, MESH_AXES, TOPOLOGIES, TPU_GENERATIONS


class PlanError(UserError):
  """The run's plan does not fit its devices' memory (the message names the setting to change)."""


@dataclasses.dataclass(frozen=True)
class Devices:
  """What a plan is made for: a topology's name, its devices (over all processes), JAX
  processes (one per host), and each device's memory in bytes (None: unknown, e.g. CPU)."""

  name: str
  devices: int
  processes: int
  device_bytes: int | None

  @property
  def local(self) -> int:
    """Devices of one process."""
    return self.devices // self.processes


def topology_of(config) -> Devices:
  """The `Devices` of `config.mesh.topology`, else of this run's devices (`memory_stats()
  ["bytes_limit"]`; None where the backend gives no limit, e.g. CPU)."""
  name = config.mesh.topology
  if name not in (None, LOCAL):
    if name not in TOPOLOGIES:
      raise ConfigError(f"config.mesh.topology={name!r}: unknown topology; known: {sorted(TOPOLOGIES)}")
    t = TOPOLOGIES[name]
    return Devices(t.name, t.devices, t.processes, t.device_bytes)
  devices = jax.devices()
  return Devices(f"local {devices[0].device_kind} x {len(devices)}", len(devices), jax.process_count(),
                 device_memory())


def resolve_mesh(mesh_cfg, devices: int) -> dict[str, int]:
  """{"data", "fsdp", "tensor"} sizes of `config.mesh` on `devices` devices (-1 = the rest),
  as the trainer resolves them (`sharding.mesh_shape`)."""
  return dict(zip(MESH_AXES, sharding.mesh_shape(mesh_cfg, devices)))


def shard_bytes(shape: tuple[int, ...], dtype, spec: PartitionSpec, mesh_shape: dict) -> int:
  """Bytes of the largest block of an array `shape` laid out by `spec` over a mesh of
  `mesh_shape` axis sizes (a dimension that does not divide is counted rounded up)."""
  dims = list(shape)
  for i, entry in enumerate(spec):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    dims[i] = -(-dims[i] // math.prod(mesh_shape.get(n, 1) for n in names))
  return math.prod(dims) * np.dtype(dtype).itemsize


def abstract_params(config) -> nnx.State:
  """The `nnx.Param` State of config.model's Transformer, values `jax.ShapeDtypeStruct`s in
  model.param_dtype, logical axes in each Param's metadata (`nnx.eval_shape`: nothing allocated).
  Not to be modified: it is cached per architecture (tracing a 48-layer init takes seconds)."""
  return _abstract_params(ModelConfig.from_config(config.model))


@functools.lru_cache(maxsize=8)
def _abstract_params(cfg: ModelConfig) -> nnx.State:
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))), nnx.Param)


def trained_params(config) -> nnx.State:
  """The weights the trainer differentiates, abstract: every weight (`abstract_params`), or
  under model.lora the adapters (`build.lora_abstract`'s), in model.param_dtype. Not to be
  modified: both are cached (a 36-layer model's adapters take 10 s to trace)."""
  if not _lora_rank(config):
    return abstract_params(config)
  from oapl_jax.models.build import lora_of  # noqa: PLC0415
  return _abstract_adapters(ModelConfig.from_config(config.model), lora_of(config))


@functools.lru_cache(maxsize=8)
def _abstract_adapters(cfg: ModelConfig, lora) -> nnx.State:
  """The adapters of `lora` on a `cfg` model, abstract (`build.lora_abstract`'s shapes and
  dtypes: those do not depend on the seed)."""
  from oapl_jax.models import lora as lora_lib  # noqa: PLC0415
  base = dataclasses.replace(cfg, param_dtype=cfg.dtype)
  model = nnx.eval_shape(lambda: lora_lib.attach(Transformer(base, rngs=nnx.Rngs(params=0)), lora, 0))
  return nnx.state(model, nnx.LoRAParam)


def _lora_rank(config) -> int:
  """config.model.lora.rank; 0 (full training) for a config written before the setting existed."""
  lora = config.model.get("lora")
  return lora.rank if lora is not None else 0


def param_specs(params: nnx.State, rules) -> dict[tuple[str, ...], tuple[tuple[int, ...], PartitionSpec]]:
  """{weight path as strings: (shape, PartitionSpec through `rules`)}."""
  return {tuple(str(k) for k in path): (tuple(var.get_value().shape), sharding.logical_to_spec(
      var.get_metadata().get("logical_axes") or (), rules)) for path, var in nnx.to_flat_state(params)}


def weights_bytes(specs: dict, dtype, mesh_shape: dict) -> int:
  """Bytes per device of one copy of the weights in `dtype`, laid out by `specs`."""
  return sum(shard_bytes(shape, dtype, spec, mesh_shape) for shape, spec in specs.values())


def _keys(key_path) -> tuple[str, ...]:
  """A jax key path as strings: DictKey('embed') -> 'embed', GetAttrKey('mu') -> 'mu'."""
  out = []
  for k in key_path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
  return tuple(out)


def optimizer_bytes(config, params: nnx.State, specs: dict, mesh_shape: dict) -> int:
  """Bytes per device of the optimizer's state (`jax.eval_shape(optimizer.init)`): a leaf whose
  key path ends in a weight's path (AdamW's mu, nu) is laid out as that weight; the others
  (step counts) are replicated."""
  from oapl_jax.rl.step import make_optimizer  # noqa: PLC0415 (optax: only for a plan)
  opt_state = jax.eval_shape(make_optimizer(config.train, config.train.steps).init, params)
  total = 0
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    keys = _keys(key_path)
    found = [specs[keys[i:j]] for i in range(len(keys)) for j in (len(keys), len(keys) - 1)
             if keys[i:j] in specs and specs[keys[i:j]][0] == tuple(leaf.shape)]
    total += shard_bytes(leaf.shape, leaf.dtype, found[0][1] if found else PartitionSpec(), mesh_shape)
  return total


# --- activations: an analytic model (docs/memory.md states it and its calibration) -----------

LOGPROB_TILE_COPIES = 6  # f32 [b, tile, V] blocks alive at once in the log-prob kernel (logits,
# processed logits, keys, log-softmax, its gradient, the top-p bisection's masks).


@dataclasses.dataclass(frozen=True)
class Dims:
  """One device's share of a train micro-batch: b rows of T tokens; widths after tensor splits."""

  b: int  # rows per device per micro-batch
  t: int  # tokens per row (the model's input: seq_len - 1)
  e: int  # hidden size E (replicated over tensor)
  n: int  # query heads per device
  k: int  # key/value heads per device
  d: int  # head width D
  f: int  # MLP width per device
  v: int  # vocabulary per device
  layers: int
  c: int  # compute dtype bytes (model.dtype)
  bh: int | None = None  # rows of a log-prob tile per device (the vocab-split head: `head_rows`); None: b


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


def micro_batch_rows(config) -> int:
  """Rows of one micro-batch: rl.groups_per_step x rl.group_size / train.grad_accum; under
  train.packing the packed rows of one (`rl.step.packing_shape`)."""
  if config.train.packing:
    return config.train.pack_rows or config.rl.groups_per_step * config.rl.group_size // config.train.grad_accum
  return config.rl.groups_per_step * config.rl.group_size // config.train.grad_accum


def micro_batches(config) -> int:
  """Micro-batches a step's program holds: train.grad_accum, or under train.packing the worst
  case's (`rl.packing.max_micro_batches`; a step runs those its answers fill)."""
  if not config.train.packing:
    return config.train.grad_accum
  from oapl_jax.rl.packing import max_micro_batches  # noqa: PLC0415
  return max_micro_batches(config.rl.groups_per_step * config.rl.group_size, seq_len(config),
                           rows=micro_batch_rows(config), budget=row_tokens(config))


def row_tokens(config) -> int:
  """Tokens of one trainer row: seq_len, or under train.packing the packed row's budget."""
  return (config.train.pack_budget or seq_len(config)) if config.train.packing else seq_len(config)


def train_batch_bytes(config, shards: int) -> int:
  """Bytes per device of the step's batch: tokens, mask and sampler log-probs (int32, f32, f32)
  of every row; under train.packing the K x R packed rows' tokens, positions and segment ids
  (int32), the answers' map (3 x [K, B]) and their mask and sampler log-probs in the padded
  layout, plus a micro-batch's per-answer log-probs, entropy and loss terms gathered back into
  that layout (~6 f32 [B, T-1]: `rl.step.unpack`)."""
  answers, t = config.rl.groups_per_step * config.rl.group_size, seq_len(config)
  if not config.train.packing:
    return _ceil(answers, shards) * t * 12
  r, s, k = micro_batch_rows(config), row_tokens(config), micro_batches(config)
  return k * _ceil(r, shards) * s * 12 + k * _ceil(answers, shards) * 12 + _ceil(answers, shards) * t * (8 + 6 * 4)


def head_rows(config, mesh_shape: dict) -> int:
  """Rows of one micro-batch a device scores in each log-prob tile: the head is split by V
  over the "vocab" rule's axes, so a tile's logits `[rows, tile, V / shards]` hold the rows of
  every device sharing a vocab slice: the micro-batch's rows over only the batch axes V does
  not use (`rl.step.vocab_split`)."""
  rules = config.sharding.rules
  vocab = set(sharding.spec_names(sharding.rules_dict(rules).get("vocab")))
  own = [a for a in sharding.spec_names(sharding.batch_axes(rules)) if a not in vocab]
  return _ceil(micro_batch_rows(config), math.prod(mesh_shape.get(a, 1) for a in own))


def train_dims(config, mesh_shape: dict) -> Dims:
  """The `Dims` of config's train micro-batch on one device of a trainer mesh `mesh_shape`."""
  m = config.model
  split = lambda logical: sharding.axis_shards(mesh_shape, config.sharding.rules, logical)  # noqa: E731
  return Dims(bh=head_rows(config, mesh_shape), b=_ceil(micro_batch_rows(config), split("batch")),
              t=row_tokens(config) - 1, e=m.hidden_size, n=_ceil(m.num_heads, split("q_heads")),
              k=_ceil(m.num_kv_heads, split("kv_heads")), d=m.head_dim,
              f=_ceil(m.mlp_dim, split("mlp")), v=_ceil(m.vocab_size, split("vocab")),
              layers=m.num_layers, c=np.dtype(m.dtype).itemsize)


def layer_bytes(x: Dims, policy: str) -> int:
  """Bytes one transformer block keeps for its backward pass under remat `policy`.

  "none": everything its backward reads: 4 [b, T, E] (block input, two norms' outputs, the
  mid-block residual), q and attention output 4 [b, T, N, D] (projection, QK-norm, RoPE,
  output), k and v 4 [b, T, K, D], gate, up, silu(gate) and their product 4 [b, T, F], all in
  the compute dtype, and per token f32 norm statistics and attention log-sum-exps (2 + N).
  "dots": the projections' outputs (q, k, v, o, gate, up, down) and the block input.
  "full": the block input [b, T, E] only (the block is recomputed in the backward pass).
  """
  bt = x.b * x.t
  if policy == "full":
    return bt * x.c * x.e
  if policy == "dots":
    return bt * x.c * (3 * x.e + (x.n + 2 * x.k) * x.d + 2 * x.f)
  return bt * (x.c * (4 * x.e + 4 * x.n * x.d + 4 * x.k * x.d + 4 * x.f) + 4 * (2 + x.n))


def activation_bytes(x: Dims, policy: str, attn_block: int) -> int:
  """Peak activation bytes of one micro-batch's forward + backward through the blocks: every
  block's saved set (`layer_bytes(policy)`), plus, for the block being differentiated, its
  full set recomputed (not with "none": already kept) and their gradients, blockwise
  attention's f32 scores, probabilities and gradient of one [b, N, a, a] block pair
  (a = min(attn_block, T)), and the residual stream's gradient [b, T, E] f32."""
  a = min(attn_block, x.t)
  full_layer = layer_bytes(x, "none")
  working = full_layer * (1 if policy == "none" else 2)
  attention = 3 * x.b * x.n * a * a * 4
  return x.layers * layer_bytes(x, policy) + working + attention + x.b * x.t * x.e * 4


def logprob_bytes(x: Dims, tile: int) -> int:
  """Peak bytes of the tiled log-prob kernel: the final hidden states [b, T, E] (compute dtype)
  and their gradient (f32), LOGPROB_TILE_COPIES f32 [bh, tile, V] blocks (each scan step scores
  `min(tile, T)` positions of the `bh` rows that share the device's vocab slice:
  `rl.logprobs.tiled_logprobs`, `head_rows`), and ~8 f32 [b, T] per-token arrays (log-probs,
  entropy, mask, targets, loss terms)."""
  tokens, rows = x.b * x.t, x.b if x.bh is None else x.bh
  return tokens * x.e * (x.c + 4) + LOGPROB_TILE_COPIES * rows * min(tile, x.t) * x.v * 4 + 8 * tokens * 4


def kv_cache_bytes(config) -> int:
  """Bytes per device of one engine's KV cache: per layer keys [S, K, D, M] + values
  [S, K, M, D] in model.dtype, K split over sampling.tensor; S = max_slots / engines,
  M = seq_len (the largest capacity the cache grows to)."""
  m, s = config.model, config.sampling
  slots = placement.engine_slots(config)
  return (2 * m.num_layers * slots * _ceil(m.num_kv_heads, s.tensor) * m.head_dim * seq_len(config)
          * np.dtype(m.dtype).itemsize)


SAMPLER_COPIES = 5  # f32 [S, V] arrays of a decode step's sampling alive at once (the logits
# gathered over the vocab split and their layout copy, the log-softmax, the prefix sums and their
# 64-token blocks, which XLA:TPU pads to 128 lanes: `processing.sample`)
TRUNCATION_COPIES = 2  # more with top-p / top-k (`processing.process_logits`: the kept-token mask)
LANES = 128  # XLA:TPU's minor tile


def sampler_bytes(config, where: Devices, loop: bool = True) -> int:
  """An engine's sampling arrays in a decode step: SAMPLER_COPIES f32 [S, V] (+ TRUNCATION_COPIES
  with top-p or top-k); S = the engine's slots. loop: in the decode loop (`generate_steps`) on
  TPU without truncation, XLA:TPU keeps the loop's logits and log-softmax in a layout with the
  slots in the 128 lanes instead, two f32 [max(S, 128), V], beside the prefix sums and their
  blocks (two [S, V]). Compiled for v5p, math.py (32 slots, no truncation; the loop's two
  lane-major arrays: 0.15 GiB) and code.py (16 slots, top-p 0.95): within 3% of the decode
  step's and the loop's temp (docs/memory.md)."""
  s, v = placement.engine_slots(config), config.model.vocab_size
  truncates = config.sampling.top_p < 1.0 or config.sampling.top_k > 0
  if loop and _on_tpu(where) and not truncates:
    return 2 * max(s, LANES) * v * 4 + 2 * s * v * 4
  return (SAMPLER_COPIES + TRUNCATION_COPIES * truncates) * s * v * 4


def lora_merge(config) -> str:
  """config.model.lora.merge: "kept" (a standing merged copy) or "in_refresh" (none);
  "kept" for a config written before the setting existed."""
  lora = config.model.get("lora")
  return lora.get("merge", "kept") if lora is not None else "kept"


def _quantized(key: tuple[str, ...]) -> int:
  """How many input axes a base weight's int8 scale reduces (`quant.IN_AXES`), 0 if it is kept."""
  from oapl_jax.models.quant import IN_AXES  # noqa: PLC0415
  return IN_AXES.get(key[-1], 0) if key and key[0] == "layers" else 0


def quantized_base_bytes(specs: dict, dtype, mesh: dict) -> int:
  """Bytes per device of a model.base_quant="int8" base (`quant.quantize_base`): each block
  projection as int8 plus its float32 scale (the input axes 1, unsplit), the rest in `dtype`."""
  total = 0
  for key, (shape, spec) in specs.items():
    n = _quantized(key)
    if not n:
      total += shard_bytes(shape, dtype, spec, mesh)
      continue
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    total += shard_bytes(shape, np.int8, spec, mesh)
    total += shard_bytes((1,) * n + tuple(shape[n:]), np.float32, PartitionSpec(*([None] * n), *axes[n:]), mesh)
  return total


def dequantized_bytes(config, specs: dict, dtype, mesh: dict) -> int:
  """The train step's dequantised projections (model.base_quant): under a remat scan one
  block's at a time, with remat "none" every block's (the backward keeps what it multiplies by)."""
  kept = {k: v for k, v in specs.items() if _quantized(k)}
  if config.train.remat != "none":
    kept = {k: v for k, v in kept.items() if k[:2] == ("layers", "0")}
  return weights_bytes(kept, dtype, mesh)


def refresh_merge_bytes(config, mesh: dict) -> int:
  """model.lora.merge="in_refresh": what the refresh's merge adds per trainer device, one
  block's adapted weights (the layer in transit, `layout.MergeOnLoad`) as float32 sums
  (W + scale A B before the rounding), in the trainer's layout. An upper bound: XLA may fuse
  the sum into the rounding and keep only the products."""
  targets = set(config.model.lora.targets)
  specs = param_specs(abstract_params(config), config.sharding.rules)
  block = {k: v for k, v in specs.items() if k[:2] == ("layers", "0") and k[-1] in targets}
  return weights_bytes(block, np.float32, mesh)


def refresh_bytes(config) -> int:
  """The refresh's working set per device (pi_old from the trainer's layout to the engines':
  `EngineLayout.relayout`): the LM head's engine shard, gathered and laid out whole, and one
  layer's weights in transit, as the layers are laid out one after another. Compiled for v5p:
  math.py 0.216 GiB against 0.228 so counted, code.py 0.530 against 0.491 (docs/memory.md)."""
  m, cd = config.model, np.dtype(config.model.dtype)
  engine_specs = param_specs(abstract_params(config), engine_rules(config.sharding.rules))
  tensor = {"tensor": config.sampling.tensor}
  head = ("embed",) if m.tie_embeddings else ("lm_head",)
  layer = {k: v for k, v in engine_specs.items() if k[:2] == ("layers", "0")}
  return weights_bytes({head: engine_specs[head]}, cd, tensor) + weights_bytes(layer, cd, tensor)


# --- the plan --------------------------------------------------------------------------------

# What to change when an item is the biggest one of a plan that does not fit.
SETTINGS = {
    "master weights": "mesh.fsdp (more devices: mesh.topology)",
    "optimizer state": "mesh.fsdp (more devices: mesh.topology)",
    "gradients": "mesh.fsdp (more devices: mesh.topology)",
    "trainer snapshot": "mesh.fsdp (more devices: mesh.topology)",
    "reference policy": "mesh.fsdp (more devices: mesh.topology)",
    "frozen base": "model.base_quant='int8' (with model.lora) or mesh.fsdp (more devices: mesh.topology)",
    "dequantised base": "train.remat (a scan dequantises one block at a time) or mesh.fsdp",
    "merged weights": "model.lora.merge='in_refresh' (no standing merged copy) or mesh.fsdp",
    "refresh merge": "mesh.fsdp (more devices: mesh.topology)",
    "train batch": "rl.groups_per_step (or more devices: mesh.topology)",
    "activations": "train.grad_accum, train.remat or train.attn_block",  # see activation_settings
    "log-prob kernel": "train.logprob_tile or train.grad_accum",
    "engine snapshot": "sampling.tensor (sync mode: sampling.release_weights)",
    "KV cache": "sampling.max_slots (or spread the cache: sampling.engines x sampling.tensor)",
    "engine sampling": "sampling.max_slots (or sampling.engines)",
    "decode loop copy": "sampling.max_slots (or spread the cache: sampling.engines x sampling.tensor)",
    "engine prefill": "sampling.max_prefill_batch",
}


@dataclasses.dataclass(frozen=True)
class Item:
  """One line of a plan: `nbytes` on each device of `where` ("trainer" or "engine"), live for
  the whole run (`phase` "state") or only while that side works ("step": a train step, or
  sampling)."""

  name: str
  nbytes: int
  where: str
  phase: str
  note: str
  change: str = ""  # the settings to change if it is the biggest item (default: SETTINGS[name])


@dataclasses.dataclass(frozen=True)
class Plan:
  """Bytes per device of a run, for its fullest device.

  shared: the trainer and (some) engines use the same devices (sync mode, or async with too
  few devices); such a device holds both sides' state, plus the larger of the two "step"
  sets (sync: training and sampling take turns) or both (async: at once). Otherwise the
  fullest device is the fuller of a trainer device and an engine device.
  """

  topology: str
  devices: int
  mesh: dict  # the trainer's mesh axis sizes
  engines: int
  engine_tensor: int
  shared: bool
  concurrent: bool
  items: tuple[Item, ...]
  device_bytes: int | None  # None: unknown (CPU): no check
  processes: int = 1  # hosts, one JAX process each
  engine_slots: int = 0  # answers one engine replica decodes at once
  host_bytes: int = 0  # per process, host memory: the answers of a rollout window (`host_window_bytes`)
  host_note: str = ""
  sampler_job: bool = False  # a remote sampler job's devices: engines only (`make_sampler_plan`)

  def _bytes(self, items) -> int:
    return sum(i.nbytes for i in items)

  def _group(self, where: str, phase: str | None = None) -> list[Item]:
    return [i for i in self.items if i.where == where and phase in (None, i.phase)]

  def counted(self) -> list[Item]:
    """The items the fullest device holds at its peak (see the class docstring)."""
    if not self.shared:
      return max(self._group("trainer"), self._group("engine"), key=self._bytes)
    steps = [self._group("trainer", "step"), self._group("engine", "step")]
    peak = steps[0] + steps[1] if self.concurrent else max(steps, key=self._bytes)
    return self._group("trainer", "state") + self._group("engine", "state") + peak

  @property
  def total(self) -> int:
    return self._bytes(self.counted())

  @property
  def headroom(self) -> int | None:
    return None if self.device_bytes is None else self.device_bytes - self.total

  @property
  def fits(self) -> bool:
    return self.headroom is None or self.headroom >= 0

  def advice(self) -> str:
    """One line: how far over the plan is and the setting to change (the biggest item's)."""
    big = max(self.counted(), key=lambda i: i.nbytes)
    return (f"the run needs {_gib(self.total)} per device but {self.topology} devices have "
            f"{_gib(self.device_bytes)} (short by {_gib(-self.headroom)}); the biggest item is the "
            f"{big.name} ({_gib(big.nbytes)} per device): change {big.change or SETTINGS[big.name]}")

  def format(self) -> str:
    """The plan as a table (item, bytes per device, GiB, where/phase, note) and the totals."""
    axes = " x ".join(f"{a} {n}" for a, n in self.mesh.items())
    layout = ("trainer and engines share devices" if self.shared else "engines on their own devices")
    first = (f"memory plan per device of a sampler job (rl.mode=remote): {self.topology} ({self.devices} "
             f"devices); {self.engines} engine(s) x tensor {self.engine_tensor}; no trainer"
             if self.sampler_job else
             f"memory plan per device: {self.topology} ({self.devices} devices); trainer mesh {axes}; "
             f"{self.engines} engine(s) x tensor {self.engine_tensor}; {layout}")
    lines = [first,
             f"hosts: {self.processes} (one process each) of {self.devices // self.processes} "
             f"devices; each runs {self.engines // self.processes} engine(s) of {self.engine_slots} "
             f"decode slots on {self.engine_tensor} device(s)",
             f"{'item':<17} {'bytes':>17} {'GiB':>8}  {'where':<13}  note"]
    counted = {id(i) for i in self.counted()}
    for i in self.items:
      mark = "" if id(i) in counted else " (not at the peak)"
      lines.append(f"{i.name:<17} {i.nbytes:>17,} {i.nbytes / GiB:>8.2f}  "
                   f"{i.where + '/' + i.phase:<13}  {i.note}{mark}")
    if self.sampler_job:
      how = "an engine device: its state + sampling"
    elif not self.shared:
      how = "the fuller of a trainer and an engine device"
    elif self.concurrent:
      how = "states + trainer step + engine step (async: at once)"
    else:
      how = "states + the larger step (sync: training and sampling take turns)"
    lines.append(f"{'total':<17} {self.total:>17,} {self.total / GiB:>8.2f}  {'':<13}  {how}")
    lines.append(f"{'host (process)':<17} {self.host_bytes:>17,} {self.host_bytes / GiB:>8.2f}  "
                 f"{'host':<13}  {self.host_note}")
    if self.device_bytes is None:
      lines.append("device memory: unknown (this backend reports no limit): not checked; "
                   "give config.mesh.topology to check against one")
    else:
      lines.append(f"{'device memory':<17} {self.device_bytes:>17,} {self.device_bytes / GiB:>8.2f}")
      lines.append(f"{'headroom':<17} {self.headroom:>17,} {self.headroom / GiB:>8.2f}  {'':<13}  "
                   f"{'fits' if self.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)


def _gib(n: int) -> str:
  return f"{n / GiB:.2f} GiB"


def trainer_layout(config, where: Devices) -> tuple[int, bool]:
  """(trainer devices over all processes, shared) as `placement.split_devices` places the run
  on `where`; more engine devices than a process has is a ConfigError, as the run refuses it."""
  split = placement.split_devices(config, where.local, where.processes)
  if len(split.engines) > where.local:
    s = config.sampling
    raise ConfigError(
        f"config.sampling.engines={s.engines}: {len(split.engines)} devices per process for its "
        f"engines (sampling.engines / {where.processes} processes x sampling.tensor={s.tensor}) "
        f"but {where.name} has {where.local} per process")
  return len(split.trainer) * where.processes, split.shared


def train_temp_bytes(config, mesh: dict) -> dict[str, int]:
  """Per device, what a train step allocates beyond its arguments (the compiled step's temp
  memory): "gradients" (model.param_dtype like the weights; with train.grad_accum > 1 the
  running sum and one micro-batch's), "activations" and "log-prob kernel" of one micro-batch."""
  specs = param_specs(trained_params(config), config.sharding.rules)
  grads = weights_bytes(specs, config.model.param_dtype, mesh) * (2 if micro_batches(config) > 1 else 1)
  x = train_dims(config, mesh)
  return {"gradients": grads, "activations": activation_bytes(x, config.train.remat, config.train.attn_block),
          "log-prob kernel": logprob_bytes(x, config.train.logprob_tile)}


def activation_settings(config, x: Dims) -> str:
  """What would shrink the activations, most effective first: full remat, fewer rows per
  device per micro-batch (more train.grad_accum), a tensor split of heads and MLP width, and
  shorter rows."""
  tr = config.train
  out = [] if tr.remat == "full" else [f"train.remat='full' (now {tr.remat!r})"]
  if x.b > 1:
    out.append(f"train.grad_accum (now {tr.grad_accum}: {x.b} rows per device per micro-batch)")
  out += [f"mesh.tensor (now {config.mesh.tensor}: splits heads and MLP width)",
          f"sampling.max_new_tokens (rows of {seq_len(config)} tokens)"]
  return ", ".join(out[:-1]) + " or " + out[-1]


def host_window_bytes(config, processes: int) -> tuple[int, str]:
  """Host bytes per process of one sampling call's answers at its peak, and a note: a window of
  `rl.window_rollouts` rollouts (this process's share) held twice, as the engines' answer
  buffers (token and log-prob per answer position, `rollout._Answers`) and as the trainer's
  rows (tokens, mask, log-probs per position, `buffer.Rows`), which then wait in the buffer."""
  rl, s = config.rl, config.sampling
  rows = _ceil(rl.window_rollouts * rl.groups_per_rollout, processes) * rl.group_size
  per_row = 8 * s.max_new_tokens + 12 * seq_len(config) + 16
  note = (f"rl.window_rollouts={rl.window_rollouts} x {rl.groups_per_rollout} groups x G="
          f"{rl.group_size} / {processes} process(es) = {rows} answers, "
          f"{per_row:,} B each (engine buffers + trainer rows)")
  return rows * per_row, note


def make_plan(config) -> Plan:
  """The memory plan of a validated `config` on its topology (`config.mesh.topology`, else
  this process's devices), from abstract shapes only: no weight is read or allocated."""
  where = topology_of(config)
  m, s, tr = config.model, config.sampling, config.train
  trainer_devices, shared = trainer_layout(config, where)
  mesh = resolve_mesh(config.mesh, trainer_devices)
  from oapl_jax.rl.step import check_batch_divides  # noqa: PLC0415 (see abstract opt state)
  check_batch_divides(config, mesh)  # the trainer refuses these micro-batches too
  base_specs = param_specs(abstract_params(config), config.sharding.rules)
  engine_specs = param_specs(abstract_params(config), engine_rules(config.sharding.rules))
  params = trained_params(config)  # every weight, or the adapters (model.lora)
  specs = param_specs(params, config.sharding.rules)
  count = sum(math.prod(shape) for shape, _ in specs.values())
  pd, cd = np.dtype(m.param_dtype), np.dtype(m.dtype)
  master = weights_bytes(specs, pd, mesh)
  x = train_dims(config, mesh)
  rows, slots = micro_batch_rows(config), placement.engine_slots(config)
  lora = bool(_lora_rank(config))
  what = f"adapters (rank {m.lora.rank})" if lora else "params"
  # sync mode, sampling.release_weights: the engines' weights live while they sample only
  released = bool(config.sampling.get("release_weights", False)) and config.rl.mode == "sync"
  items = [
      Item("master weights", master, "trainer", "state",
           (f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count:,}") + f" {what} in {pd.name}, "
           "trainer layout"),
      Item("optimizer state", optimizer_bytes(config, params, specs, mesh), "trainer", "state",
           f"jax.eval_shape(optimizer.init): AdamW mu + nu like the {what}"),
      Item("trainer snapshot", weights_bytes(specs, cd, mesh), "trainer", "state",
           f"pi_old ({what}) in {cd.name}, trainer layout (refresh source, checkpoints)"),
  ]
  if lora:
    base = weights_bytes(base_specs, cd, mesh)
    quant = m.get("base_quant", "none")
    if quant == "none":
      items.append(Item("frozen base", base, "trainer", "state",
                        f"model.lora: the base's weights in {cd.name}, frozen, trainer layout"))
    else:
      items.append(Item("frozen base", quantized_base_bytes(base_specs, cd, mesh), "trainer", "state",
                        f"model.lora over an {quant} base: block projections in {quant} + a float32 "
                        f"scale per output channel, the rest in {cd.name}, trainer layout"))
      items.append(Item("dequantised base", dequantized_bytes(config, base_specs, cd, mesh), "trainer",
                        "step", f"the projections read as {cd.name} in the step: "
                        + ("every block's, kept for the backward (remat none)" if tr.remat == "none"
                           else "one block's at a time (the remat scan)")))
    if lora_merge(config) == "kept":
      items.append(Item("merged weights", base, "engine" if released else "trainer",
                        "step" if released else "state",
                        f"base + adapters in {cd.name}, merged at a refresh and kept (the engines "
                        "load them; model.lora.merge='in_refresh': none)"
                        + ("; sampling.release_weights: while sampling only" if released else "")))
  merge_temp = refresh_merge_bytes(config, mesh) if lora and lora_merge(config) == "in_refresh" else 0
  from oapl_jax.rl.step import uses_reference  # noqa: PLC0415 (optax: only for a plan)
  if uses_reference(config):
    items.append(Item("reference policy", master, "trainer", "state", "frozen RL start (GRPO's KL)"))
  temp = train_temp_bytes(config, mesh)
  items += [
      Item("gradients", temp["gradients"], "trainer", "step",
           f"{pd.name} like the {what}" + (": running sum + a micro-batch's" if tr.grad_accum > 1 else "")),
      Item("train batch", train_batch_bytes(config, sharding.batch_shards(mesh, config.sharding.rules)),
           "trainer", "step", "the step's tokens, mask and sampler log-probs (int32, f32, f32)"
           + ("; packed rows' positions and segment ids, answers gathered back" if tr.packing else "")),
      Item("activations", temp["activations"], "trainer", "step",
           f"{x.b} row(s) x {x.t} tokens per device per micro-batch, remat={tr.remat}, "
           f"attn_block={tr.attn_block}", activation_settings(config, x)),
      Item("log-prob kernel", temp["log-prob kernel"], "trainer", "step",
           f"hidden states + {LOGPROB_TILE_COPIES} f32 [{x.bh}, {min(tr.logprob_tile, x.t)}, {x.v}] tiles"),
  ]
  if merge_temp:
    items.append(Item("refresh merge", merge_temp, "engine" if released else "trainer", "step",
                      "model.lora.merge='in_refresh': one block's adapted weights merged in f32 as "
                      "the refresh lays it out " + ("(before each rollout: counted with sampling)" if released
                                                    else "(at a refresh, not during a step: counted with it)")))
  items += [
      Item("engine snapshot", weights_bytes(engine_specs, cd, {"tensor": s.tensor}), "engine",
           "step" if released else "state",
           f"pi_old in {cd.name}, engine layout (split over sampling.tensor={s.tensor} only)"
           + ("; sampling.release_weights: held while sampling only" if released else "")),
      Item("KV cache", kv_cache_bytes(config), "engine", "state",
           f"{slots} slots x {seq_len(config)} positions x {m.num_layers} layers, "
           f"{m.num_kv_heads} KV heads over tensor {s.tensor}, {cd.name}"),
      Item("engine sampling", sampler_bytes(config, where), "engine", "step",
           f"the sampler's f32 [{slots}, V] arrays, replicated on an engine"),
      Item("decode loop copy", kv_cache_bytes(config) if loop_copies_cache(config, where) else 0,
           "engine", "step",
           "TPU, a head_dim or a row length (the largest cache) not a multiple of 128: a second "
           "KV cache (XLA:TPU lays the cache out apart from what the decode loop reads and "
           "copies it; compiled for v5p: --dry_run=compile); none with both multiples of 128, "
           "none on CPU; GPU not known"),
      Item("engine prefill", _prefill_bytes(config, where), "engine", "step",
           f"{s.max_prefill_batch} prompts x {s.max_prompt_len} tokens, one layer at a time"),
  ]
  host, host_note = host_window_bytes(config, where.processes)
  return Plan(where.name, where.devices, mesh, s.engines, s.tensor, shared,
              placement.overlaps_training(config), tuple(items), where.device_bytes,
              where.processes, slots, host, host_note)


def sampler_config(config):
  """`config` as a sampler job's devices see it: the trainer's mesh is elsewhere, so any mesh
  (fsdp over the job's devices) stands in for it where the planner and the compiler ask."""
  out = config.copy_and_resolve_references()
  out.mesh.data, out.mesh.fsdp, out.mesh.tensor = 1, -1, 1
  return out


def sampler_base_items(config) -> tuple[Item, ...]:
  """A LoRA sampler job's base (`rl.sampler_job.SamplerJob`): the frozen base it builds once (in
  model.base_quant's form) and the base merged with each version's adapters, both whole on the
  job's first device (not split), kept until the next version is merged."""
  cd = np.dtype(config.model.dtype)
  whole = {k: (shape, PartitionSpec()) for k, (shape, _) in
           param_specs(abstract_params(config), config.sharding.rules).items()}
  quant = config.model.get("base_quant", "none")
  base = weights_bytes(whole, cd, {}) if quant == "none" else quantized_base_bytes(whole, cd, {})
  return (Item("frozen base", base, "engine", "state",
               f"model.lora: the job's own base in {cd.name if quant == 'none' else quant}, built once, "
               "whole on its first device", "sampling.tensor does not split it: a device with room"),
          Item("merged weights", weights_bytes(whole, cd, {}), "engine", "state",
               f"base + the version's adapters in {cd.name}, whole on the first device, which the "
               "engines lay out from", "sampling.tensor does not split it: a device with room"))


def make_sampler_plan(config) -> Plan:
  """The plan of a remote sampler job (`python -m oapl_jax.sample --dry_run`) of `config` on
  its topology: its engines' items only (the trainer is elsewhere); `sampling.engines` x
  `sampling.tensor` must fit the job's devices. The job's host holds one rollout's answers."""
  where = topology_of(config)
  need = config.sampling.engines * config.sampling.tensor
  if need > where.devices // where.processes:
    raise ConfigError(f"config.sampling.engines={config.sampling.engines} x sampling.tensor="
                      f"{config.sampling.tensor}: {need} devices, but a sampler job runs on one host "
                      f"and {where.name} has {where.devices // where.processes} per host")
  full = make_plan(sampler_config(config))
  items = tuple(i for i in full.items if i.where == "engine")
  if _lora_rank(config):  # snapshots are adapters: the job's own frozen base and the merge (`SamplerJob`)
    items += sampler_base_items(config)
  return dataclasses.replace(full, items=items, shared=False, concurrent=False, sampler_job=True,
                             host_bytes=0, host_note="one rollout's answers at a time")


def loop_copies_cache(config, where: Devices, capacity: int | None = None) -> bool:
  """Whether the engine's decode loop at KV-cache `capacity` (None: its largest, seq_len
  positions) holds a second KV cache, as compiled for v5p: on a TPU slice when model.head_dim or
  the capacity is not a multiple of 128 lanes (head_dim 64, 300 positions, or cache_bucket 64's
  first capacity: temp about that capacity's cache; the cache writes stay in the cache's layout
  only in whole tiles, `sampling.decode.write_keys`). The plan counts the largest capacity's."""
  positions = seq_len(config) if capacity is None else capacity
  return _on_tpu(where) and (config.model.head_dim % LANES != 0 or positions % LANES != 0)


def loop_copy_bytes(config, where: Devices, capacity: int) -> int:
  """The decode loop's second KV cache at `capacity` (`loop_copies_cache`), in XLA:TPU's tiled
  layout: twice that capacity's cache (compiled for v5p with sampling.cache_bucket 64, decode @
  64's temp beyond the sampler's: math.py 0.14 GiB, twice its cache; code.py 1.5 times. The
  configs now start at 128)."""
  if not loop_copies_cache(config, where, capacity):
    return 0
  return kv_cache_bytes(config) * _ceil(capacity, LANES) * LANES // seq_len(config)


def _on_tpu(where: Devices) -> bool:
  """Whether `where` is a TPU slice (a named one, or this machine's TPU devices)."""
  if where.name.startswith("local "):
    return jax.devices()[0].platform == "tpu"
  return where.name.split("-")[0] in TPU_GENERATIONS


def _prefill_bytes(config, where: Devices) -> int:
  """An engine's prefill working set, forward only (each layer's keys and values go to the KV
  cache, nothing is kept for a backward pass): the live values of one layer's MLP, its widest
  part, for max_prefill_batch x max_prompt_len tokens in the compute dtype: the residual, the
  block input and its norm, gate and up (fused), and their product (3 E + 3 F per token;
  compiled for v5p-64, math.py: 0.25 GiB against 0.23 so counted). Off TPU, blockwise
  attention's f32 [P, N, a, a] blocks too; on TPU (model.attention_kernel auto or pallas) the
  splash kernel keeps its blocks in VMEM."""
  s, m = config.sampling, config.model
  tokens = s.max_prefill_batch * s.max_prompt_len
  e, f = m.hidden_size, _ceil(m.mlp_dim, s.tensor)
  mlp = tokens * np.dtype(m.dtype).itemsize * (3 * e + 3 * f)
  if _on_tpu(where) and config.model.attention_kernel in ("auto", "pallas"):  # splash
    return mlp
  a = min(config.train.attn_block, s.max_prompt_len)
  return mlp + 3 * s.max_prefill_batch * _ceil(m.num_heads, s.tensor) * a * a * 4


def device_memory() -> int | None:
  """Bytes per local device (`memory_stats()["bytes_limit"]`), None where the backend gives
  no limit (CPU). Starts JAX's backends."""
  return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def check(config) -> Plan | None:
  """The plan of a validated `config`, checked: a plan that does not fit a known device memory
  is a PlanError whose one-line message names the setting to change. None (nothing checked)
  where the memory is unknown: no `mesh.topology` and a backend without a limit (CPU)."""
  if config.mesh.topology in (None, LOCAL) and device_memory() is None:
    return None
  plan = make_plan(config)
  if not plan.fits:
    raise PlanError(plan.advice())
  return plan
