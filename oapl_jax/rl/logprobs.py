"""The trainer's sequence log-prob kernel, and `make_batch`, which lays a rollout out for it.

A batch row is `prompt + answer + padding` starting at position 0 (the same positions the
engine used). Targets are `tokens[:, 1:]`; `mask[:, t]` is 1 where target t is an answer
token that counts in the loss (`buffer.Rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax.rl.buffer import Rows
from oapl_jax.sampling.processing import SamplingParams, entropy, process_logits
from oapl_jax.sampling.rollout import FINISH_LENGTH, Rollout


def token_logprobs(model: nnx.Module, tokens: jax.Array, sampling: SamplingParams):
  """Log-probs of each next token under the engine's processed distribution.

  tokens: `[B, T]` int. Returns (logprobs `[B, T-1]`, entropy `[B, T-1]`), float32:
  logprobs[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) after temperature / top-k /
  top-p processing (the scored token always kept; see `processing.py`). Gradients flow into
  the model's parameters through the logits; the truncation mask is stop-gradient.
  Entropy is of the processed distribution and should be read as a metric only.
  """
  logits = model(tokens[:, :-1])  # [B, T-1, V] float32
  targets = tokens[:, 1:]  # [B, T-1]
  processed = process_logits(logits, sampling, always_keep=targets)  # [B, T-1, V]
  logp_all = jax.nn.log_softmax(processed, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]  # [B, T-1]
  return logp, entropy(processed)


def make_batch(rollout: Rollout, rewards: np.ndarray, *, seq_len: int, pad_id: int,
               count_truncated: bool = True) -> Rows:
  """Lays a rollout out for the trainer: `Rows` of `[N, seq_len]` tokens (see `Rows`).

  The rows carry the engine's version stamps and `snapshot_step` -1 until `buffer.stamp`.
  With `count_truncated=False`, answers cut at the length limit get mask 0 (they are in their
  group's V_hat but out of the loss).
  """
  n, g = rollout.num_samples, rollout.group_size
  tokens = np.full((n, seq_len), pad_id, np.int32)
  mask = np.zeros((n, seq_len - 1), np.float32)
  old = np.zeros((n, seq_len - 1), np.float32)
  for row in range(n):
    prompt = rollout.prompts[row // g]
    p, a = len(prompt), int(rollout.lengths[row])
    if p + a > seq_len:
      raise ValueError(f"prompt {p} + answer {a} tokens > seq_len={seq_len}")
    tokens[row, :p] = prompt
    tokens[row, p:p + a] = rollout.answers[row, :a]
    if count_truncated or rollout.finish[row] != FINISH_LENGTH:
      mask[row, p - 1:p - 1 + a] = 1.0
    old[row, p - 1:p - 1 + a] = rollout.logprobs[row, :a]
  return Rows(tokens=tokens, mask=mask, sampler_logprobs=old,
              rewards=np.asarray(rewards, np.float32), answer_lengths=rollout.lengths.copy(),
              version=np.asarray(rollout.versions, np.int32), snapshot_step=np.full((n,), -1, np.int32))
