"""Every program a run executes, compiled ahead of time for its devices: `--dry_run=compile`.

    report = compile_run(config)   # nothing allocated, no weights or data read
    print(report.format())         # per program: XLA's bytes per device beside the planner's
    report.check()                 # PlanError (one line) if the compiled run does not fit

`config.mesh.topology` names a TPU slice: the programs are compiled by the real TPU compiler
(libtpu, through `jax.experimental.topologies`: the slice's devices as libtpu describes them,
hosts and device order included) on whatever host runs the command, CPU included. libtpu is
not a dependency of the project: it lives in a venv of its own (`pip install -e '.[tpu]'`;
docs/memory.md). With no topology, the programs are compiled for this machine's devices.

The programs (`programs`), built by the run's own code with the run's shardings:
* "train step": `rl.step.TrainStep.jitted` (its micro-batch loop, the snapshot's and the
  reference's log-probs when the loss needs them), arguments as `Run` holds them;
* "offline log-probs" (rl.mode "offline"): the kernel that rescores a file's rows;
* "refresh": the re-layout of pi_old from the trainer's shardings to the engines'
  (`sampling.layout.load_weights`' one program);
* "prefill": an engine's prefill of `sampling.max_prefill_batch` prompts of
  `max_prompt_len` tokens (the largest call);
* "decode @ C": an engine's `generate_steps` at every KV-cache capacity C the run reaches
  (`sampling.cache_bucket` x powers of 2, up to the row length), and "decode step": one step
  at the largest (the roofline's unit).

For each: `memory_analysis()` (arguments, outputs, aliased, temporaries: bytes per device)
and `cost_analysis()` (FLOPs and bytes accessed per device); and the run's peak per device
from them, against the device's memory (the planner's `Plan` decides which programs share a
device: `compiled_peak`). A roofline of the train step and the decode step from the chip's peak
FLOP/s and HBM bandwidth (`topology.CHIPS`): a lower bound on time, an upper bound on MFU.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oapl_jax import placement, sharding
from oapl_jax import plan as plan_lib
from oapl_jax.errors import ConfigError, UserError
from oapl_jax.placement import seq_len
from oapl_jax.rl import losses
from oapl_jax.topology import CHIPS, LOCAL, GiB, TOPOLOGIES, Topology

# libtpu's names of a TPU generation, its chip config and its chips' grid per slice size.
_GRID_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
            128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8)}  # v4, v5p: chips in a 3-D torus
_GRID_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}  # v5e, v6e
_TPU = {"v4": ("v4", "megacore", _GRID_3D), "v5p": ("v5", "megacore", _GRID_3D),
        "v5e": ("v5e", "default", _GRID_2D), "v6e": ("v6e", "default", _GRID_2D)}

INSTALL = ("the TPU compiler (libtpu) is not installed in this Python environment: in a venv of "
           "its own, `pip install -e '.[tpu]'` (docs/memory.md, 'Compiled for the pod')")


def libtpu_name(t: Topology) -> tuple[str, str, tuple[int, ...]]:
  """(libtpu topology name, chip config name, chips per host bounds) of a TPU slice."""
  generation = t.name.split("-")[0]
  if generation not in _TPU:
    raise ConfigError(f"config.mesh.topology={t.name!r}: --dry_run=compile compiles for TPU "
                      f"slices ({', '.join(_TPU)}) or, with no topology, this machine's devices")
  platform, chip_config, grids = _TPU[generation]
  if t.devices not in grids:
    raise ConfigError(f"config.mesh.topology={t.name!r}: not a single TPU slice libtpu describes "
                      f"(slices of {sorted(grids)} chips)")
  grid = grids[t.devices]
  per_host = {1: (1, 1, 1), 8: (2, 4, 1)}.get(t.devices_per_host, (2, 2, 1))
  return f"{platform}:{'x'.join(map(str, grid))}", chip_config, per_host


def tpu_devices(t: Topology) -> list:
  """The devices of TPU slice `t` as libtpu describes them (for compiling only)."""
  name, chip_config, per_host = libtpu_name(t)
  try:
    import libtpu  # noqa: F401, PLC0415 (optional: only this command needs it)
  except ImportError:
    raise UserError(INSTALL) from None
  from jax.experimental import topologies  # noqa: PLC0415
  devices = list(topologies.get_topology_desc(name, chip_config_name=chip_config,
                                              chips_per_host_bounds=per_host).devices)
  hosts = len({d.process_index for d in devices})
  if len(devices) != t.devices or hosts != t.processes:
    raise RuntimeError(f"libtpu's {name} has {len(devices)} devices on {hosts} hosts; "
                       f"topology.py says {t.devices} on {t.processes}")
  return devices


def local_devices(devices: list, process: int) -> list:
  """The devices of one process, in id order (as `jax.local_devices()` lists them there)."""
  return sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)


# --- the programs -----------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
  """One compiled program: XLA's bytes per device and cost, and the planner's figures for the
  same buffers (arguments: the state it reads; temp: what it allocates)."""

  name: str
  where: str  # "trainer" or "engine"
  argument: int
  output: int
  alias: int
  temp: int
  flops: float
  bytes_accessed: float
  seconds: float  # compile time on this host
  planned_argument: int | None = None
  planned_temp: int | None = None
  hlo: str = dataclasses.field(default="", repr=False)  # optimized HLO text (tests read it)
  pallas_calls: int = 0  # Pallas (Mosaic) kernels in the compiled program (TPU custom calls)

  @property
  def planned(self) -> int | None:
    """The plan's bytes for what XLA reports as arguments + temp (None: not planned)."""
    if self.planned_argument is None or self.planned_temp is None:
      return None
    return self.planned_argument + self.planned_temp

  def outside_band(self) -> str | None:
    """Why arguments + temp are outside the plan's band (`PLAN_BAND`, `PLAN_FLOOR`), or None."""
    planned = self.planned
    if planned is None:
      return None
    compiled = self.argument + self.temp
    if abs(compiled - planned) <= PLAN_BAND * planned + PLAN_FLOOR:
      return None
    return (f"the {self.name} compiles to {compiled / GiB:.3f} GiB per device (arguments + temp) "
            f"against {planned / GiB:.3f} GiB planned ({compiled / max(planned, 1):.2f}x), outside the "
            f"plan's band (+-{PLAN_BAND:.0%} + {PLAN_FLOOR / 2**20:.0f} MiB: docs/memory.md)")

  @property
  def total(self) -> int:
    """Bytes per device while it runs: arguments, outputs not aliased to an argument, temp."""
    return self.argument + self.output - self.alias + self.temp


# The band a program's compiled arguments + temp must fall in around the plan's (docs/memory.md
# "Compiled for the pod", measured 2026-12-03/04): every program of math.py on v5p-64, code.py
# on v5p-128 and math.py's sampler job on v6e-8 is within 10% of the plan (the largest gap +9%);
# the test's tiny models (hidden 128, a few MB of weights) compile up to 39 MB over or under it,
# XLA:TPU's fixed scratch and tile padding, which a per-item plan does not model.
PLAN_BAND = 0.15
PLAN_FLOOR = 64 * 2**20
PALLAS_CALL = 'custom_call_target="tpu_custom_call"'  # how a Pallas (Mosaic) kernel appears in TPU HLO


def _compile(name: str, where: str, lowered, planned_argument=None, planned_temp=None,
             keep_hlo: bool = False) -> Program:
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per computation
    cost = cost[0] if cost else {}
  text = compiled.as_text()
  return Program(name, where, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                 mem.alias_size_in_bytes, mem.temp_size_in_bytes, float(cost.get("flops", 0.0)),
                 float(cost.get("bytes accessed", 0.0)), seconds, planned_argument, planned_temp,
                 text if keep_hlo else "", text.count(PALLAS_CALL))


def _sds(tree, shardings=None, dtype=None):
  """`tree`'s leaves as ShapeDtypeStructs (dtype: cast floating leaves), with `shardings`' leaves."""
  cast = lambda x: dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype  # noqa: E731
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cast(x)), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=s), tree, shardings)


def capacities(config) -> list[int]:
  """The KV-cache capacities a run's engines reach: sampling.cache_bucket x 2^k, capped at the
  row length (`Engine.capacity_for`)."""
  out, c, top = [], config.sampling.cache_bucket, seq_len(config)
  while True:
    out.append(min(c, top))
    if c >= top:
      return out
    c *= 2


@dataclasses.dataclass
class _Build:
  """What the programs of one run are built from: its config, devices, trainer mesh and train
  step, the abstract weights, and the plan's figures by item."""

  config: object
  devices: list
  processes: int
  split: placement.Split
  mesh: object
  graphdef: object
  model_cfg: object
  abstract: object
  snapshot: object  # pi_old's abstract leaves (model.dtype)
  step: object  # the run's TrainStep
  items: dict
  keep_hlo: bool
  only: tuple[str, ...] | None

  def wanted(self, name: str) -> bool:
    return self.only is None or name.startswith(tuple(self.only))

  def compile(self, name: str, where: str, lowered, planned_argument=None, planned_temp=None) -> Program:
    return _compile(name, where, lowered, planned_argument, planned_temp, self.keep_hlo)


def programs(config, devices: list, plan: plan_lib.Plan, keep_hlo: bool = False,
             only: tuple[str, ...] | None = None) -> list[Program]:
  """Compiles every program of a run of `config` on `devices` (all processes'), the run's own
  code and shardings, abstract arguments; `plan` gives the planner's figures beside each.
  only: the programs whose names start with one of these (None: all); the others are neither
  lowered nor compiled (tests/test_aot.py compiles the decode loop of a second model so)."""
  from oapl_jax.models import build  # noqa: PLC0415
  from oapl_jax.rl.step import make_optimizer, make_train_step  # noqa: PLC0415
  from oapl_jax.sampling.processing import SamplingParams  # noqa: PLC0415

  processes = len({d.process_index for d in devices})
  split = placement.split_devices(config, len(local_devices(devices, 0)), processes)
  trainer = (sorted(devices, key=lambda d: d.id) if len(split.trainer) == len(local_devices(devices, 0))
             else [local_devices(devices, 0)[i] for i in split.trainer])
  mesh = sharding.make_mesh(config.mesh, trainer)
  model_cfg, graphdef, abstract = build.abstract_model(config)
  trainer_graphdef = graphdef if build.lora_of(config) is None else build.lora_abstract(config)[0]
  step = make_train_step(config, trainer_graphdef, make_optimizer(config.train, config.train.steps),
                         SamplingParams.from_config(config.sampling), mesh)
  b = _Build(config, devices, processes, split, mesh, graphdef, model_cfg, abstract,
             _sds(abstract, dtype=jnp.dtype(config.model.dtype)), step,
             {i.name: i.nbytes for i in plan.items}, keep_hlo, only)
  return _trainer_programs(b) + _engine_programs(b)


def _trainer_programs(b: _Build) -> list[Program]:
  """The train step (arguments as the run holds them) and, offline, the rescoring kernel."""
  from oapl_jax.rl.step import Batch, uses_reference  # noqa: PLC0415
  config, tr, items, out = b.config, b.config.train, b.items, []
  params, base, snapshot = _sds(b.abstract), None, b.snapshot
  if b.step.lora is not None:  # pi_theta, pi_old and the reference: the adapters, over the frozen base
    from oapl_jax.models import build  # noqa: PLC0415
    base = _sds(b.abstract, b.step.base_shardings, jnp.dtype(config.model.dtype))
    if b.step.base_quant != "none":  # the step's frozen base as the run holds it: int8 + scales
      from oapl_jax.models import quant  # noqa: PLC0415
      base = _sds(quant.abstract(base, b.step.base_quant), b.step.frozen_shardings)
    adapters = build.lora_abstract(config)[1]
    params = _sds(adapters, b.step.param_shardings)
    snapshot = _sds(adapters, b.step.param_shardings, jnp.dtype(config.model.dtype))
  rows, t = config.rl.groups_per_step * config.rl.group_size, seq_len(config)
  if tr.packing:
    batch = _packed_batch(config, rows, t, b.processes)
  else:
    micro = (tr.grad_accum, rows // tr.grad_accum)
    batch = Batch(tokens=jax.ShapeDtypeStruct((*micro, t), jnp.int32),
                  mask=jax.ShapeDtypeStruct((*micro, t - 1), jnp.float32),
                  sampler_logprobs=jax.ShapeDtypeStruct((*micro, t - 1), jnp.float32),
                  rewards=jax.ShapeDtypeStruct(micro, jnp.float32))
  reference = params if uses_reference(config) else None
  opt_state = jax.eval_shape(b.step.optimizer.init, params)
  # pi_old is an argument only where the loss scores it (`losses.needs`): jit drops an argument
  # the program does not read, and the run keeps pi_old all the same (`compiled_peak` adds it)
  state_names = ("master weights", "optimizer state", "reference policy", "train batch", "frozen base",
                 *(("trainer snapshot",) if losses.needs(config).snapshot else ()))
  if b.wanted("train step"):
    with jax.set_mesh(b.mesh):
      lowered = b.step.jitted.lower(params, opt_state, snapshot, batch, reference, base)
    out.append(b.compile("train step", "trainer", lowered, sum(items.get(n, 0) for n in state_names),
                         sum(items[n] for n in ("gradients", "activations", "log-prob kernel"))))
  if config.rl.mode == "offline" and b.wanted("offline log-probs"):
    from oapl_jax.rl.offline import logprob_kernel  # noqa: PLC0415
    kernel = logprob_kernel(config, b.graphdef)
    with jax.set_mesh(b.mesh):
      lowered = kernel.lower(_sds(b.abstract, b.step.param_shardings),
                             jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=b.step.replicated))
    out.append(b.compile("offline log-probs", "trainer", lowered, items["master weights"], None))
  return out


def _packed_batch(config, answers: int, t: int, processes: int):
  """The abstract `PackedBatch` of a packed step (`rl.step.packing_shape` over `processes`): K
  micro-batches of R rows of S tokens, the B answers' map and loss inputs."""
  from oapl_jax.rl.step import PackedBatch, packing_shape  # noqa: PLC0415
  k, r, s = packing_shape(config, processes)
  sds = jax.ShapeDtypeStruct
  rows, by_answer = (sds((k, r, s), jnp.int32),) * 3, (sds((k, answers), jnp.int32),) * 2
  return PackedBatch(*rows, *by_answer, sds((k, answers), jnp.float32), sds((k,), jnp.bool_),
                     sds((answers, t - 1), jnp.float32), sds((answers, t - 1), jnp.float32),
                     sds((answers,), jnp.float32))


def _engine_programs(b: _Build) -> list[Program]:
  """One replica's programs (every replica runs the same ones): the refresh into its layout,
  prefill, the decode loop at every cache capacity and one decode step."""
  from oapl_jax.sampling.layout import (EngineParams, engine_mesh, in_device_order,  # noqa: PLC0415
                                        staging_mesh)
  from oapl_jax.sampling.processing import SamplingParams  # noqa: PLC0415
  from oapl_jax.sampling.sampler import make_engine  # noqa: PLC0415
  config, s, items, out = b.config, b.config.sampling, b.items, []
  groups = [[local_devices(b.devices, p)[i] for i in b.split.engines[r * s.tensor:(r + 1) * s.tensor]]
            for p in range(b.processes) for r in range(len(b.split.engines) // s.tensor)]
  engine = make_engine(config, b.model_cfg, b.graphdef, SamplingParams.from_config(s), engine_mesh(groups[0]))
  layout = engine.layout
  shapes = jax.eval_shape(layout.relayout, b.snapshot)  # (rest, decode)
  rep = NamedSharding(engine.mesh, PartitionSpec())

  # the refresh: pi_old from the trainer's shardings to the staging layout of every replica
  source = list(b.mesh.devices.flat)  # `load_weights`: pi_old's devices in its mesh's order
  stage = staging_mesh(source, [engine_mesh(g) for g in groups], s.tensor,
                       in_source_order=b.processes > 1)
  order = list(stage.devices.flat)  # where it differs, pi_old is first moved to this order (on device)
  weights = b.step.param_shardings if b.step.lora is None else b.step.base_shardings  # model.lora: merged
  source_shardings = weights if order == source else in_device_order(weights, order)
  if b.wanted("refresh"):
    relayout = layout.jitted_relayout(stage, layout.shardings(b.snapshot, stage), b.snapshot)  # the run's program
    lowered = relayout.lower(_sds(b.snapshot, source_shardings))
    out.append(b.compile("refresh", "trainer", lowered, items["trainer snapshot"], plan_lib.refresh_bytes(config)))

  rest_s, decode_s = layout.shardings(b.snapshot, engine.mesh)
  weights = EngineParams(_sds(shapes[0], rest_s), jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                         _sds(shapes[1], decode_s))
  snap_bytes = items["engine snapshot"]
  embed = None
  if b.model_cfg.tie_embeddings and b.wanted("prefill"):
    head = weights.decode["head"]
    embed_compiled = engine._embedding.lower(head).compile()  # noqa: SLF001
    embed = jax.ShapeDtypeStruct(head.shape[::-1], head.dtype, sharding=embed_compiled.output_shardings)
  p = s.max_prefill_batch
  if b.wanted("prefill"):
    lowered = engine._prefill.lower(  # noqa: SLF001
        weights, embed, jax.ShapeDtypeStruct((p, s.max_prompt_len), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((p,), jnp.int32, sharding=rep))
    out.append(b.compile("prefill", "engine", lowered, snap_bytes, items["engine prefill"]))

  caps, where, t = capacities(config), plan_lib.topology_of(config), seq_len(config)
  stop = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  for capacity in caps:
    state = jax.eval_shape(lambda c=capacity: engine.init_decode_state(capacity=c))
    state = _sds(state, engine._state_sharding)  # noqa: SLF001
    cache = plan_lib.kv_cache_bytes(config) * capacity // t
    if b.wanted(f"decode @ {capacity}"):
      lowered = engine._generate_steps.lower(weights, state, stop)  # noqa: SLF001
      out.append(b.compile(f"decode @ {capacity}", "engine", lowered, snap_bytes + cache,
                           items["engine sampling"] + plan_lib.loop_copy_bytes(config, where, capacity)))
  if b.wanted("decode step"):
    lowered = engine._generate.lower(weights, state)  # noqa: SLF001  (the largest capacity's)
    out.append(b.compile("decode step", "engine", lowered, snap_bytes + plan_lib.kv_cache_bytes(config),
                         plan_lib.sampler_bytes(config, where, loop=False)))
  return out


# --- the report ---------------------------------------------------------------------------


def compiled_peak(progs: list[Program], plan: plan_lib.Plan, scores_snapshot: bool = True) -> int:
  """The run's peak bytes per device from the compiled programs, as the plan places trainer
  and engines (`Plan.counted`): with shared devices (sync) the engines' weights and KV cache
  (the largest decode program's arguments) stay while the train step runs, and the trainer's
  state (the train step's arguments, and pi_old where the loss does not score it: the run keeps
  it, the refresh's argument) while the engines prefill, decode or are refreshed; in async mode
  training and sampling run at once; on devices of their own the fuller side. scores_snapshot:
  the loss scores pi_old (`losses.needs`), so the train step's arguments hold it."""
  by = {p.name: p for p in progs}
  train, refresh = by["train step"], by["refresh"]
  engine = [p for p in progs if p.where == "engine"]
  engine_state = max(p.argument for p in engine if p.name.startswith("decode @"))
  engine_peak = max(p.total for p in engine)
  kept = 0 if scores_snapshot else refresh.argument  # pi_old, not the step's argument
  trainer_state = train.argument + kept
  trainer_side = max(train.total + kept, trainer_state + refresh.output + refresh.temp,
                     *(p.total + kept for p in progs if p.name == "offline log-probs"))
  if not plan.shared:
    return max(trainer_side, engine_peak)
  if plan.concurrent:
    return trainer_side + engine_peak
  return max(trainer_side + engine_state, trainer_state + engine_peak)


def model_flops(config, tokens: float | None = None, pairs: float | None = None) -> dict[str, float]:
  """Matmul FLOPs of one train step over all devices (2 per multiply-add), analytic, from the
  architecture: per token the projections (q, k, v, o, gate, up, down) of every layer and the LM
  head (the embedding lookup is a gather: no FLOPs; biases and norms are not matmuls), plus
  causal attention's scores and values (4 L N D T^2 / 2 per row). "useful" is the forward and
  backward passes of pi_theta: forward 2 x weights per token; backward the activations'
  gradients (2 x weights) and the trained weights' gradients (2 x trained weights), attention
  twice its forward. Full training: 3 x the forward. Under model.lora the base is frozen: its
  activation gradients but no weight gradients; the adapters (r x (in + out) weights per adapted
  projection, separate matmuls) forward, activation and weight gradients. "hardware" adds what
  the step also computes: a second forward under train.remat "full" or "dots" (counted whole: an
  upper bound for "dots"), and the frozen forward passes of the snapshot and the reference
  where the loss scores them. XLA's cost analysis counts a loop's body once (micro-batches,
  log-prob tiles, attention blocks), so it cannot give these.

  tokens, pairs: the positions the step computes and the (query, key) pairs attention computes
  (`packing_flops`); None: the padded step's, rows x (T-1) and rows x (T-1)^2 / 2."""
  from oapl_jax.rl import losses  # noqa: PLC0415
  m = config.model
  rows, t = config.rl.groups_per_step * config.rl.group_size, seq_len(config) - 1
  e, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  shapes = {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
            "gate_proj": (e, m.mlp_dim), "up_proj": (e, m.mlp_dim), "down_proj": (m.mlp_dim, e)}
  base = m.num_layers * sum(i * o for i, o in shapes.values()) + e * m.vocab_size  # + the LM head
  lora = m.get("lora")
  rank = lora.rank if lora is not None else 0
  adapters = rank * m.num_layers * sum(i + o for name, (i, o) in shapes.items() if name in lora.targets) \
      if rank else 0
  trained = adapters if rank else base
  if tokens is None:  # the padded step: every row T positions, causal attention over all of them
    tokens, pairs = rows * t, rows * t * t / 2
  attention = 4 * m.num_layers * m.num_heads * m.head_dim * pairs
  forward = 2 * (base + adapters) * tokens + attention
  backward = 2 * (base + adapters) * tokens + 2 * trained * tokens + 2 * attention
  needs = losses.needs(config)
  extra = (config.train.remat != "none") + needs.snapshot + needs.reference
  return {"useful": forward + backward, "hardware": forward + backward + extra * forward}


# The length distribution `--dry_run=compile` states the packed step's cost for: answers spread
# evenly over 1..sampling.max_new_tokens (a long-tailed reasoning run is shorter still), each
# with a prompt of half of sampling.max_prompt_len; one step's answers, drawn with this seed.
PACKING_SEED = 0


def stated_lengths(config) -> np.ndarray:
  """`[B]` prompt + answer tokens of one step's answers under the stated distribution."""
  s = config.sampling
  rng = np.random.default_rng(PACKING_SEED)
  answers = rng.integers(1, s.max_new_tokens + 1, config.rl.groups_per_step * config.rl.group_size)
  return answers + s.max_prompt_len // 2


def packing_flops(config, lengths: np.ndarray, processes: int = 1) -> dict[str, dict]:
  """The padded and the packed step's cost on one step of answers of `lengths` (prompt +
  answer tokens, in groups of rl.group_size): micro-batches run, rows x tokens each, and
  `model_flops` of what they compute. Padded: train.grad_accum micro-batches of B / accum rows
  of T, attention over every row's causal triangle. Packed (`rl.step.packing_shape`, whether
  or not train.packing is on): each of `processes` packs its groups (p, p + processes, ...)
  first-fit decreasing into its R / processes rows of each micro-batch; a step runs the
  micro-batches any process fills, every position of their rows computed, attention over each
  segment's causal triangle and each row's trailing padding (blocks outside a segment skipped;
  the kernel's block granularity adds up to a block per segment, not counted)."""
  from oapl_jax.rl import packing  # noqa: PLC0415
  from oapl_jax.rl.step import packing_shape  # noqa: PLC0415
  rows, t, g = len(lengths), seq_len(config) - 1, config.rl.group_size
  packed = config.copy_and_resolve_references()
  packed.train.packing = True
  k_max, r, s = packing_shape(packed, processes)
  mine = r // processes  # packed rows of a micro-batch per process
  groups = np.arange(rows).reshape(-1, g)  # [groups, G] answer indices
  fills = []  # [k_max * mine] tokens per packed row, per process
  for p in range(processes):
    share = lengths[groups[p::processes].ravel()]
    row, _ = packing.first_fit_decreasing(share, s, k_max * mine)
    fills.append(np.bincount(row[row >= 0], weights=share[row >= 0], minlength=k_max * mine))
  k = max(int(-(-(np.flatnonzero(f).max() + 1) // mine)) for f in fills)
  padding = np.concatenate([s - f[:k * mine] for f in fills])  # each run row's trailing padding
  pairs = float((lengths.astype(np.float64) ** 2).sum() / 2 + (padding ** 2).sum() / 2)
  accum = config.train.grad_accum
  return {"padded": {"micro_batches": accum, "rows": rows // accum, "tokens": t,
                     "flops": model_flops(config)},
          "packed": {"micro_batches": k, "of": k_max, "rows": r, "tokens": s - 1,
                     "flops": model_flops(config, tokens=k * r * (s - 1), pairs=pairs)},
          "real_tokens": int(lengths.sum())}


@dataclasses.dataclass
class Report:
  """The compiled programs of a run, its plan, and the chip (None: not a known TPU)."""

  topology: str
  devices: int
  plan: plan_lib.Plan
  programs: list[Program]
  chip: tuple[str, float, float] | None  # (name, peak bf16 FLOP/s, HBM bytes/s) per device
  flops: dict[str, float]
  plan_config: object  # the config the plan was made for
  processes: int = 1  # the hosts of the topology (each packs its own answers under train.packing)

  @property
  def peak(self) -> int:
    if self.plan.sampler_job:  # engines only: the largest engine program
      return max(p.total for p in self.programs if p.where == "engine")
    return compiled_peak(self.programs, self.plan, losses.needs(self.plan_config).snapshot)

  @property
  def fits(self) -> bool:
    return self.plan.device_bytes is None or self.peak <= self.plan.device_bytes

  def check(self) -> None:
    """PlanError (one line) if the compiled run does not fit its devices' memory, or if a
    program's arguments + temp fall outside the plan's band (the plan would then be wrong about
    the run: `Program.outside_band`)."""
    off = [why for why in (p.outside_band() for p in self.programs) if why]
    if off:
      raise plan_lib.PlanError(f"compiled for {self.topology}, {off[0]}" + (
          f" (and {len(off) - 1} more program(s))" if len(off) > 1 else ""))
    if not self.fits:
      worst = max(self.programs, key=lambda p: p.total)
      raise plan_lib.PlanError(
          f"compiled for {self.topology}, the run needs {self.peak / GiB:.2f} GiB per device but "
          f"a device has {self.plan.device_bytes / GiB:.2f} GiB; the largest program is the "
          f"{worst.name} ({worst.total / GiB:.2f} GiB: arguments {worst.argument / GiB:.2f}, "
          f"temp {worst.temp / GiB:.2f}); `--dry_run` (the plan) names the settings to change")

  def roofline(self) -> list[str]:
    """Lower bounds on the train step's time and the decode step's, and what they imply."""
    if self.chip is None:
      return ["roofline: this backend's peak FLOP/s and bandwidth are not known (TPU topologies only)"]
    name, flops_s, bw = self.chip
    c, s = self.plan_config, self.plan_config.sampling
    step_s = self.flops["hardware"] / (self.devices * flops_s)
    mfu = self.flops["useful"] / (self.devices * flops_s * step_s)
    tokens = c.rl.groups_per_step * c.rl.group_size * (seq_len(c) - 1)
    items = {i.name: i.nbytes for i in self.plan.items}
    slots = placement.engine_slots(c)
    read = items["engine snapshot"] + items["KV cache"]  # per device, a full cache read each step
    half = items["engine snapshot"] + items["KV cache"] / 2
    decode = next(p for p in self.programs if p.name == "decode step")
    per_chip = lambda b: slots / (b / bw) / s.tensor  # noqa: E731
    lines = [
        f"roofline on {name} ({flops_s / 1e12:.0f} TFLOP/s bf16, {bw / 1e9:.0f} GB/s HBM per device):",
        f"  train step: {self.flops['hardware'] / 1e15:.2f} PFLOP over {self.devices} devices "
        f"(analytic matmuls; useful {self.flops['useful'] / 1e15:.2f}) -> >= {step_s:.2f} s per step, "
        f"MFU <= {mfu:.2f}, <= {tokens / step_s / self.devices:,.0f} trained tokens/s per device",
        f"  decode: one step reads {read / GiB:.2f} GiB per device (weights + full KV cache) -> "
        f"<= {per_chip(read):,.0f} tokens/s per device ({slots} slots, tensor {s.tensor}); "
        f"with the cache half full <= {per_chip(half):,.0f}; XLA's cost analysis of the step: "
        f"{decode.bytes_accessed / GiB:.2f} GiB accessed, {decode.flops / 1e9:.1f} GFLOP "
        "(loop bodies counted once)",
    ]
    if self.plan.sampler_job:
      return [lines[0], lines[2]]
    return lines + self.packing_lines(flops_s)

  def packing_lines(self, flops_s: float) -> list[str]:
    """The padded and the packed train step side by side on the stated lengths
    (`packing_flops`): micro-batches, FLOPs and the roofline time of each; the compiled train
    step's FLOPs from XLA's cost analysis (its loop bodies, a micro-batch among them, once)."""
    c = self.plan_config
    cost = packing_flops(c, stated_lengths(c), self.processes)
    s = c.sampling
    out = [f"  packed vs padded train step, one step of answers spread evenly over 1..{s.max_new_tokens} "
           f"tokens with {s.max_prompt_len // 2}-token prompts ({cost['real_tokens']:,} real tokens; "
           f"train.packing={c.train.packing}):"]
    for name, x in (("padded", cost["padded"]), ("packed", cost["packed"])):
      of = f" of {x['of']}" if "of" in x else ""
      hw = x["flops"]["hardware"]
      out.append(f"    {name}: {x['micro_batches']}{of} micro-batch(es) of {x['rows']} x {x['tokens']} "
                 f"positions, {hw / 1e15:.2f} PFLOP ({hw / x['micro_batches'] / 1e15:.3f} per micro-batch)"
                 f" -> >= {hw / (self.devices * flops_s):.2f} s")
    ratio = cost["padded"]["flops"]["hardware"] / cost["packed"]["flops"]["hardware"]
    step = next((p for p in self.programs if p.name == "train step"), None)
    out.append(f"    packed / padded: {ratio:.2f}x fewer FLOPs" + (
        f"; the compiled train step: {step.flops * self.devices / 1e12:.1f} TFLOP by XLA's cost "
        "analysis (each loop body counted once: micro-batches, layers, attention blocks, log-prob "
        "tiles; not comparable with the analytic figures)" if step is not None else ""))
    return out

  def format(self) -> str:
    """The programs' table (GiB per device), the compiled peak against the device and the
    plan's total, and the roofline."""
    unit, scale = ("GiB", GiB) if self.peak >= GiB / 4 else ("MiB", 2**20)
    gib = lambda n: "-" if n is None else f"{n / scale:.2f}"  # noqa: E731
    lines = [f"compiled for {self.topology} ({self.devices} devices): {unit} per device, XLA's "
             "memory_analysis() [the plan's]",
             f"{'program':<16} {'args':>14} {'out':>6} {'alias':>6} {'temp':>14} {'total':>7} "
             f"{'compile s':>9}"]
    for p in self.programs:
      lines.append(f"{p.name:<16} {gib(p.argument):>6} [{gib(p.planned_argument):>5}] "
                   f"{gib(p.output):>6} {gib(p.alias):>6} {gib(p.temp):>6} [{gib(p.planned_temp):>5}] "
                   f"{gib(p.total):>7} {p.seconds:>9.1f}")
    device = self.plan.device_bytes
    pallas = ", ".join(f"{p.name} {p.pallas_calls}" for p in self.programs if p.pallas_calls)
    lines.append(f"Pallas kernels per program: {pallas or 'none'}")
    off = sum(p.outside_band() is not None for p in self.programs)
    lines.append(f"every program within the plan's band (+-{PLAN_BAND:.0%} + {PLAN_FLOOR / 2**20:.0f} MiB)"
                 if not off else f"{off} program(s) OUTSIDE the plan's band (+-{PLAN_BAND:.0%} + "
                 f"{PLAN_FLOOR / 2**20:.0f} MiB)")
    lines.append(f"peak per device: compiled {gib(self.peak)} {unit}, planned {gib(self.plan.total)} "
                 f"{unit} (ratio {self.peak / self.plan.total:.2f}), device "
                 f"{gib(device) + ' ' + unit if device else 'unknown'}: "
                 f"{'fits' if self.fits else 'DOES NOT FIT'}")
    return "\n".join(lines + self.roofline())


def compile_run(config, keep_hlo: bool = False, only: tuple[str, ...] | None = None,
                sampler_job: bool = False) -> Report:
  """Compiles every program of a validated `config` for `config.mesh.topology` (a TPU slice,
  through libtpu) or this machine's devices; nothing is allocated or read. only: some programs
  (`programs`; the report's peak and format need the train step and the refresh).
  sampler_job: a remote sampler job's programs only (prefill and decode; `plan.make_sampler_plan`)."""
  if sampler_job:
    config, only = plan_lib.sampler_config(config), ("prefill", "decode")
  plan = plan_lib.make_sampler_plan(config) if sampler_job else plan_lib.make_plan(config)
  name = config.mesh.topology
  if name in (None, LOCAL):
    devices, chip = jax.devices(), None
  else:
    t = TOPOLOGIES[name]
    devices = tpu_devices(t)
    chip = CHIPS.get(name.split("-")[0])
  # The default device is one compiled for: Pallas' TPU lowering reads the chip from it.
  with jax.default_device(devices[0]):
    progs = programs(_for_platform(config, devices[0].platform), devices, plan, keep_hlo, only)
  return Report(plan.topology, len(devices), plan, progs, chip, model_flops(config), config,
                len({d.process_index for d in devices}))


def dry_run(config, mode: str, sampler_job: bool = False) -> None:
  """`--dry_run` of the commands: prints the plan (a sampler job's: `plan.make_sampler_plan`)
  and with mode "compile" the compiled programs; PlanError (one line) if they do not fit."""
  plan = plan_lib.make_sampler_plan(config) if sampler_job else plan_lib.make_plan(config)
  print(plan.format(), flush=True)
  if not plan.fits:
    raise plan_lib.PlanError(plan.advice())
  if mode == "compile":
    report = compile_run(config, sampler_job=sampler_job)
    print(report.format(), flush=True)
    report.check()


def _for_platform(config, platform: str):
  """config as the run on `platform` builds its programs: `model.attention_kernel` "auto"
  resolves by the devices' platform, and this host's is not the one compiled for."""
  if platform != "tpu" or config.model.get("attention_kernel") != "auto":
    return config
  config = config.copy_and_resolve_references()
  config.model.attention_kernel = "pallas"
  return config
