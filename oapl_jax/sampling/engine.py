"""`Engine`: our transformer behind JetStream's engine API, with continuous batching.

Decode state (a dict pytree, one row per slot `S`, cache capacity `M <= max_len`):
  cache        {"k": L x `[S, K, D, M]`, "v": L x `[S, K, M, D]`}  KV cache (`init_cache`)
  next_logits  `[S, V]` float32 logits of each slot's next token
  positions    `[S]` index the next token will occupy (= prompt + answer length so far)
  lengths      `[S]` answer tokens generated so far;  limits `[S]`: answer length budget
  live         `[S]` bool: the slot is producing an answer
  finish       `[S]` why the slot's answer ended (FINISH_*; -1 while live)
  versions     `[S]` oldest policy version of the weights that produced the answer
  recent       `[S, W]` the answer's last W tokens (stop sequences); eos `[]`, stops `[N, W]`
  answer_keys  `[S]` PRNG keys, one per answer: token t of an answer is drawn with
               `fold_in(its key, t)`, so an answer is a function of its key and the weights,
               whichever slot, decode step, width or company it is sampled in
  key          PRNG key that `insert` derives an answer's key from when none is given;
  step `[]`    decode steps taken
  forced       `[S, F]` tokens to feed a slot before it samples again (an environment's turn
               of a multi-turn trajectory, `resume`); forced_n `[S]` how many, forced_i `[S]`
               how many are in. F (the state's `insert_width`) is a shape.

A decode step samples one token per slot from the processed `next_logits` (temperature,
top-k, top-p; `processing.py`), records its log-prob under exactly that distribution, runs
the model on it (writing its keys at `positions`) and retires slots whose answer hit EOS, a
stop sequence or its length budget. A slot with forced tokens waiting takes the next one
instead of sampling (log-prob 0, never an EOS or a stop): that is how an environment's turn
enters a paused slot's KV cache after the tokens already there (`resume`), while the other
slots go on decoding in the same steps; the budget counts those tokens too. Retired slots keep computing (shapes are static) but
change nothing, and are left out of the live length that bounds attention.

API: JetStream's `prefill` / `insert` / `generate` (one step, `SampledTokens`) so that
`jetstream.core.orchestrator` can drive the engine, plus the batched calls `rollout` uses:
`prefill_batch`, `insert_many` (one prefix into many slots: groups share their prompt) and
`generate_steps` (up to `steps_per_call` steps in one jitted while-loop, which returns early
once enough slots have finished to be refilled), and `narrow` (keep some slots, drop the
rest: once no prompt waits, `rollout` halves the decode width as answers finish, so the final
drain does not compute rows nobody uses; one compile per (width, capacity)).

Decode cost follows the live length twice over: attention reads the cache in chunks only up
to the longest live answer (`attn_chunk`), and `rollout` keeps the cache itself at the
smallest capacity bucket (`cache_bucket * 2**j`, capped at `max_len`) that the live answers
need (`resize`), so a step never touches positions no answer has reached. On CPU the second
matters most: a chunk sliced out of a larger buffer is a copy. One compile per bucket.

Devices: an engine lives on a mesh `("tensor",)` of T devices (`layout.py`): weights split over
heads / MLP / vocabulary (one copy, compute dtype, `EngineParams`), the KV cache over KV heads,
everything else in the state replicated; each jitted call returns exactly these shardings.
Decode runs `decode.decode` (the model's decode step, over the fused layout), prefill the model's
own `prefill` on the plain weights sliced out of the fused ones. With T = 1 the numbers are the
single-device engine's, bit for bit.

JetStream: this module imports none of it at load time (its `engine_api` imports seqio and
TensorFlow, which sampling and training do not need). `Engine` defines every method of
JetStream's `engine_api.Engine`; `jetstream_adapter.py` holds the JetStream types that
`generate`, `get_tokenizer` and `build_tokenizer` return. Those three load it on first call, as
does building an engine once JetStream is imported, and `Engine` then registers as a JetStream
engine (`_jetstream`; see `jetstream_adapter`).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from oapl_jax.models.kv_cache import init_cache, write_prefix
from oapl_jax.models.names import compiler_options
from oapl_jax.models.transformer import ModelConfig
from oapl_jax.sampling import decode as decode_lib
from oapl_jax.sampling.layout import EngineLayout, EngineParams, engine_mesh, load_weights
from oapl_jax.sampling.processing import SamplingParams, process_logits, sample

FINISH_EOS, FINISH_LENGTH, FINISH_STOP = 0, 1, 2  # EOS token, length budget, stop sequence
_NO_TOKEN = -2  # fills `recent` before an answer has W tokens (matches no stop sequence)
_STATE_KEYS = ("next_logits", "positions", "lengths", "limits", "live", "finish", "versions",
               "recent", "answer_keys", "eos", "stops", "key", "step", "forced", "forced_n",
               "forced_i")  # the decode state but the cache


@struct.dataclass
class Steps:
  """What `generate_steps` returns: `n = num_steps` decode steps of all `S` slots.

  tokens `[T, S]` int32, log_probs `[T, S]` float32, valid `[T, S]` bool (the slot was live
  at that step; rows >= n are padding), forced `[T, S]` bool (the token was a forced one, not
  sampled). live, finish, versions, lengths: `[S]`, the slots' state after the last step.
  """

  tokens: jax.Array
  log_probs: jax.Array
  valid: jax.Array
  forced: jax.Array
  num_steps: jax.Array
  live: jax.Array
  finish: jax.Array
  versions: jax.Array
  lengths: jax.Array


# Engine arguments that are `config.sampling` settings of the same name.
CONFIG_SETTINGS = ("steps_per_call", "attn_chunk", "cache_bucket", "max_prefill_batch",
                   "min_decode_width")


def engine_settings(sampling) -> dict:
  """The `CONFIG_SETTINGS` keyword arguments of `Engine`, read from a config's `sampling`
  section: `Engine(..., **engine_settings(config.sampling))`."""
  return {name: sampling[name] for name in CONFIG_SETTINGS}


class Engine:
  """A JetStream engine over `oapl_jax.models.Transformer` (JetStream's `engine_api.Engine`
  API; registered as one once JetStream is loaded, see `_jetstream`).

  Args:
    graphdef: the model's NNX graph definition (`nnx.split(model, nnx.Param)[0]`).
    model_cfg: its `ModelConfig`.
    sampling: temperature / top-p / top-k used when sampling and for the log-probs.
    max_slots: decode slots (concurrent answers).
    max_prefill_length: longest prompt.
    max_len: KV-cache length per slot (prompt + answer); tens of thousands is fine, decode
      only reads up to the longest live answer.
    The five below are `config.sampling` settings of the same name (`engine_settings` reads
    them); the config holds their defaults, so the engine has none.
    steps_per_call: decode steps `generate_steps` may run in one jitted call.
    attn_chunk: decode attention reads the cache in chunks of this many positions.
    cache_bucket: smallest cache capacity `rollout` uses; capacities are it times powers of 2.
    min_decode_width: `rollout` narrows the decode state (halving its width) during the final
      drain, but not below this many slots; >= max_slots turns narrowing off.
    max_prefill_batch: prompts `prefill_batch` takes at once (batches padded to powers of 2).
    mesh: the engine's devices, a mesh with one axis "tensor" (`layout.engine_mesh`; default:
      the default device). Weights, KV cache and decode state live there (`layout.py`).
    rules: the config's `sharding.rules` (fsdp/data axes dropped for the engine); None = every
      weight and the KV cache replicated over the mesh.
    tokenizer: one of our tokenizers, needed only under JetStream's orchestrator
      (`build_tokenizer`); the engine itself works on token ids.
  """

  def __init__(self, graphdef, model_cfg: ModelConfig, sampling: SamplingParams, *,
               max_slots: int, max_prefill_length: int, max_len: int, steps_per_call: int,
               attn_chunk: int, cache_bucket: int, max_prefill_batch: int, min_decode_width: int,
               mesh: jax.sharding.Mesh | None = None, rules=None, tokenizer=None,
               exact_rounding: bool = True):
    if max_prefill_length >= max_len:
      raise ValueError(f"max_prefill_length={max_prefill_length} must be < max_len={max_len}")
    if "jetstream.engine.engine_api" in sys.modules:  # JetStream is loaded: be one of its engines
      _jetstream()
    self._graphdef = graphdef
    self.model_cfg = model_cfg
    self.sampling = sampling
    self._max_slots = max_slots
    self._max_prefill_length = max_prefill_length
    self.max_len = max_len
    self.steps_per_call = steps_per_call
    self.attn_chunk = attn_chunk
    self.cache_bucket = cache_bucket
    self.max_prefill_batch = max_prefill_batch
    self.min_decode_width = min_decode_width
    self._tokenizer = tokenizer
    self._mesh = mesh or engine_mesh([jax.config.jax_default_device or jax.devices()[0]])
    self.layout = EngineLayout(model_cfg, self._mesh.size, rules)
    # Placement (layout.py): the KV cache split over KV heads, everything else replicated over
    # the mesh; every jitted call returns exactly these shardings (so none compiles twice).
    rep = self._replicated = NamedSharding(self._mesh, PartitionSpec())
    k_spec, v_spec = self.layout.cache_specs()
    layers = model_cfg.num_layers
    cache = {"k": [NamedSharding(self._mesh, k_spec)] * layers,
             "v": [NamedSharding(self._mesh, v_spec)] * layers}
    state = self._state_sharding = {"cache": cache, **dict.fromkeys(_STATE_KEYS, rep)}
    self._logit_sharding = NamedSharding(  # [S, V], as the head [E, V] is split
        self._mesh, PartitionSpec(None, self.layout._spec("vocab_embed", "vocab")[1]))  # noqa: SLF001
    kv = NamedSharding(self._mesh, PartitionSpec(None, None, k_spec[1], None))  # [B, T, K, D]
    prefix = {"kvs": [(kv, kv)] * layers, "logits": rep, "lengths": rep, "version": rep}
    self._zero_cache = jax.jit(lambda capacity: init_cache(model_cfg, max_slots, capacity),
                               static_argnums=0, out_shardings=cache)
    opts = compiler_options(exact_rounding)  # the programs that run the model
    self._prefill = jax.jit(self._on_mesh(self._prefill_impl), out_shardings=prefix,
                            compiler_options=opts)
    self._embedding = jax.jit(lambda head: head.T)  # [E, V] -> [V, E] (tied models' prefill)
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=state)
    self._generate = jax.jit(self._on_mesh(self._generate_impl), donate_argnums=(1,),
                             out_shardings=(state, rep, rep), compiler_options=opts)
    self._generate_steps = jax.jit(self._on_mesh(self._generate_steps_impl), donate_argnums=(1,),
                                   out_shardings=(state, rep), compiler_options=opts)
    self._resize = jax.jit(self._resize_impl, static_argnums=(1,), out_shardings=state)
    self._narrow = jax.jit(self._narrow_impl, out_shardings=state)
    self._resume = jax.jit(self._resume_impl, donate_argnums=(0,), out_shardings=state)

  # --- JetStream API -------------------------------------------------------------------

  def load_params(self, params=None, *, version: int = 0, **unused) -> EngineParams:
    """`params` (an `nnx.State` of the model's `nnx.Param`s, on any devices and sharding) in
    the engine's layout on its mesh, stamped `version` (`layout.load_weights`: on device).

    This is the snapshot swap of the lagged loop: nothing recompiles.
    """
    if params is None:
      raise ValueError("Engine.load_params needs params=<nnx.State of the model's Params>")
    if isinstance(params, EngineParams):
      return params
    return load_weights(params, version, self.layout, [self._mesh])[0]

  def weights(self, params) -> EngineParams:
    """`params` as `EngineParams`; a bare `nnx.State` gets version -1 (unknown)."""
    if isinstance(params, EngineParams):
      return params
    return self.load_params(params, version=-1)

  def init_decode_state(self, key: jax.Array | None = None, *, eos_id: int | None = None,
                        stop_sequences=(), capacity: int | None = None, insert_width: int = 1,
                        **unused) -> dict:
    """Empty decode state (every slot free). `key` seeds sampling (default key(0)).

    capacity: cache positions per slot (default max_len; see `resize`).
    eos_id: token that ends an answer (-1: none; default: the tokenizer's, if the engine has
    one, else none); stop_sequences: token-id sequences that end an answer (included in it).
    Their count and longest length are shapes: a new set of stop sequences compiles
    `generate` anew, new lengths of anything else do not.
    insert_width: the most tokens `resume` feeds a slot at once (a shape; 1 when unused).
    """
    if eos_id is None:
      eos_id = -1 if self._tokenizer is None else self._tokenizer.eos_id
    cfg, s = self.model_cfg, self._max_slots
    width = max([1] + [len(q) for q in stop_sequences])
    stops = np.full((len(stop_sequences), width), -1, np.int32)  # -1 = any token
    for i, q in enumerate(stop_sequences):
      stops[i, width - len(q):] = q
    small = {
        "next_logits": np.zeros((s, cfg.vocab_size), np.float32),
        "positions": np.zeros((s,), np.int32),
        "lengths": np.zeros((s,), np.int32),
        "limits": np.zeros((s,), np.int32),
        "live": np.zeros((s,), bool),
        "finish": np.full((s,), -1, np.int32),
        "versions": np.full((s,), -1, np.int32),
        "recent": np.full((s, width), _NO_TOKEN, np.int32),
        "eos": np.asarray(eos_id, np.int32),
        "stops": stops,
        "key": jax.random.key(0) if key is None else jnp.copy(key),  # the state is donated, the caller's key is not
        "step": np.zeros((), np.int32),
        "forced": np.zeros((s, insert_width), np.int32),
        "forced_n": np.zeros((s,), np.int32),
        "forced_i": np.zeros((s,), np.int32),
    }
    small["answer_keys"] = jax.random.split(small["key"], s)  # replaced at each insert
    return {"cache": self._zero_cache(capacity or self.max_len),
            **jax.device_put(small, self._replicated)}

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> dict:
    """KV cache of one prompt. padded_tokens: `[T]` int (right-padded), true_length: int."""
    if existing_prefix is not None:
      raise NotImplementedError("prefill on top of an existing prefix is not supported")
    tokens = np.asarray(padded_tokens, np.int32)[None]  # [1, T]
    return self.prefill_batch(params, tokens, np.array([true_length], np.int32))

  def insert(self, prefix: dict, decode_state: dict, slot: int) -> dict:
    """Writes a one-prompt `prefix` into decode slot `slot` (answer budget: the cache; the
    answer's key: the state's key folded with the decode step and the slot)."""
    return self.insert_many(prefix, decode_state, np.array([slot]), np.array([0]),
                            np.array([self.max_len]))

  def generate(self, params, decode_state: dict):
    """One decode step for every slot; returns (new state, `jetstream_adapter.SampledTokens`)."""
    state, data, log_probs = self._generate(self.weights(params), decode_state)
    return state, _jetstream().SampledTokens(data, (0, 1), (1, 2), (2, 3), 1, log_probs)

  def get_prefix_destination_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self):
    """JetStream's `TokenizerParameters` (a placeholder: `build_tokenizer` ignores it)."""
    return _jetstream().tokenizer_parameters()

  def build_tokenizer(self, metadata):
    """The engine's tokenizer as JetStream's `Tokenizer` (`jetstream_adapter.TokenizerAdapter`)."""
    if self._tokenizer is None:
      raise ValueError("Engine(tokenizer=...) is needed to run under JetStream's orchestrator")
    return _jetstream().TokenizerAdapter(self._tokenizer)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._max_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self):
    return None

  # --- batched calls (rollout) ---------------------------------------------------------

  def prefill_batch(self, params, tokens, lengths) -> dict:
    """KV caches of `B` prompts. tokens `[B, T]` int (right-padded), lengths `[B]` int.

    Returns a prefix: {"kvs": L x (k, v) `[B, T, K, D]`, "logits" `[B, V]`, "lengths" `[B]`,
    "version" `[]`}. One compile per (B, T): callers pad both to a few buckets.
    """
    if tokens.shape[1] > self._max_prefill_length:
      raise ValueError(f"prompt of {tokens.shape[1]} tokens > max_prefill_length="
                       f"{self._max_prefill_length}")
    weights = self.weights(params)
    embed = self._embedding(weights.decode["head"]) if self.model_cfg.tie_embeddings else None
    return self._prefill(weights, embed, np.asarray(tokens, np.int32), np.asarray(lengths, np.int32))

  def insert_many(self, prefix: dict, decode_state: dict, slots, rows, max_new, keys=None) -> dict:
    """Starts answers: slot `slots[n]` gets prompt `rows[n]` of `prefix`, `[N]` ints each.

    A slot index >= max_slots is skipped (padding). max_new `[N]`: answer budgets (capped by
    the cache). A prompt inserted into G slots is prefilled once (groups share a prefix).
    keys: `[N]` PRNG keys of the answers (`rollout` gives each answer its own); None: the
    state's key folded with the decode step and the slot.
    """
    as_i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return self._insert(prefix, decode_state, as_i32(slots), as_i32(rows), as_i32(max_new), keys)

  def generate_steps(self, params, decode_state: dict, stop_after_finished: int):
    """Up to `steps_per_call` decode steps in one call; returns (new state, `Steps`).

    Stops early once every slot is free, or once `stop_after_finished` answers have ended
    during this call (so that the caller can refill their slots).
    """
    return self._generate_steps(self.weights(params), decode_state,
                                np.asarray(stop_after_finished, np.int32))

  def capacity_for(self, positions: int) -> int:
    """Smallest cache capacity bucket holding `positions` positions (at most max_len)."""
    buckets = self.cache_bucket
    while buckets < positions:
      buckets *= 2
    return min(buckets, self.max_len)

  @staticmethod
  def capacity(decode_state: dict) -> int:
    return decode_state["cache"]["v"][0].shape[2]

  def resize(self, decode_state: dict, capacity: int) -> dict:
    """The state with cache capacity `capacity` (zero-padded, or cut: the caller makes sure
    no live slot needs a cut position). One compile per (old, new) capacity pair."""
    if capacity == self.capacity(decode_state):
      return decode_state
    return self._resize(decode_state, capacity)

  @staticmethod
  def width(decode_state: dict) -> int:
    """Decode slots the state holds (max_slots, or fewer after `narrow`)."""
    return decode_state["live"].shape[0]

  def resume(self, decode_state: dict, slots, tokens, counts) -> dict:
    """Slots `slots` (`[N]` ints; paused: their answer's turn ended, the slot not released)
    go on: first their `counts[n]` tokens `tokens[n]` (`[N, F]`, F the state's insert width)
    go in after the tokens already there, one per decode step as forced tokens (the
    environment's turn: log-prob 0, never an end), then they sample again under their answer's
    key. The budget (`limits`) counts the forced tokens; the caller keeps within it."""
    as_i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return self._resume(decode_state, as_i32(slots), as_i32(tokens), as_i32(counts))

  def narrow(self, decode_state: dict, keep) -> dict:
    """The state with only slots `keep` (`[W]` ints, row `i` of the result = slot `keep[i]`),
    W < the current width. Each kept slot carries on exactly as it would have (its random
    numbers follow its answer's key). One compile per
    (old width, new width, capacity)."""
    return self._narrow(decode_state, np.asarray(keep, np.int32))

  # --- jitted implementations ----------------------------------------------------------

  def _on_mesh(self, fn):
    """fn traced with the engine's mesh as the abstract mesh, where the model's attention runs
    the Pallas kernels on more than one device: a Mosaic call must run under `shard_map`,
    which needs a mesh at trace time (`attention._over_mesh`). Otherwise fn itself: the
    blockwise code is partitioned by XLA from the arrays' shardings alone."""
    from oapl_jax.models.attention import attention_impl  # noqa: PLC0415

    def traced(*args):
      if self._mesh.size == 1 or attention_impl(self.model_cfg.attention_kernel) == "xla":
        return fn(*args)
      with jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh):
        return fn(*args)

    return traced

  def _placed(self, state: dict) -> dict:
    """`state` constrained to its shardings (inside the decode loop: the carry stays placed)."""
    return jax.lax.with_sharding_constraint(state, self._state_sharding)

  def _narrow_impl(self, state, keep):
    per_slot = ("next_logits", "positions", "lengths", "limits", "live", "finish", "versions",
                "recent", "answer_keys", "forced", "forced_n", "forced_i")
    cache = {name: [x[keep] for x in layers] for name, layers in state["cache"].items()}
    return {**state, "cache": cache, **{name: state[name][keep] for name in per_slot}}

  def _resize_impl(self, state, capacity):
    def fit(x, axis):  # pad or cut `axis` to `capacity`
      if x.shape[axis] >= capacity:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, capacity - x.shape[axis])
      return jnp.pad(x, pad)

    cache = {"k": [fit(k, 3) for k in state["cache"]["k"]],
             "v": [fit(v, 2) for v in state["cache"]["v"]]}
    return {**state, "cache": cache}

  def _model(self, weights: EngineParams):
    """The model over the engine's `params` (the fused weights' Params are None: decode only)."""
    return nnx.merge(self._graphdef, weights.params)

  def _prefill_impl(self, weights, embed, tokens, lengths):
    plain = self.layout.plain_params(weights.params, weights.decode, embed)  # fused weights' slices
    logits, kvs = nnx.merge(self._graphdef, plain).prefill(tokens, lengths)  # [B, V], L x [B, T, K, D]
    return {"kvs": kvs, "logits": logits, "lengths": lengths, "version": weights.version}

  def _insert_impl(self, prefix, state, slots, rows, max_new, keys):
    kvs = [(k[rows], v[rows]) for k, v in prefix["kvs"]]  # [N, T, K, D]
    length = prefix["lengths"][rows]  # [N]
    put = lambda a, value: a.at[slots].set(value, mode="drop")  # slots >= S: dropped  # noqa: E731
    if keys is None:  # JetStream's `insert`: a key of this decode step and slot
      keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(state["key"], state["step"]), slots)
    return {
        **state,
        "cache": write_prefix(state["cache"], kvs, slots),
        "next_logits": put(state["next_logits"], prefix["logits"][rows]),
        "positions": put(state["positions"], length),
        "lengths": put(state["lengths"], 0),
        "limits": put(state["limits"], jnp.minimum(max_new, self.max_len - length)),
        "live": put(state["live"], True),
        "finish": put(state["finish"], -1),
        "versions": put(state["versions"], prefix["version"]),
        "recent": put(state["recent"], _NO_TOKEN),
        "answer_keys": put(state["answer_keys"], keys),
        "forced_n": put(state["forced_n"], 0),
        "forced_i": put(state["forced_i"], 0),
    }

  def _resume_impl(self, state, slots, tokens, counts):
    put = lambda a, value: a.at[slots].set(value, mode="drop")  # noqa: E731
    return {**state, "forced": put(state["forced"], tokens), "forced_n": put(state["forced_n"], counts),
            "forced_i": put(state["forced_i"], 0), "live": put(state["live"], True),
            "finish": put(state["finish"], -1), "recent": put(state["recent"], _NO_TOKEN)}

  def _loop_constants(self, weights, state) -> dict:
    """What every decode step of a call reuses: the RoPE table of the cache positions
    (computed once per call; the fused weights are made once per snapshot, `layout.py`)."""
    return {"rope_table": self._model(weights).rope_table(self.capacity(state))}

  def _step(self, weights, state, consts):
    """One decode step. Returns (state, tokens `[S]`, log-probs `[S]`, valid `[S]`).

    consts: `_loop_constants(weights, state)`.
    """
    live = state["live"]  # [S]
    # token t of an answer: uniform(fold_in(answer key, t)) (any slot, width or decode step)
    u = jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t)))(
        state["answer_keys"], state["lengths"])  # [S]
    tokens, logp = sample(process_logits(state["next_logits"], self.sampling), u)  # [S], [S]
    # an environment's turn going in (`resume`): its next token instead of a sampled one
    forcing = live & (state["forced_i"] < state["forced_n"])  # [S]
    width = state["forced"].shape[1]
    forced = jnp.take_along_axis(state["forced"], jnp.minimum(state["forced_i"], width - 1)[:, None], 1)[:, 0]
    tokens = jnp.where(forcing, forced, tokens)
    logp = jnp.where(forcing, 0.0, logp)
    capacity = self.capacity(state)
    positions = jnp.minimum(state["positions"], capacity - 1)  # retired slots: harmless
    live_len = jnp.max(jnp.where(live, positions + 1, 1))
    logits, cache = decode_lib.decode(self._model(weights), weights.decode, tokens, positions,
                                      state["cache"], live_len=live_len, chunk=self.attn_chunk,
                                      tpu=self._mesh.devices.flat[0].platform == "tpu", **consts)
    # The logits split by vocabulary as the head is: left to itself, XLA:TPU all-gathers the
    # whole head `[E, V]` every step (0.73 GiB per device for Qwen3-4B at tensor 4) rather than
    # the `[S, V]` logits that the state then replicates.
    logits = jax.lax.with_sharding_constraint(logits, self._logit_sharding)
    lengths = state["lengths"] + live
    shifted = jnp.concatenate([state["recent"][:, 1:], tokens[:, None]], axis=1)  # [S, W]
    recent = jnp.where((live & ~forcing)[:, None], shifted, state["recent"])
    hit_eos = (tokens == state["eos"]) & ~forcing
    hit_stop = _ends_with_any(recent, state["stops"]) & ~forcing
    done = live & (hit_eos | hit_stop | (lengths >= state["limits"]))
    reason = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_stop, FINISH_STOP, FINISH_LENGTH))
    new_state = self._placed({
        **state, "cache": cache, "next_logits": logits, "positions": state["positions"] + live,
        "lengths": lengths, "live": live & ~done, "recent": recent,
        "finish": jnp.where(done, reason, state["finish"]),
        "versions": jnp.where(live, jnp.minimum(state["versions"], weights.version), state["versions"]),
        "step": state["step"] + 1, "forced_i": state["forced_i"] + forcing,
    })
    return new_state, tokens, logp, live, forcing

  def _generate_impl(self, weights, state):
    """(new state, data `[S, 3]` (token, valid, answer length: `ResultTokens` columns),
    log-probs `[S, 1]`)."""
    new_state, tokens, logp, valid, _ = self._step(weights, state, self._loop_constants(weights, state))
    data = jnp.stack([tokens, valid.astype(jnp.int32), new_state["lengths"]], axis=1)  # [S, 3]
    return new_state, data, logp[:, None]

  def _generate_steps_impl(self, weights, state, stop_after_finished):
    t_max, s = self.steps_per_call, self.width(state)
    free_at_start = jnp.sum(~state["live"])
    consts = self._loop_constants(weights, state)

    def cond(carry):
      t, st, _ = carry
      finished = jnp.sum(~st["live"]) - free_at_start
      return (t < t_max) & jnp.any(st["live"]) & (finished < stop_after_finished)

    def body(carry):
      t, st, bufs = carry
      st, *rows = self._step(weights, st, consts)  # tokens, log-probs, valid, forced
      put = lambda buf, row: jax.lax.dynamic_update_slice(buf, row[None], (t, 0))
      return t + 1, st, tuple(put(buf, row) for buf, row in zip(bufs, rows))

    bufs = (jnp.zeros((t_max, s), jnp.int32), jnp.zeros((t_max, s), jnp.float32),
            jnp.zeros((t_max, s), bool), jnp.zeros((t_max, s), bool))
    n, state, (tokens, logp, valid, forced) = jax.lax.while_loop(cond, body, (jnp.int32(0), state, bufs))
    return state, Steps(tokens, logp, valid, forced, n, state["live"], state["finish"],
                        state["versions"], state["lengths"])


def _jetstream():
  """`jetstream_adapter` (imports JetStream, seqio and TensorFlow; once), with `Engine`
  registered as a virtual subclass of JetStream's `engine_api.Engine`."""
  from oapl_jax.sampling import jetstream_adapter  # noqa: PLC0415 (only JetStream's callers need it)
  engine_abc = jetstream_adapter.engine_api.Engine
  if not issubclass(Engine, engine_abc):
    engine_abc.register(Engine)
  return jetstream_adapter


def _ends_with_any(recent: jax.Array, stops: jax.Array) -> jax.Array:
  """recent `[S, W]`, stops `[N, W]` (-1 = any token) -> `[S]` bool: recent ends with one."""
  match = (stops[None] == -1) | (recent[:, None] == stops[None])  # [S, N, W]
  return jnp.any(jnp.all(match, axis=-1), axis=-1)
