"""The train step: AdamW and one jitted optimizer step on the configured loss (`rl.loss`).

The step scores a batch with the trainer's log-prob kernel (`logprobs.token_logprobs`, under
the engine's sampling settings), computes the loss (`losses.LOSS_SPECS`), accumulates gradients
over micro-batches of whole groups, and applies the update unless it is not finite.

Layout on the trainer's mesh (`sharding.make_mesh`: axes data x fsdp x tensor):
* pi_theta (master weights, `model.param_dtype`), its AdamW state (mu, nu like the params;
  the step count replicated), the snapshot pi_old (a `model.dtype` copy: the engines'
  weights) and the GRPO reference are sharded by the rules (`config.sharding.rules`);
* a batch of B rows (whole groups of G) is laid out as `[accum, B / accum, ...]`: micro-batch j
  is the j-th contiguous block of whole groups (as a plain reshape), and its rows are split
  over the "batch" rule's mesh axes (data x fsdp), so every micro-batch spans every batch
  shard. The rows of one micro-batch must divide over those shards (a ConfigError otherwise).
Under `model.lora` pi_theta, its AdamW state, pi_old and the reference are the low-rank adapters
(`models/lora.py`) and the frozen base is the step's last argument, in the weights' shardings
(never donated or differentiated). The jitted step has in/out shardings for all of these,
donates pi_theta and the optimizer state, and runs under `jax.set_mesh(mesh)`. On one device the mesh is trivial and the
numbers are the unsharded ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oapl_jax import distributed, placement
from oapl_jax import sharding as sharding_lib
from oapl_jax.errors import ConfigError
from oapl_jax.models import build
from oapl_jax.models import lora as lora_lib
from oapl_jax.models import quant
from oapl_jax.models.names import compiler_options
from oapl_jax.rl import losses, packing
from oapl_jax.rl.buffer import Rows
from oapl_jax.rl.logprobs import token_logprobs
from oapl_jax.sampling.processing import SamplingParams


@struct.dataclass
class Batch:
  """One trainer step's device batch: B answers, whole groups of G contiguous rows."""

  tokens: jax.Array  # [B, T] int32: prompt + answer + padding
  mask: jax.Array  # [B, T-1] float32: 1 on answer targets that count in the loss
  sampler_logprobs: jax.Array  # [B, T-1] float32: the engine's log-probs of the targets
  rewards: jax.Array  # [B] float32

  @classmethod
  def from_rows(cls, rows: Rows) -> "Batch":
    return cls(tokens=rows.tokens, mask=rows.mask, sampler_logprobs=rows.sampler_logprobs,
               rewards=rows.rewards)


@struct.dataclass
class PackedBatch:
  """One trainer step's batch as packed rows (`train.packing`, `rl/packing.py`): K
  micro-batches of R rows of S tokens, the B answers' loss inputs in the padded layout."""

  tokens: jax.Array  # [K, R, S] int32: segments (prompt + answer) back to back
  positions: jax.Array  # [K, R, S] int32: restarting at 0 in each segment
  segment_ids: jax.Array  # [K, R, S] int32: 1.. along a row (never decreasing; padding: the last + 1)
  answer_row: jax.Array  # [K, B] int32: the row of micro-batch k that holds answer i
  answer_start: jax.Array  # [K, B] int32: where answer i's segment starts in it
  member: jax.Array  # [K, B] float32: 1 where micro-batch k holds answer i
  active: jax.Array  # [K] bool: micro-batches that hold answers (the rest are skipped)
  mask: jax.Array  # [B, T-1] float32: the padded layout's (Batch.mask)
  sampler_logprobs: jax.Array  # [B, T-1] float32
  rewards: jax.Array  # [B] float32

  @classmethod
  def from_rows(cls, rows: Rows, packed: packing.Packed) -> "PackedBatch":
    return cls(tokens=packed.tokens, positions=packed.positions, segment_ids=packed.segment_ids,
               answer_row=packed.answer_row, answer_start=packed.answer_start,
               member=packed.member, active=packed.active, mask=rows.mask,
               sampler_logprobs=rows.sampler_logprobs, rewards=rows.rewards)


@struct.dataclass
class _PackedMicro:
  """One packed micro-batch as `_micro_loss_fn` reads it: R rows of S tokens, and the step's
  B answers' loss inputs, `mask` zero outside the answers this micro-batch holds."""

  tokens: jax.Array  # [R, S]
  positions: jax.Array  # [R, S]
  segment_ids: jax.Array  # [R, S]
  answer_row: jax.Array  # [B]
  answer_start: jax.Array  # [B]
  mask: jax.Array  # [B, T-1]
  sampler_logprobs: jax.Array  # [B, T-1]
  rewards: jax.Array  # [B]


def unpack(x: jax.Array, answer_row: jax.Array, answer_start: jax.Array, length: int) -> jax.Array:
  """Per-token values of packed rows `x` `[R, S-1]` (target t of a row: its token t+1) in the
  padded layout `[B, length]`: answer i's target t is the packed target `answer_start[i] + t`
  of row `answer_row[i]`. Past a row's end the index is clamped: those entries lie outside
  every answer's mask (as do entries of answers the micro-batch does not hold)."""
  cols = jnp.minimum(answer_start[:, None] + jnp.arange(length), x.shape[1] - 1)  # [B, length]
  return x[answer_row[:, None], cols]  # [B, length]


def make_optimizer(train, total_steps: int) -> optax.GradientTransformation:
  """AdamW with grad-norm clipping and a cosine schedule with linear warm-up (`train`: config.train)."""
  warm = int(round(train.warmup_ratio * total_steps))
  if warm == 0:
    schedule = optax.cosine_decay_schedule(train.lr, total_steps, alpha=train.min_lr_ratio)
  else:  # linear from lr/(warm+1) (the first step is never a zero-lr step), then cosine
    schedule = optax.warmup_cosine_decay_schedule(
        train.lr / (warm + 1), train.lr, warm, max(total_steps, warm + 1), train.lr * train.min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip),
      optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay))


def uses_reference(config) -> bool:
  """Whether the run keeps a frozen reference policy: the configured loss's spec needs its
  log-probs (`losses.needs`; GRPO with `rl.grpo.kl_coef > 0`)."""
  return losses.needs(config).reference


def _token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of `[B, T]` x over tokens where mask > 0 (masked entries may be inf)."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(mask.sum(), 1.0)


def check_batch_divides(config, mesh: Mesh | Mapping[str, int], rows: int | None = None) -> None:
  """Refuses (ConfigError) micro-batches whose rows do not divide over the batch shards.
  mesh: the trainer's Mesh, or its axis sizes (the memory planner's topology).

  rows: the rows of a whole batch (default: rl.groups_per_step x rl.group_size); a micro-batch
  holds rows / train.grad_accum of them, split over the mesh axes of the "batch" rule.
  """
  rl, accum = config.rl, config.train.grad_accum
  rows = rl.groups_per_step * rl.group_size if rows is None else rows
  shards = sharding_lib.batch_shards(mesh, config.sharding.rules)
  if rows % accum or (rows // accum) % shards:
    axes = sharding_lib.batch_axes(config.sharding.rules)
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    sizes = ", ".join(f"mesh.{a}={shape[a]}" for a in sharding_lib.MESH_AXES)
    raise ConfigError(
        f"config.train.grad_accum={accum}: a micro-batch of {rows} rows (rl.groups_per_step="
        f"{rl.groups_per_step} x rl.group_size={rl.group_size}) / {accum} does not divide over "
        f"the {shards} batch shards (mesh axes {axes}: {sizes}); change train.grad_accum, "
        "rl.groups_per_step or the mesh")


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_params,
                        param_shardings, mesh: Mesh):
  """Shardings of `optimizer.init(params)`: every leaf of the state that mirrors a weight (its
  tree path ends with the weight's path and its shape is the weight's: AdamW's mu and nu) gets
  the weight's sharding; anything else (step counts) is replicated. Nothing allocated."""
  abstract_state = jax.eval_shape(optimizer.init, abstract_params)
  by_path = {tuple(path): (tuple(x.shape), sh) for (path, x), (_, sh) in zip(
      jax.tree_util.tree_flatten_with_path(abstract_params)[0],
      jax.tree_util.tree_flatten_with_path(param_shardings)[0])}
  replicated = NamedSharding(mesh, PartitionSpec())

  def leaf_sharding(path, x):
    for start in range(len(path)):
      found = by_path.get(tuple(path[start:]))
      if found is not None and found[0] == tuple(x.shape):
        return found[1]
    return replicated

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state)


class TrainStep:
  """The jitted train step on the trainer's mesh, and the layouts of the state it works on.

      step = make_train_step(config, graphdef, optimizer, sampling, mesh)
      opt_state = step.init_opt_state(params)          # sharded like the params
      snapshot = step.snapshot_of(params)              # pi_old: a model.dtype copy
      params, opt_state, metrics = step(params, opt_state, snapshot, batch, reference)

  `batch` is a `Batch` of B rows (host NumPy or device arrays, `[B, ...]`); the call lays it
  out as `[accum, B / accum, ...]` with the rows sharded (`place_batch`) and runs `jitted`
  under `jax.set_mesh(mesh)`.
  """

  def __init__(self, config, mesh: Mesh, fn, optimizer):
    self.config, self.mesh, self.optimizer = config, mesh, optimizer
    self.accum = config.train.grad_accum
    self.lora = build.lora_of(config)
    if self.lora is None:  # pi_theta: every weight
      _, _, abstract = build.abstract_model(config)
      self.param_shardings, self.base_shardings = build.param_shardings(config, mesh), None
    else:  # pi_theta: the adapters; the frozen base is the step's last argument
      _, abstract, _ = build.lora_abstract(config)
      self.param_shardings = sharding_lib.param_shardings(abstract, mesh, config.sharding.rules)
      self.base_shardings = build.param_shardings(config, mesh)  # plain: merged weights'
    # the frozen base as the step holds it: model.base_quant's QArrays (values, scale), or plain
    self.base_quant = config.model.get("base_quant", "none")
    self.frozen_shardings = (None if self.base_shardings is None else quant.shardings(
        self.base_shardings, self.base_quant, config.model.dtype))
    self.opt_shardings = opt_state_shardings(optimizer, abstract, self.param_shardings, mesh)
    self.replicated = NamedSharding(mesh, PartitionSpec())
    self.batch_sharding = NamedSharding(
        mesh, PartitionSpec(None, sharding_lib.batch_axes(config.sharding.rules)))  # [accum, rows, ...]
    reference = self.param_shardings if uses_reference(config) else None
    self.packing = packing_shape(config) if config.train.packing else None
    if self.packing is None:
      batch = Batch(*(self.batch_sharding,) * 4)
    else:  # [K, R, S] and [K, B]: rows / answers split; [K] replicated; [B, ...] answers split
      by_answers = NamedSharding(mesh, PartitionSpec(sharding_lib.batch_axes(config.sharding.rules)))
      batch = PackedBatch(*(self.batch_sharding,) * 6, self.replicated, *(by_answers,) * 3)
    self.packed_shardings = None if self.packing is None else batch
    self.jitted = jax.jit(
        fn, donate_argnums=(0, 1),
        in_shardings=(self.param_shardings, self.opt_shardings, self.param_shardings, batch,
                      reference, self.frozen_shardings),
        out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
        compiler_options=compiler_options(config.model.exact_rounding))
    self.dtype = jnp.dtype(config.model.dtype)
    self._snapshot = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.dtype), p),
                             out_shardings=self.param_shardings)
    self._copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)
    self._merge, self._base_of = None, {}  # model.lora: jitted on first use (`merged`, `base_of`)
    self.rows_sharding = NamedSharding(mesh, PartitionSpec(sharding_lib.batch_axes(config.sharding.rules)))
    self._orders = {}  # multi-host: rows -> jitted shuffle into the global order
    self._relayout = jax.jit(lambda b: jax.tree.map(
        lambda x: x.reshape(self.accum, x.shape[0] // self.accum, *x.shape[1:]), b),
        out_shardings=self.batch_sharding)

  def __call__(self, params, opt_state, snapshot, batch: "Batch", reference=None, base=None):
    """(params, opt_state, metrics) after one step on `batch` (params, opt_state donated).
    base: the frozen base weights when params are low-rank adapters (`model.lora`), else None."""
    if (base is None) != (self.lora is None):
      raise ValueError("the step takes the frozen base exactly when model.lora is on")
    with jax.set_mesh(self.mesh):
      return self.jitted(params, opt_state, snapshot, self.place_batch(batch), reference, base)

  def batch_of(self, rows: Rows) -> tuple["Batch | PackedBatch", dict[str, float]]:
    """(batch, layout metrics) of `rows` (whole groups, the padded layout): a `Batch`, or under
    `train.packing` a `PackedBatch` (first-fit decreasing into the compiled shape).

    Metrics: `pad_fraction` (of the token positions the step computes, the share that is
    padding: not a prompt or answer token of an answer that counts), and under packing
    `rows_filled` and `micro_batches` (those that run; the others are skipped)."""
    if self.packing is None:
      real, size = distributed.totals(int(packing.used_lengths(rows).sum()), rows.tokens.size)
      return Batch.from_rows(rows), {"pad_fraction": 1.0 - real / size}
    k, r, s = self.packing
    processes = jax.process_count()  # each packs its own answers into its r / processes rows
    packed = packing.pack(rows, rows_per_micro=r // processes, budget=s, micro_batches=k)
    if processes > 1:  # a micro-batch runs where any process filled it (one compiled cond)
      packed = dataclasses.replace(packed, active=distributed.allgather(packed.active).any(axis=0))
    real, filled = distributed.totals(packed.real_tokens, packed.rows_filled)
    ran = int(packed.active.sum())
    return PackedBatch.from_rows(rows, packed), {
        "pad_fraction": 1.0 - real / (ran * r * s), "rows_filled": filled, "micro_batches": ran}

  def cost_of(self, batch: "Batch | PackedBatch") -> dict[str, float]:
    """What a host batch makes the step compute, as `aot.model_flops` takes it: {} for the
    padded step (its fixed figures); under packing the model's input positions of the
    micro-batches that run (`tokens`) and the (query, key) pairs causal attention computes
    within their segments (`pairs`)."""
    if not isinstance(batch, PackedBatch):
      return {}
    ids = np.asarray(batch.segment_ids)[np.asarray(batch.active)][..., :-1]  # [k, R, S-1] the input
    ids = ids.reshape(-1, ids.shape[-1])
    sizes = np.concatenate([np.bincount(row) for row in ids]).astype(np.float64)  # segments' lengths
    mine = np.array([ids.size, (sizes ** 2).sum() / 2])  # this process's rows
    tokens, pairs = distributed.allgather(mine).sum(axis=0) if jax.process_count() > 1 else mine
    return {"tokens": int(tokens), "pairs": float(pairs)}

  def place_batch(self, batch: "Batch") -> "Batch":
    """`batch` `[B, ...]` as `[accum, B / accum, ...]` on the mesh, rows split over the batch
    shards: host arrays by `jax.make_array_from_callback` (each device reads its own block),
    device arrays by a jitted relayout.

    Multi-host: `batch` holds this process's rows (B / process_count of them, the same count on
    every process: its engine replicas' share of the step's groups, `loop.Run.step`). They
    become one global array (`jax.make_array_from_process_local_data`: each process's rows on
    its own devices, wherever the mesh puts them: `sharding.process_rows`), and one jitted
    shuffle puts every row where a single process with all the replicas would have it
    (`parallel.global_row_order`), so the step computes on exactly that batch."""
    processes = jax.process_count()
    if isinstance(batch, PackedBatch):
      return self._place_packed(batch)
    check_batch_divides(self.config, self.mesh, batch.tokens.shape[0] * processes)
    if processes > 1:
      rows = batch.tokens.shape[0] * processes
      flat = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
          self.rows_sharding, np.asarray(x), (rows, *np.shape(x)[1:])), batch)
      with jax.set_mesh(self.mesh):
        return self._to_global_order(rows)(flat)
    if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(batch)):
      def place(x):
        x = x.reshape(self.accum, x.shape[0] // self.accum, *x.shape[1:])
        return jax.make_array_from_callback(x.shape, self.batch_sharding, lambda index: x[index])
      return jax.tree.map(place, batch)
    with jax.set_mesh(self.mesh):
      return self._relayout(batch)

  def _place_packed(self, batch: PackedBatch) -> PackedBatch:
    """A host `PackedBatch` on the mesh, in the step's shardings.

    Multi-host: `batch` is this process's (its own answers packed into its R / processes rows
    of each micro-batch, `batch_of`; `active` agreed over processes). The rows become one
    `[K, R, S]` array (each process's on its own devices); its answers' map, with each packed
    row renamed to its global row (`sharding.process_rows`), and their loss inputs are
    assembled by answer and shuffled into the global answer order as the padded step's rows
    are (`_to_global_order`), so groups stay whole for V_hat."""
    if jax.process_count() == 1:
      return jax.tree.map(lambda x, sh: jax.make_array_from_callback(
          np.shape(x), sh, lambda index: np.asarray(x)[index]), batch, self.packed_shardings)
    k, r, s = self.packing
    mine = r // jax.process_count()  # packed rows of a micro-batch on this process
    global_row = sharding_lib.process_rows(self.rows_sharding, r)[
        jax.process_index() * mine + np.arange(mine)]  # [mine] where each local row lies
    assemble = lambda x, sh, shape: jax.make_array_from_process_local_data(  # noqa: E731
        sh, np.asarray(x), shape)
    rows = {name: assemble(getattr(batch, name), self.batch_sharding, (k, r, s))
            for name in ("tokens", "positions", "segment_ids")}
    b = len(batch.rewards) * jax.process_count()
    by_answer = dict(answer_row=global_row[batch.answer_row].T.astype(np.int32),
                     answer_start=batch.answer_start.T, member=batch.member.T, mask=batch.mask,
                     sampler_logprobs=batch.sampler_logprobs, rewards=batch.rewards)
    by_answer = {name: assemble(x, self.rows_sharding, (b, *np.shape(x)[1:]))
                 for name, x in by_answer.items()}
    active = jax.make_array_from_callback((k,), self.replicated, lambda index: batch.active[index])
    with jax.set_mesh(self.mesh):
      return self._packed_to_global_order(b)(rows, by_answer, active)

  def _packed_to_global_order(self, answers: int):
    """Jitted (multi-host packing): the assembled packed rows and per-answer arrays (`[B, ...]`
    in process order; the map `[B, K]`) -> a `PackedBatch` with the answers in the global order
    and the map `[K, B]`."""
    key = ("packed", answers)
    if key not in self._orders:
      g, n = self.config.rl.group_size, jax.process_count()
      from oapl_jax.sampling.parallel import global_row_order  # noqa: PLC0415 (imports the engine)
      wanted = global_row_order(answers // g // n, g, n, placement.local_engines(self.config, n))
      order = sharding_lib.process_rows(self.rows_sharding, answers)[wanted]

      def relayout(rows, by_answer, active):
        a = {name: x[order] for name, x in by_answer.items()}
        return PackedBatch(**rows, answer_row=a["answer_row"].T, answer_start=a["answer_start"].T,
                           member=a["member"].T, active=active, mask=a["mask"],
                           sampler_logprobs=a["sampler_logprobs"], rewards=a["rewards"])
      self._orders[key] = jax.jit(relayout, out_shardings=self.packed_shardings)
    return self._orders[key]

  def _to_global_order(self, rows: int):
    """Jitted: the processes' rows as assembled `[rows, ...]` -> the global order, as
    `[accum, rows / accum, ...]`."""
    if rows not in self._orders:
      g, n = self.config.rl.group_size, jax.process_count()
      from oapl_jax.sampling.parallel import global_row_order  # noqa: PLC0415 (imports the engine)
      wanted = global_row_order(rows // g // n, g, n, placement.local_engines(self.config, n))
      order = sharding_lib.process_rows(self.rows_sharding, rows)[wanted]  # where each one lies
      self._orders[rows] = jax.jit(lambda b: jax.tree.map(
          lambda x: x[order].reshape(self.accum, rows // self.accum, *x.shape[1:]), b),
          out_shardings=self.batch_sharding)
    return self._orders[rows]

  def init_opt_state(self, params):
    """The optimizer state of `params`, created sharded (mu, nu like the weights)."""
    with jax.set_mesh(self.mesh):
      return jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)

  def place_params(self, params):
    """`params` (any layout: host, one device, another sharding) in the trainer's shardings."""
    with jax.set_mesh(self.mesh):
      return self._copy(params)

  def snapshot_of(self, params):
    """pi_old: a copy of `params` cast to `model.dtype` (the engines' weights; with `model.lora`
    the adapters, which the engines see merged: `merged`), same shardings."""
    with jax.set_mesh(self.mesh):
      return self._snapshot(params)

  def base_of(self, params, quantize: bool = True):
    """model.lora: `params` (a model's weights, any dtype and layout; donated) as the frozen
    base, in model.dtype and the weights' shardings; quantised as model.base_quant says
    (`quant.quantize_base`) unless `quantize` is False (a base the warm-up is yet to train)."""
    mode = self.base_quant if quantize else "none"
    if mode not in self._base_of:
      self._base_of[mode] = jax.jit(
          lambda p: quant.as_frozen_base(p, mode, self.dtype),
          donate_argnums=0, out_shardings=quant.shardings(self.base_shardings, mode, self.dtype))
    with jax.set_mesh(self.mesh):
      return self._base_of[mode](params)

  def merged(self, adapters, base):
    """The weights the engines sample with under `model.lora`: base + scale * A B, merged on
    the trainer's devices in the base's shardings and dtype (`lora.merged`)."""
    if self._merge is None:
      scale = self.lora.scale
      self._merge = jax.jit(lambda b, a: lora_lib.merged(b, a, scale), out_shardings=self.base_shardings)
    with jax.set_mesh(self.mesh):
      return self._merge(base, adapters)


def packing_shape(config, processes: int | None = None) -> tuple[int, int, int]:
  """(K micro-batches, R rows each, S tokens per row) of a packed step (`train.packing`): R =
  `train.pack_rows` (0: a padded micro-batch's rows), S = `train.pack_budget` (0: seq_len),
  K enough for the worst case (`packing.max_micro_batches`). Over `processes` (default
  `jax.process_count()`) each process packs its own B / processes answers into R / processes
  rows of each micro-batch, so K is one process's worst case (the same on every process).
  A ConfigError if R does not split evenly over the processes."""
  processes = jax.process_count() if processes is None else processes
  rows = config.rl.groups_per_step * config.rl.group_size  # B: the step's answers, all processes
  t = placement.seq_len(config)
  r = config.train.pack_rows or rows // config.train.grad_accum
  s = config.train.pack_budget or t
  if r % processes:
    raise ConfigError(f"train.pack_rows: {r} packed rows per micro-batch do not split over "
                      f"{processes} processes (each packs its own answers into its share of "
                      "the rows); use a multiple of the process count")
  return packing.max_micro_batches(rows // processes, t, rows=r // processes, budget=s), r, s


def make_train_step(config, graphdef, optimizer, sampling: SamplingParams,
                    mesh: Mesh | None = None) -> TrainStep:
  """The `TrainStep` (params, opt_state, snapshot, batch, reference) -> (params, opt_state,
  metrics) on `mesh` (default: a one-device mesh on the first device).

  batch: a `Batch` of whole groups. sampling: the engine's settings (the log-prob contract:
  the trainer scores tokens under the distribution the engine sampled from).
  `reference` is the frozen reference policy (`uses_reference`) or None.
  The step scores what the configured loss's spec declares (`losses.needs`: the snapshot, the
  reference) and calls the loss through its one signature (`losses.LossInputs`).
  Gradient accumulation splits B into `train.grad_accum` micro-batches of whole groups; the
  loss is the full-batch one: every micro-batch divides by the full batch's count / accum
  (OAPL: of counted answers, so truncated answers left out by `rl.count_truncated=False` are
  out of the mean; GRPO token-mean: of tokens).
  A step whose loss or gradient norm is not finite leaves params and optimizer state unchanged
  (metric `step_skipped`). With finite gradients AdamW's update is finite too (lr, eps and the
  other settings are validated finite), so the update needs no check of its own.
  """
  if mesh is None:
    mesh = sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  check_batch_divides(config, mesh)
  rows = NamedSharding(mesh, PartitionSpec(sharding_lib.batch_axes(config.sharding.rules)))
  micro_loss = _micro_loss_fn(config, graphdef, sampling, None if mesh.size == 1 else rows)
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  accum = config.train.grad_accum
  by_rows = lambda x: jax.lax.with_sharding_constraint(x, rows)  # noqa: E731  [b, ...] rows split

  def train_step(params, opt_state, snapshot, micro, reference=None, base=None):
    """micro: the batch as `[accum, B / accum, ...]` (`TrainStep.place_batch`), or a
    `PackedBatch` (`train.packing`); base: the frozen base under `model.lora` (params,
    snapshot, reference: adapters), else None."""
    if isinstance(micro, PackedBatch):
      grads, loss, m, active = _accumulate_packed(grad_fn, by_rows, params, snapshot, reference,
                                                  base, micro)
    else:
      grads, loss, m = _accumulate(grad_fn, accum, by_rows, params, snapshot, reference, base, micro)
      active = None
    params, opt_state, grad_norm, finite = _update_if_finite(optimizer, grads, loss, params,
                                                             opt_state, active)
    return params, opt_state, _step_metrics(loss, grad_norm, finite, m, active)

  return TrainStep(config, mesh, train_step, optimizer)


def _micro_loss_fn(config, graphdef, sampling: SamplingParams, rows: NamedSharding | None):
  """`(params, snapshot, reference, base, mb, num_tokens, num_answers) -> (loss, metrics)` on one
  micro-batch `mb` (`[b, ...]`): the trainer's log-probs (gradient), the snapshot's and the
  reference's as the loss's spec declares (stop-gradient), the loss through `LossInputs`.

  Metrics: the loss's, `entropy`, `trainer_vs_sampler_abs`, and `snapshot_vs_sampler_abs` (the
  engine/trainer mismatch, docs/algorithm.md) whenever the snapshot is scored. rows: the activations'
  sharding (rows over the batch shards), None on one device.
  """
  needs, loss_fn = losses.needs(config), losses.from_config(config)
  # The log-prob kernel's settings (memory: train.logprob_tile, train.attn_block); activations
  # pinned to rows over the batch shards; train.remat where gradients are taken.
  kernel = dict(tile=config.train.logprob_tile, attn_block=config.train.attn_block, rows=rows,
                vocab_split=None if rows is None else vocab_split(config, rows.mesh))

  def model(params, base):  # base: the frozen base under model.lora, else None
    return nnx.merge(graphdef, params) if base is None else nnx.merge(graphdef, params, base)

  def score(params, base, mb, **kw):
    """(logprobs, entropy) `[b, T-1]` of the micro-batch's targets in the padded layout; a
    packed micro-batch is scored on its packed rows, then gathered back (`unpack`)."""
    if not isinstance(mb, _PackedMicro):
      return token_logprobs(model(params, base), mb.tokens, sampling, **kw, **kernel)
    lp, ent = token_logprobs(model(params, base), mb.tokens, sampling, positions=mb.positions[:, :-1],
                             segment_ids=mb.segment_ids[:, :-1], **kw, **kernel)  # [R, S-1]
    t = mb.mask.shape[1]
    return (unpack(lp, mb.answer_row, mb.answer_start, t),
            unpack(ent, mb.answer_row, mb.answer_start, t))  # [B, T-1]

  def frozen_logprobs(params, base, mb):
    return jax.lax.stop_gradient(score(params, base, mb)[0])

  def micro_loss(params, snapshot, reference, base, mb, num_tokens, num_answers):
    logp, ent = score(params, base, mb, remat=config.train.remat)  # [b, T-1]
    mask, sampler = mb.mask, mb.sampler_logprobs
    m, snap, ref = {}, None, None
    if needs.snapshot:
      snap = frozen_logprobs(snapshot, base, mb)  # [b, T-1]
      m["snapshot_vs_sampler_abs"] = _token_mean(jnp.abs(snap - sampler), mask)
    if needs.reference:
      if reference is None:
        raise ValueError(f"rl.loss={config.rl.loss!r} needs the reference policy "
                         "(uses_reference): pass `reference` to the step")
      ref = frozen_logprobs(reference, base, mb)  # [b, T-1]
    loss, loss_metrics = loss_fn(losses.LossInputs(
        logprobs=logp, sampler_logprobs=sampler, snapshot_logprobs=snap, reference_logprobs=ref,
        mask=mask, rewards=mb.rewards, num_tokens=num_tokens, num_answers=num_answers))
    m.update(loss_metrics, entropy=_token_mean(ent, mask),
             trainer_vs_sampler_abs=_token_mean(jnp.abs(logp - sampler), mask))
    # what each metric is a mean over in this micro-batch (`_step_metrics` weights by it)
    counts = {"tokens": mask.sum(), "answers": jnp.any(mask > 0, axis=-1).sum().astype(mask.dtype)}
    return loss, (m, counts)

  return micro_loss


def vocab_split(config, mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
  """(head `[E, V]`, a log-prob tile's logits `[B, tile, V]`) NamedShardings on the trainer's
  mesh, split by V as the rules split the LM head; the logits' rows over the batch axes that V
  does not use (`logprobs.tiled_logprobs`)."""
  rules = config.sharding.rules
  head = sharding_lib.logical_to_spec(("vocab_embed", "vocab"), rules)
  vocab_axes = set(sharding_lib.spec_names(head[1])) if len(head) > 1 else set()
  rows = tuple(a for a in sharding_lib.spec_names(sharding_lib.batch_axes(rules)) if a not in vocab_axes)
  logits = PartitionSpec(rows or None, None, head[1] if len(head) > 1 else None)
  return NamedSharding(mesh, head), NamedSharding(mesh, logits)


def _accumulate(grad_fn, accum: int, by_rows, params, snapshot, reference, base, micro):
  """`(grads, loss [accum], (metrics {name: [accum]}, counts {kind: [accum]}))`: the mean
  gradient over the `accum` micro-batches of `micro` (`[accum, b, ...]`), each micro-batch's
  loss dividing by its share of the full batch's counted tokens and answers."""
  num_tokens = micro.mask.sum() / accum  # per micro-batch share of the full batch's tokens
  num_answers = (micro.mask.sum(axis=-1) > 0).sum() / accum  # ... and of its counted answers

  def body(grads, mb):
    mb = jax.tree.map(by_rows, mb)  # [b, ...]: rows over the batch shards
    (loss, m), g = grad_fn(params, snapshot, reference, base, mb, num_tokens, num_answers)
    return (g if grads is None else jax.tree.map(jnp.add, grads, g)), (loss, m)

  if accum == 1:  # no accumulator: one weight-sized float32 buffer less at the peak
    grads, (loss, m) = body(None, jax.tree.map(lambda x: x[0], micro))
    loss, m = jax.tree.map(lambda x: x[None], (loss, m))  # [1] like the scan's
  else:
    grads, (loss, m) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    grads = jax.tree.map(lambda g: g / accum, grads)
  return grads, loss, m


def _accumulate_packed(grad_fn, by_rows, params, snapshot, reference, base, batch: PackedBatch):
  """`(grads, loss [K], (metrics {name: [K]}, counts {kind: [K]}), active [K])` over the K
  packed micro-batches of `batch`: the mean gradient over the active ones (the others are
  skipped by a `lax.cond`: no compute, zero loss, metrics and counts), each micro-batch's loss
  dividing by its share of the full batch's counted tokens and answers, as `_accumulate`'s."""
  k_active = jnp.maximum(batch.active.sum(), 1).astype(jnp.float32)
  num_tokens = batch.mask.sum() / k_active
  num_answers = (batch.mask.sum(axis=-1) > 0).sum() / k_active

  def micro(k):  # micro-batch k: [R, S] rows, the step's answers with mask outside it 0
    member = batch.member[k]  # [B]
    return jax.tree.map(by_rows, _PackedMicro(
        tokens=batch.tokens[k], positions=batch.positions[k], segment_ids=batch.segment_ids[k],
        answer_row=batch.answer_row[k], answer_start=batch.answer_start[k],
        mask=jnp.where(member[:, None] > 0, batch.mask, 0.0), sampler_logprobs=batch.sampler_logprobs,
        rewards=batch.rewards))

  def run(k):
    (loss, m), g = grad_fn(params, snapshot, reference, base, micro(k), num_tokens, num_answers)
    return g, (loss, m)

  count = batch.active.shape[0]
  if count == 1:  # one micro-batch, always active (`packing.pack`): no accumulator
    grads, (loss, m) = run(0)
    return grads, *jax.tree.map(lambda x: x[None], (loss, m)), batch.active

  out = jax.eval_shape(run, 0)[1]
  skipped = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out)

  def body(grads, k):
    def on(grads):
      g, out = run(k)
      return jax.tree.map(jnp.add, grads, g), out
    return jax.lax.cond(batch.active[k], on, lambda grads: (grads, skipped), grads)

  grads, (loss, m) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(count))
  return jax.tree.map(lambda g: g / k_active, grads), loss, m, batch.active


def _update_if_finite(optimizer, grads, loss, params, opt_state, active=None):
  """`(params, opt_state, grad_norm, finite)`: the optimizer's update of `params` by `grads`,
  or params and state unchanged when the loss or the gradient norm is not finite (of the
  active micro-batches' losses under packing: `active`)."""
  grad_norm = optax.global_norm(grads)
  # A step whose loss or gradient is not finite is skipped: params and optimizer state stay
  # as they were (the run counts these and stops after train.max_nonfinite_steps). A `cond`
  # rather than a select of new against old: the update then writes the donated buffers in
  # place (a select kept a copy of the old AdamW mu and nu through the whole step on XLA:CPU).
  finite = jnp.isfinite(loss if active is None else jnp.where(active, loss, 0.0)).all() \
      & jnp.isfinite(grad_norm)

  def update(state):
    params, opt_state = state
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = jax.lax.cond(finite, update, lambda state: state, (params, opt_state))
  return params, opt_state, grad_norm, finite


# What the step's own micro-batch metrics are means over (the loss's: `losses.METRIC_REDUCTION`).
STEP_METRIC_REDUCTION = {"entropy": "tokens", "trainer_vs_sampler_abs": "tokens",
                         "snapshot_vs_sampler_abs": "tokens"}


def _step_metrics(loss, grad_norm, finite, m_counts, active=None) -> dict[str, jax.Array]:
  """The step's metrics: mean loss, grad norm, `step_skipped`, and each micro-batch metric
  reduced over the micro-batches as the full batch's figure: a mean weighted by the counted
  tokens or answers it is a mean over (equal weights for "rows"), or the min / max.
  active: `[accum]` bool under packing (the skipped micro-batches count in no figure)."""
  m, counts = m_counts  # {name: [accum]}, {"tokens" | "answers": [accum]}
  kinds = {**losses.METRIC_REDUCTION, **STEP_METRIC_REDUCTION}
  on = None if active is None else active.astype(jnp.float32)  # [accum]

  def mean(v):  # [accum] -> []: over the micro-batches that ran
    return jnp.mean(v) if on is None else jnp.sum(v * on) / jnp.maximum(on.sum(), 1.0)

  def reduce(name, v):  # [accum] -> []
    kind = kinds[name]
    if kind in ("min", "max"):
      if on is not None:
        v = jnp.where(active, v, jnp.inf if kind == "min" else -jnp.inf)
      return getattr(jnp, kind)(v)
    if v.shape[0] == 1 or kind == "rows":  # one micro-batch: its own figure, bit for bit
      return mean(v)
    w = counts[kind]  # [accum]
    return jnp.sum(v * w) / jnp.maximum(w.sum(), 1.0)

  return {"loss": mean(loss), "grad_norm": grad_norm, "step_skipped": 1.0 - finite,
          **{k: reduce(k, v) for k, v in m.items()}}
