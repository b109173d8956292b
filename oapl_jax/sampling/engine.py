"""`Engine`: our transformer behind JetStream's engine API (prefill / insert / generate).

Decode state (a dict pytree, one row per slot `S`):
  cache        {"k", "v"}: `[L, S, max_len, K, D]`  KV cache
  next_logits  `[S, V]`   float32 logits of each slot's next token
  positions    `[S]`      index the next token will occupy (= current length)
  key          PRNG key;  step: `[]` int, folded into the key each generate step

`generate` samples one token per slot from the processed `next_logits` (temperature, top-k,
top-p; see `processing.py`), records its log-prob under exactly that distribution, and runs
the decode step that writes it into the cache and yields the following logits. Its
`SampledTokens` result carries the per-token log-probs next to JetStream's token data.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct
from jetstream.engine import engine_api

from oapl_jax.models.transformer import ModelConfig, init_cache
from oapl_jax.sampling.processing import SamplingParams, process_logits


@struct.dataclass
class SampledTokens(engine_api.ResultTokens):
  """JetStream's `ResultTokens` plus the log-prob of each sampled token, `[S, 1]` float32."""

  log_probs: Any = None

  def convert_to_numpy(self) -> "SampledTokens":
    return SampledTokens(np.array(self.data), self.tokens_idx, self.valid_idx,
                         self.length_idx, self.samples_per_slot, np.array(self.log_probs))


class Engine(engine_api.Engine):
  """A JetStream engine over `oapl_jax.models.Transformer`.

  Args:
    graphdef: the model's NNX graph definition (`nnx.split(model, nnx.Param)[0]`).
    model_cfg: its `ModelConfig`.
    sampling: temperature / top-p / top-k used by `generate` and for its log-probs.
    max_slots: decode slots (concurrent answers).
    max_prefill_length: longest prompt.
    max_len: KV-cache length per slot (prompt + answer).
    mesh: device mesh (default: all local devices on one "data" axis of size 1 per device).
  """

  def __init__(self, graphdef, model_cfg: ModelConfig, sampling: SamplingParams, *,
               max_slots: int, max_prefill_length: int, max_len: int,
               mesh: jax.sharding.Mesh | None = None):
    if max_prefill_length >= max_len:
      raise ValueError(f"max_prefill_length={max_prefill_length} must be < max_len={max_len}")
    self._graphdef = graphdef
    self.model_cfg = model_cfg
    self.sampling = sampling
    self._max_slots = max_slots
    self._max_prefill_length = max_prefill_length
    self.max_len = max_len
    self._mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    self._prefill = jax.jit(self._prefill_impl)
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
    self._generate = jax.jit(self._generate_impl, donate_argnums=(1,))

  # --- JetStream API -------------------------------------------------------------------

  def load_params(self, params=None, **unused) -> Any:
    """Returns `params` (an `nnx.State` of the model's `nnx.Param`s) on device."""
    if params is None:
      raise ValueError("Engine.load_params needs params=<nnx.State of the model's Params>")
    return jax.device_put(params)

  def init_decode_state(self, key: jax.Array | None = None, **unused) -> dict:
    """Empty decode state; `key` seeds sampling (default PRNGKey(0))."""
    cfg = self.model_cfg
    s = self._max_slots
    return {
        "cache": init_cache(cfg, s, self.max_len),
        "next_logits": jnp.zeros((s, cfg.vocab_size), jnp.float32),
        "positions": jnp.zeros((s,), jnp.int32),
        "key": jax.random.key(0) if key is None else key,
        "step": jnp.zeros((), jnp.int32),
    }

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> dict:
    """KV cache of one prompt. padded_tokens: `[T]` int (right-padded), true_length: int."""
    if existing_prefix is not None:
      raise NotImplementedError("prefill on top of an existing prefix is not supported")
    if padded_tokens.shape[0] > self._max_prefill_length:
      raise ValueError(f"prompt of {padded_tokens.shape[0]} tokens > max_prefill_length="
                       f"{self._max_prefill_length}")
    return self._prefill(params, jnp.asarray(padded_tokens, jnp.int32), jnp.int32(true_length))

  def insert(self, prefix: dict, decode_state: dict, slot: int) -> dict:
    """Writes `prefix` into decode slot `slot` (no recompile per slot)."""
    return self._insert(prefix, decode_state, jnp.int32(slot))

  def generate(self, params, decode_state: dict) -> tuple[dict, SampledTokens]:
    """Samples one token for every slot; returns (new state, `SampledTokens`)."""
    return self._generate(params, decode_state)

  def get_prefix_destination_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self):
    raise NotImplementedError("this engine works on token ids; tokenizers live in oapl_jax.tasks")

  def build_tokenizer(self, metadata):
    raise NotImplementedError("this engine works on token ids; tokenizers live in oapl_jax.tasks")

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

  # --- jitted implementations ----------------------------------------------------------

  def _model(self, params):
    return nnx.merge(self._graphdef, params)

  def _prefill_impl(self, params, tokens, true_length):
    logits, kvs = self._model(params)(tokens[None], return_kv=True)  # [1, T, V]
    return {
        "k": jnp.stack([k[0] for k, _ in kvs]),  # [L, T, K, D]
        "v": jnp.stack([v[0] for _, v in kvs]),
        "logits": logits[0, true_length - 1],  # [V]
        "length": true_length,
    }

  def _insert_impl(self, prefix, state, slot):
    def put(cache, new):  # cache [L, S, M, K, D], new [L, T, K, D]
      return jax.lax.dynamic_update_slice(cache, new[:, None].astype(cache.dtype), (0, slot, 0, 0, 0))

    return {
        **state,
        "cache": {"k": put(state["cache"]["k"], prefix["k"]), "v": put(state["cache"]["v"], prefix["v"])},
        "next_logits": state["next_logits"].at[slot].set(prefix["logits"]),
        "positions": state["positions"].at[slot].set(prefix["length"]),
    }

  def _generate_impl(self, params, state):
    key = jax.random.fold_in(state["key"], state["step"])
    processed = process_logits(state["next_logits"], self.sampling)  # [S, V]
    tokens = jax.random.categorical(key, processed, axis=-1)  # [S]
    logp = jnp.take_along_axis(jax.nn.log_softmax(processed, -1), tokens[:, None], -1)  # [S, 1]
    positions = jnp.minimum(state["positions"], self.max_len - 1)
    logits, cache = self._model(params).decode(tokens, positions, state["cache"])
    new_state = {**state, "cache": cache, "next_logits": logits,
                 "positions": state["positions"] + 1, "step": state["step"] + 1}
    s = tokens.shape[0]
    data = jnp.stack([tokens, jnp.ones((s,), jnp.int32), state["positions"] + 1], axis=1)
    result = SampledTokens(data.astype(jnp.int32), (0, 1), (1, 2), (2, 3), 1, logp)
    return new_state, result
