"""Sample G answers per prompt through the `Engine`, refilling slots as answers finish.

A group's prompt is prefilled once and its prefix inserted into G free slots. After every
`generate` step, slots whose answer hit EOS or `max_new_tokens` are freed, and the next
pending prompt is inserted as soon as G slots are free.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from oapl_jax.sampling.engine import Engine

FINISH_EOS, FINISH_LENGTH = 0, 1


@dataclasses.dataclass
class Rollout:
  """Answers of `P` prompts x `G` samples, row `p * G + g` (groups contiguous).

  prompts: list of P token lists. answers `[P*G, A]` int (pad after the end),
  logprobs `[P*G, A]` float32 (engine log-probs of the answer tokens, 0 on padding),
  lengths `[P*G]` (answer tokens incl. EOS), finish `[P*G]` (FINISH_EOS / FINISH_LENGTH).
  """

  prompts: list[list[int]]
  group_size: int
  answers: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish: np.ndarray

  @property
  def num_samples(self) -> int:
    return self.answers.shape[0]


def _bucket(length: int, max_len: int) -> int:
  """Padded prefill length: next power of two >= length (at least 8), capped at max_len."""
  return min(max(8, 1 << (length - 1).bit_length()), max_len)


def rollout(engine: Engine, params, prompts: list[list[int]], *, group_size: int,
            max_new_tokens: int, eos_id: int, pad_id: int, key: jax.Array) -> Rollout:
  """Samples `group_size` answers for each prompt (token lists). Deterministic given `key`."""
  slots = engine.max_concurrent_decodes
  if group_size > slots:
    raise ValueError(f"group_size={group_size} > engine slots={slots}")
  for p in prompts:
    if len(p) + max_new_tokens > engine.max_len:
      raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} "
                       f"exceeds the KV cache length {engine.max_len}")
  n = len(prompts) * group_size
  answers = np.full((n, max_new_tokens), pad_id, np.int32)
  logprobs = np.zeros((n, max_new_tokens), np.float32)
  lengths = np.zeros((n,), np.int32)
  finish = np.full((n,), FINISH_LENGTH, np.int32)

  state = engine.init_decode_state(key)
  row_of_slot = np.full((slots,), -1)  # which answer row each slot is producing
  free = list(range(slots))
  pending = list(range(len(prompts)))
  while pending or (row_of_slot >= 0).any():
    while pending and len(free) >= group_size:
      p = pending.pop(0)
      tokens = prompts[p]
      padded = np.full((_bucket(len(tokens), engine.max_prefill_length),), pad_id, np.int32)
      padded[: len(tokens)] = tokens
      prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(tokens))
      for g in range(group_size):
        slot = free.pop(0)
        state = engine.insert(prefix, state, slot)
        row_of_slot[slot] = p * group_size + g
    state, result = engine.generate(params, state)
    result = result.convert_to_numpy()
    for slot in np.nonzero(row_of_slot >= 0)[0]:
      row = row_of_slot[slot]
      t = lengths[row]
      token = result.data[slot, 0]
      answers[row, t] = token
      logprobs[row, t] = result.log_probs[slot, 0]
      lengths[row] = t + 1
      done_eos = token == eos_id
      if done_eos or t + 1 >= max_new_tokens:
        finish[row] = FINISH_EOS if done_eos else FINISH_LENGTH
        row_of_slot[slot] = -1
        free.append(slot)
    free.sort()
  return Rollout(list(prompts), group_size, answers, logprobs, lengths, finish)
