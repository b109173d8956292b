"""Sample G answers per prompt through the `Engine` with continuous batching.

Pending prompts wait in a queue. Whenever at least G slots are free, the next prompts are
prefilled and each prompt's prefix is inserted into G free slots (a group shares its prefill).
Every prefill call has `engine.max_prefill_batch` rows (padded) and prompts of one length
bucket, padded to it: a prompt is always prefilled in the same program at the same length, so
its KV cache does not depend on which prompts share the call (matmul rounding does depend on
the shapes), and nothing recompiles per prompt length. Then `Engine.generate_steps` decodes all live slots on device, many steps per call,
and returns as soon as enough answers have ended (EOS, stop sequence, length budget) for the
next refill. Host work per call: one transfer of the call's tokens and a loop over slots.
Before each call the cache is resized to the smallest capacity bucket that the live answers
(and the prompts being inserted) can reach in that call (`Engine.resize`).

The final drain (no prompt waits, the last long answers run on) narrows the decode state: as
soon as at most half of its slots are live, the live ones move into a state of half the width
(`Engine.narrow`, down to `engine.min_decode_width`), so that a step computes fewer rows.

Sampling keys: prompt p has a key (`key` folded with p, or the caller's own per-prompt keys),
and its g-th answer `fold_in(prompt key, g)`, from which the engine draws token t with
`fold_in(answer key, t)`. So an answer depends on its prompt's key, g and the weights only: not
on which slot or decode step it lands in, how wide the state is, or which other prompts are
sampled beside it (a window of several steps' prompts in one call gives each step's answers).

Slot utilisation (`Rollout.slot_utilisation`) = live slot-steps / computed slot-steps, where a
decode call of n steps at width W computes n * W slot-steps (W = max_slots, or less once
narrowed): the fraction of decode rows computed that produced an answer token.

Multi-turn trajectories (`turns`, docs/agents.md): when an answer's turn ends (EOS or a stop
sequence), its slot pauses (not released) and `turns.respond` runs in a worker thread, off the
decode loop, while the other slots go on decoding; it says what the environment answers (its
tokens) or that the episode is over. An answer goes on by `Engine.resume`: the environment's
tokens enter the slot's KV cache after the tokens already there (forced decode steps, beside
the other slots' sampling), then the model samples its next turn under the same answer key.
An answer is then the whole trajectory after the prompt, and `Rollout.model` flags the tokens
the model wrote. The length budget counts every token; an environment turn that would leave
no room for a model token ends the trajectory there (FINISH_LENGTH). With `turns` None, or an
episode that ends at its first turn, nothing changes: the same tokens, bit for bit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Protocol, Sequence

import jax
import numpy as np

from oapl_jax.sampling.engine import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Engine

__all__ = ["FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP", "Rollout", "rollout"]

# How answers' random numbers are derived (module docstring); caches of sampled results key on it
# (`warmup.eval_cache_path`): "per-answer" since 2026-12-04 (before: per slot and decode step).
SAMPLING_KEYS = "per-answer"


@dataclasses.dataclass
class Rollout:
  """Answers of `P` prompts x `G` samples, row `p * G + g` (groups contiguous).

  prompts: list of P token lists. answers `[P*G, A]` int (pad after the end),
  logprobs `[P*G, A]` float32 (engine log-probs of the answer tokens, 0 on padding),
  lengths `[P*G]` (answer tokens incl. EOS / stop sequence), finish `[P*G]` (FINISH_EOS /
  FINISH_LENGTH / FINISH_STOP), versions `[P*G]` (policy version of the weights that produced
  each answer, from `Engine.load_params(..., version=)`; -1 for bare params).
  stats: slot_steps (decode steps x slots computed: the state's width, which narrows in the
  final drain), live_slot_steps (of which a slot was producing an
  answer), the same two counted only while prompts were still waiting for a slot
  (queued_slot_steps, queued_live_slot_steps: the final drain left out), decode_calls,
  prefill_calls.
  """

  prompts: list[list[int]]
  group_size: int
  answers: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish: np.ndarray
  versions: np.ndarray
  stats: dict = dataclasses.field(default_factory=dict)
  model: np.ndarray | None = None  # [P*G, A] int8: 1 on tokens the model wrote (multi-turn); None: all

  @property
  def num_samples(self) -> int:
    return self.answers.shape[0]

  @property
  def slot_utilisation(self) -> float:
    """Live slot-steps / computed slot-steps (steps x decode width) of the decode calls."""
    return self.stats["live_slot_steps"] / max(self.stats["slot_steps"], 1)

  @property
  def queued_slot_utilisation(self) -> float:
    """The same, over the decode calls made while prompts were waiting (no final drain)."""
    return self.stats["queued_live_slot_steps"] / max(self.stats["queued_slot_steps"], 1)


class Turns(Protocol):
  """The environment side of multi-turn rollouts (module docstring)."""

  insert_width: int  # the most tokens one environment turn inserts (the engine state's shape)
  workers: int  # environment turns (tool calls) run at once, in threads

  def respond(self, prompt: int, sample: int, turn: np.ndarray) -> Sequence[int] | None:
    """The environment's answer (its tokens, the chat template's rendering up to the next
    generation prompt) to sample `sample` of prompt `prompt` (indices of `rollout`'s prompts),
    whose model turn `turn` (tokens, its end included) just ended; None: the episode is over.
    Runs in a worker thread; must not raise for anything the model wrote."""


def _bucket(length: int, max_len: int) -> int:
  """Padded prefill length: next power of two >= length (at least 8), capped at max_len."""
  return min(max(8, 1 << (length - 1).bit_length()), max_len)


def _check(engine: Engine, prompts, group_size: int, max_new_tokens: int, limits) -> None:
  if group_size > engine.max_concurrent_decodes:
    raise ValueError(f"group_size={group_size} > engine slots={engine.max_concurrent_decodes}")
  for p in prompts:
    if not 1 <= len(p) <= engine.max_prefill_length:
      raise ValueError(f"prompt of {len(p)} tokens: must be 1..max_prefill_length="
                       f"{engine.max_prefill_length}")
    if len(p) + max_new_tokens > engine.max_len:
      raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} "
                       f"exceeds the KV cache length {engine.max_len}")
  if len(limits) != len(prompts) or not all(1 <= n <= max_new_tokens for n in limits):
    raise ValueError(f"answer_limits must give each of the {len(prompts)} prompts a budget in "
                     f"1..max_new_tokens={max_new_tokens}")


class _Slots:
  """Host bookkeeping: which answer row each slot produces, and the free slots."""

  def __init__(self, num_slots: int):
    self.row = np.full((num_slots,), -1)
    self.position = np.zeros((num_slots,), np.int64)  # next cache position of a live slot
    self.live = np.ones((num_slots,), bool)  # False while a held slot's environment turn runs
    self.free = list(range(num_slots))

  def take(self) -> int:
    return self.free.pop(0)

  def release(self, slot: int) -> None:
    self.row[slot] = -1
    self.live[slot] = True
    self.free.append(slot)
    self.free.sort()

  def narrowed(self, keep: np.ndarray) -> "_Slots":
    """The bookkeeping of `Engine.narrow(state, keep)`: new slot i is old slot keep[i]."""
    new = _Slots(len(keep))
    new.row, new.position, new.live = self.row[keep].copy(), self.position[keep].copy(), self.live[keep].copy()
    new.free = [i for i in range(len(keep)) if new.row[i] < 0]
    return new


def _narrow_width(engine: Engine, width: int, live: int) -> int:
  """The decode width for `live` answers in the drain: halved while they fit."""
  while width % 2 == 0 and width // 2 >= max(live, engine.min_decode_width, 1):
    width //= 2
  return width


def _padded(prompts, chunk, pad_id: int, max_len: int, rows: int):
  """tokens `[rows, T]` and lengths `[rows]` of prompts `chunk` (at most `rows`, one length
  bucket T; padding rows: one pad token)."""
  t = _bucket(max(len(prompts[p]) for p in chunk), max_len)
  tokens = np.full((rows, t), pad_id, np.int32)
  lengths = np.ones((rows,), np.int32)
  for j, p in enumerate(chunk):
    tokens[j, :len(prompts[p])] = prompts[p]
    lengths[j] = len(prompts[p])
  return tokens, lengths


def prompt_keys(key: jax.Array, num_prompts: int) -> jax.Array:
  """`[P]` keys of `num_prompts` prompts: prompt p's is `fold_in(key, p)`; `key` unchanged if it
  already holds one key per prompt."""
  if key.shape != ():
    return key
  return jax.vmap(jax.random.fold_in, (None, 0))(key, np.arange(num_prompts, dtype=np.uint32))


def answer_keys(key: jax.Array, num_prompts: int, group_size: int) -> jax.Array:
  """`[P * G]` keys of the answers, row p * G + g: `fold_in(prompt key p, g)`. key: one key or
  `[P]` keys, one per prompt (`prompt_keys`)."""
  key = prompt_keys(key, num_prompts)
  if key.shape != (num_prompts,):
    raise ValueError(f"key: one key or one per prompt ({num_prompts}), got shape {key.shape}")
  per_group = jax.vmap(jax.random.fold_in, (None, 0))
  return jax.vmap(per_group, (0, None))(key, np.arange(group_size, dtype=np.uint32)).reshape(-1)


def _prefill_chunks(prompts, batch, per_call: int, max_len: int) -> list[list[int]]:
  """Prompts `batch` in prefill calls: by length (little padding), at most `per_call` per call,
  and one length bucket per call."""
  chunks: list[list[int]] = []
  for p in sorted(batch, key=lambda p: len(prompts[p])):
    last = chunks[-1] if chunks else None
    if (last is None or len(last) == per_call
        or _bucket(len(prompts[last[0]]), max_len) != _bucket(len(prompts[p]), max_len)):
      chunks.append([])
    chunks[-1].append(p)
  return chunks


def _start_groups(engine, params, state, prompts, batch, slots: _Slots, *, group_size, limits,
                  pad_id, stats, keys):
  """Prefills prompts `batch` (`_prefill_chunks`) and inserts each prompt's prefix into G free
  slots."""
  for chunk in _prefill_chunks(prompts, batch, engine.max_prefill_batch, engine.max_prefill_length):
    tokens, lengths = _padded(prompts, chunk, pad_id, engine.max_prefill_length,
                              engine.max_prefill_batch)
    prefix = engine.prefill_batch(params, tokens, lengths)
    n = tokens.shape[0] * group_size
    dst = np.full((n,), engine.max_concurrent_decodes, np.int32)  # padding rows: dropped
    budget = np.ones((n,), np.int32)
    answer = np.zeros((n,), np.int32)  # each inserted answer's row (its key)
    for j, p in enumerate(chunk):
      for g in range(group_size):
        slot = slots.take()
        slots.row[slot], slots.position[slot] = p * group_size + g, len(prompts[p])
        dst[j * group_size + g], budget[j * group_size + g] = slot, limits[p]
        answer[j * group_size + g] = p * group_size + g
    rows = np.repeat(np.arange(tokens.shape[0]), group_size)
    state = engine.insert_many(prefix, state, dst, rows, budget, keys=keys[answer])
    stats["prefill_calls"] += 1
  return state


class _Answers:
  """Host buffers of the rollout's `N = P*G` answers (see `Rollout`), filled call by call."""

  def __init__(self, n: int, max_new_tokens: int, pad_id: int, multi_turn: bool = False):
    self.tokens = np.full((n, max_new_tokens), pad_id, np.int32)
    self.logprobs = np.zeros((n, max_new_tokens), np.float32)
    self.lengths = np.zeros((n,), np.int32)
    self.finish = np.full((n,), FINISH_LENGTH, np.int32)
    self.versions = np.full((n,), -1, np.int32)
    self.model = np.zeros((n, max_new_tokens), np.int8) if multi_turn else None
    self.turn_start = np.zeros((n,), np.int32)  # where each answer's current model turn starts

  def collect(self, out, slots: _Slots) -> list[int]:
    """Appends one `generate_steps` result (numpy `Steps`); frees the slots that finished, but
    for multi-turn answers whose turn ended (EOS, stop), returned (their slots stay held)."""
    steps, ended = int(out.num_steps), []
    for slot in np.nonzero(slots.row >= 0)[0]:
      row, t0 = slots.row[slot], self.lengths[slots.row[slot]]
      count = int(out.valid[:steps, slot].sum())  # a slot's live steps are a prefix of the call
      if not count and not slots.live[slot]:
        continue  # paused: its environment turn is running
      self.tokens[row, t0:t0 + count] = out.tokens[:count, slot]
      self.logprobs[row, t0:t0 + count] = out.log_probs[:count, slot]
      if self.model is not None:
        self.model[row, t0:t0 + count] = ~out.forced[:count, slot]
      self.lengths[row] = t0 + count
      slots.position[slot] += count
      if not out.live[slot]:
        self.finish[row], self.versions[row] = out.finish[slot], out.versions[slot]
        if self.model is not None and out.finish[slot] != FINISH_LENGTH:
          slots.live[slot] = False
          ended.append(int(slot))
        else:
          slots.release(slot)
    return ended


def _count(stats: dict, out, num_slots: int, queued: bool) -> None:
  """Adds one decode call to the slot-step counters (see `Rollout.stats`)."""
  steps = int(out.num_steps)
  live = int(out.valid[:steps].sum())
  stats["decode_calls"] += 1
  stats["slot_steps"] += steps * num_slots
  stats["live_slot_steps"] += live
  if queued:
    stats["queued_slot_steps"] += steps * num_slots
    stats["queued_live_slot_steps"] += live


def _capacity(engine: Engine, prompts, batch, slots: _Slots) -> int:
  """Cache capacity bucket for the next call: the prompts being inserted (padded) and every
  live answer must fit, `steps_per_call` steps ahead."""
  reach = [_bucket(len(prompts[p]), engine.max_prefill_length) for p in batch]
  reach += [len(prompts[p]) + engine.steps_per_call for p in batch]
  reach += list(slots.position[slots.row >= 0] + engine.steps_per_call)
  return engine.capacity_for(max(reach))


class _EnvTurns:
  """The environment turns running beside the decode loop (multi-turn rollouts)."""

  def __init__(self, turns: Turns, group_size: int, limits):
    self.turns, self.g, self.limits = turns, group_size, limits
    self.pool = concurrent.futures.ThreadPoolExecutor(max(1, turns.workers), thread_name_prefix="env-turn")
    self.running: dict = {}  # future -> slot
    self.stats = {"env_turns": 0, "env_tokens": 0, "env_turns_cut": 0}

  def start(self, slots: _Slots, answers: _Answers, ended: list[int]) -> None:
    for slot in ended:
      row = int(slots.row[slot])
      turn = answers.tokens[row, answers.turn_start[row]:answers.lengths[row]].copy()
      self.running[self.pool.submit(self.turns.respond, row // self.g, row % self.g, turn)] = slot

  def resume(self, engine: Engine, state, slots: _Slots, answers: _Answers, *, wait: bool):
    """The state with the environment turns that are done put in (`Engine.resume`); the
    answers whose episode ended are released. wait: block until at least one is done."""
    if not self.running:
      return state
    done, _ = concurrent.futures.wait(list(self.running), timeout=None if wait else 0,
                                      return_when=concurrent.futures.FIRST_COMPLETED)
    go, tokens, counts = [], [], []
    width = self.turns.insert_width
    for future in done:
      slot = self.running.pop(future)
      row = int(slots.row[slot])
      reply = future.result()  # a bug in the environment is a bug: raised here
      if reply is None:  # the episode is over: the answer ends with this turn
        slots.release(slot)
        continue
      reply = list(reply)
      if len(reply) > width or answers.lengths[row] + len(reply) >= self.limits[row // self.g]:
        answers.finish[row] = FINISH_LENGTH  # no room for the turn and a model token after it
        self.stats["env_turns_cut"] += 1
        slots.release(slot)
        continue
      self.stats["env_turns"] += 1
      self.stats["env_tokens"] += len(reply)
      answers.finish[row] = FINISH_LENGTH  # until the trajectory's last turn ends
      answers.turn_start[row] = answers.lengths[row] + len(reply)
      slots.live[slot] = True
      go.append(slot)
      tokens.append(reply + [0] * (width - len(reply)))
      counts.append(len(reply))
    if go:
      state = engine.resume(state, np.array(go), np.array(tokens, np.int32).reshape(len(go), width),
                            np.array(counts))
    return state

  def renumber(self, keep: np.ndarray) -> None:
    """After `Engine.narrow(state, keep)`: new slot i is old slot keep[i]."""
    new = {int(old): i for i, old in enumerate(keep)}
    self.running = {future: new[slot] for future, slot in self.running.items()}

  def close(self) -> None:
    for future in self.running:
      future.cancel()
    self.pool.shutdown(wait=True, cancel_futures=True)


def rollout(engine: Engine, params, prompts: list[list[int]], *, group_size: int,
            max_new_tokens: int, eos_id: int, pad_id: int, key: jax.Array,
            stop_sequences=(), answer_limits=None, turns: Turns | None = None) -> Rollout:
  """Samples `group_size` answers for each prompt (token lists). Deterministic given `key`:
  one key, or `[P]` keys, one per prompt (the module docstring: an answer follows its prompt's
  key, whatever else is sampled beside it).

  params: an `nnx.State` or `engine.load_params(state, version=v)` (answers are stamped v).
  stop_sequences: token-id sequences that end an answer (kept in it, finish FINISH_STOP).
  answer_limits: optional per-prompt answer budgets (each <= max_new_tokens).
  turns: the environment of multi-turn trajectories (module docstring); None: one turn each.
  """
  limits = [max_new_tokens] * len(prompts) if answer_limits is None else list(answer_limits)
  _check(engine, prompts, group_size, max_new_tokens, limits)
  params = engine.weights(params)
  num_slots, g = engine.max_concurrent_decodes, group_size
  answers = _Answers(len(prompts) * g, max_new_tokens, pad_id, multi_turn=turns is not None)
  stats = dict.fromkeys(("slot_steps", "live_slot_steps", "queued_slot_steps",
                         "queued_live_slot_steps", "decode_calls", "prefill_calls"), 0)
  # Refill once `quantum` slots are free: fewer, larger prefills for a few idle slot-steps.
  quantum = g * -(-max(g, num_slots // 8) // g)
  keys = answer_keys(key, len(prompts), g)
  state = engine.init_decode_state(jax.random.key(0), eos_id=eos_id, stop_sequences=stop_sequences,
                                   capacity=engine.capacity_for(1),
                                   insert_width=1 if turns is None else turns.insert_width)
  env = None if turns is None else _EnvTurns(turns, g, limits)
  try:
    state = _decode_all(engine, params, state, prompts, answers, env, stats, g=g, limits=limits,
                        pad_id=pad_id, keys=keys, quantum=quantum)
  finally:
    if env is not None:
      env.close()
      stats.update(env.stats)
  return Rollout(list(prompts), group_size, answers.tokens, answers.logprobs, answers.lengths,
                 answers.finish, answers.versions, stats, answers.model)


def _decode_all(engine, params, state, prompts, answers: _Answers, env: _EnvTurns | None, stats,
                *, g, limits, pad_id, keys, quantum):
  """Every prompt's answers, into `answers` (the loop of `rollout`)."""
  slots = _Slots(engine.max_concurrent_decodes)
  pending = collections.deque(range(len(prompts)))
  while pending or (slots.row >= 0).any():
    if env is not None:  # environment turns that are done go in; wait for one if nothing else can run
      idle = not slots.live[slots.row >= 0].any() and not (pending and len(slots.free) >= g)
      state = env.resume(engine, state, slots, answers, wait=idle)
      if not (pending or (slots.row >= 0).any()):
        break
    live = int((slots.row >= 0).sum())
    if not pending and _narrow_width(engine, len(slots.row), live) < len(slots.row):
      width = _narrow_width(engine, len(slots.row), live)
      keep = np.concatenate([np.nonzero(slots.row >= 0)[0], np.nonzero(slots.row < 0)[0]])[:width]
      state, slots = engine.narrow(state, keep), slots.narrowed(keep)
      if env is not None:
        env.renumber(keep)
    batch = [pending.popleft() for _ in range(min(len(slots.free) // g, len(pending)))]
    state = engine.resize(state, _capacity(engine, prompts, batch, slots))
    if batch:
      state = _start_groups(engine, params, state, prompts, batch, slots, group_size=g,
                            limits=limits, pad_id=pad_id, stats=stats, keys=keys)
    if pending:
      wanted = min(quantum, len(pending) * g) - len(slots.free)
    else:  # the drain: return once the state can be narrowed (or everything has ended)
      width, live = len(slots.row), int((slots.row >= 0).sum())
      half = width // 2 if width % 2 == 0 and width // 2 >= engine.min_decode_width else 0
      wanted = live - half if half else width + 1
    if env is not None:  # back at the first ended turn: its environment turn starts at once
      wanted = 1
    state, out = engine.generate_steps(params, state, max(wanted, 1))
    out = jax.device_get(out)
    _count(stats, out, len(slots.row), queued=bool(pending))
    ended = answers.collect(out, slots)
    if env is not None:
      env.start(slots, answers, ended)
  return state
