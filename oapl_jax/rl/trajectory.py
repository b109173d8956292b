"""Multi-turn trajectories as trainer rows: a prompt, then model and environment spans.

A trajectory is a prompt followed by alternating spans (docs/agents.md):

* a **model** span: tokens as the engine sampled them, each with pi_old's log-prob (never
  re-tokenized);
* an **environment** span: a tool result or a user turn, tokens inserted through the model's
  chat template (context: no log-prob, never a target).

It is laid out exactly as a single-turn answer (`logprobs.make_batch`): `prompt + spans +
padding` from position 0, the spans after the prompt playing the answer's part. Only what the
model wrote is a target: `Rows.mask` is 1 on model tokens alone (it has holes where the
environment spoke), `Rows.sampler_logprobs` is 0 on environment tokens, and
`Rows.answer_lengths` counts model tokens. Every consumer reads the mask, so `ell`, the
entropy, the GRPO ratios and k3 KL, the engine/trainer mismatch and the offline rescoring
check all cover model tokens only; packing (`rl/packing.py`) copies a row up to its last
counted target, environment tokens in between included (they are context). A trajectory with
one model span and no environment span is a single-turn answer, and gives the same `Rows`
bit for bit (`flags` all 1 change nothing).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oapl_jax.rl.buffer import Rows
from oapl_jax.rl.logprobs import make_batch, only_model_targets  # noqa: F401 (only_model_targets: read from here too)

MODEL, ENV = "model", "env"  # span kinds


@dataclasses.dataclass
class Span:
  """One span of a trajectory: `kind` MODEL (with `logprobs`, one per token) or ENV (None)."""

  kind: str
  tokens: list[int]
  logprobs: list[float] | None = None

  def __post_init__(self):
    if self.kind not in (MODEL, ENV):
      raise ValueError(f"span kind {self.kind!r}: expected {MODEL!r} or {ENV!r}")
    if self.kind == MODEL and (self.logprobs is None or len(self.logprobs) != len(self.tokens)):
      raise ValueError(f"a model span of {len(self.tokens)} tokens needs as many log-probs, got "
                       f"{None if self.logprobs is None else len(self.logprobs)}")


@dataclasses.dataclass
class Trajectory:
  """A prompt and its spans, the trajectory's reward and how it ended (a finish code of
  `sampling.rollout`: EOS, length limit, stop sequence)."""

  prompt: list[int]
  spans: list[Span]
  reward: float
  finish: int

  def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, model flags, log-probs) `[A]` of everything after the prompt: flags 1 on model
    tokens, log-probs 0 on environment tokens."""
    tokens = [t for s in self.spans for t in s.tokens]
    flags = [s.kind == MODEL for s in self.spans for _ in s.tokens]
    logprobs = [lp for s in self.spans for lp in (s.logprobs if s.kind == MODEL else [0.0] * len(s.tokens))]
    return (np.asarray(tokens, np.int32), np.asarray(flags, np.int8),
            np.asarray(logprobs, np.float32))


def rows_of(trajectories: list[Trajectory], *, group_size: int, seq_len: int, pad_id: int,
            count_truncated: bool = True, version: int = -1) -> Rows:
  """Trajectories (groups of `group_size` contiguous, each group sharing its prompt) as `Rows`
  of `[N, seq_len]` tokens: `make_batch`'s layout with environment tokens out of the targets
  (`only_model_targets`)."""
  from oapl_jax.sampling.rollout import Rollout  # noqa: PLC0415 (the engine imports JetStream)
  n = len(trajectories)
  if n % group_size:
    raise ValueError(f"{n} trajectories is not a whole number of groups of {group_size}")
  for i, tr in enumerate(trajectories):
    if tr.prompt != trajectories[i - i % group_size].prompt:
      raise ValueError(f"trajectory {i}: not the prompt of its group's first")
  flat = [tr.flat() for tr in trajectories]
  lengths = np.array([len(f[0]) for f in flat], np.int32)
  width = max(int(lengths.max()), 1) if n else 1
  tokens = np.full((n, width), pad_id, np.int32)
  logprobs = np.zeros((n, width), np.float32)
  model = np.zeros((n, width), np.int8)
  for i, (tok, flags, lp) in enumerate(flat):
    tokens[i, :len(tok)], model[i, :len(tok)], logprobs[i, :len(tok)] = tok, flags, lp
  rollout = Rollout(prompts=[list(trajectories[g].prompt) for g in range(0, n, group_size)],
                    group_size=group_size, answers=tokens, logprobs=logprobs, lengths=lengths,
                    finish=np.array([tr.finish for tr in trajectories], np.int8),
                    versions=np.full((n,), version, np.int32), model=model)
  return make_batch(rollout, np.array([tr.reward for tr in trajectories], np.float32),
                    seq_len=seq_len, pad_id=pad_id, count_truncated=count_truncated)
