"""Episodes beside the engine: an environment's turns as `sampling.rollout`'s `turns`.

`EpisodeTurns` holds one episode per sampled trajectory (prompt p, sample g), started from
problem p when its first model turn ends. Each ended model turn is decoded (`decode_turn`: the
tool-call markup kept), answered by the episode (`Episode.step`), and the environment's
messages are rendered into tokens through the tokenizer's chat template (`env_turn_tokens`):
everything the template puts after the model's end-of-turn token up to the next assistant
generation prompt (for Qwen3: the newline, the `<tool_response>` user turn,
`<|im_start|>assistant\n`). Those tokens are context, never targets. `rewards` scores the
finished episodes; a trajectory cut at the length limit before its episode ended scores 0.

This module imports no JAX: `respond` runs in the rollout's worker threads, one episode per
trajectory, so episodes need no lock; the dictionary of episodes is guarded.
"""

from __future__ import annotations

import threading

import numpy as np

from oapl_jax.envs.base import EnvMetrics
from oapl_jax.errors import UserError

_SENTINEL = "\u2063oapl-turn\u2063"  # an assistant turn's content, found again in the rendering


def check_tokenizer(tokenizer, env_name: str) -> None:
  """An environment's turns are rendered by a chat template: refuse a tokenizer without one."""
  if not getattr(tokenizer, "has_chat_template", False):
    raise UserError(f"config.env.name={env_name!r}: environments render their turns through the "
                    "model's chat template, and this task's tokenizer has none (use an HF model "
                    "folder with a chat template, e.g. configs/math.py:tools)")


def env_turn_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
  """Tokens of the environment's `messages` (tool results, a user turn) as the chat template
  puts them after an assistant turn's end-of-turn token, through the next generation prompt."""
  hf = tokenizer.hf_tokenizer
  kwargs = {"tools": tools} if tools else {}
  chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
  text = hf.apply_chat_template(chat + list(messages), tokenize=False, add_generation_prompt=True,
                                **kwargs)
  end = hf.convert_ids_to_tokens(tokenizer.eos_id)
  at = text.rfind(_SENTINEL + end)
  if at < 0:
    raise ValueError(f"the chat template does not close an assistant turn with {end!r} (the "
                     "model's end-of-turn token): its environment turns cannot be placed")
  return tokenizer.encode(text[at + len(_SENTINEL) + len(end):])


def decode_turn(tokenizer, turn) -> str:
  """A model turn's text for its episode: special tokens kept (a tokenizer may mark the
  tool-call tags special), the end-of-turn tokens dropped."""
  ends = getattr(tokenizer, "eos_ids", {tokenizer.eos_id})
  ids = [int(t) for t in turn if int(t) not in ends and 0 <= int(t) < tokenizer.vocab_size]
  return tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=False)


class EpisodeTurns:
  """`sampling.rollout`'s `turns` over an `Environment` (module docstring).

  problems: those of the rollout's prompts, in order; insert_width: the most tokens one
  environment turn may insert (`config.env.max_env_tokens`); workers: turns run at once."""

  def __init__(self, env, problems: list, tokenizer, *, insert_width: int, workers: int):
    self.env, self.problems, self.tokenizer = env, problems, tokenizer
    self.insert_width, self.workers = insert_width, workers
    self.episodes: dict[tuple[int, int], object] = {}
    self._lock = threading.Lock()

  def respond(self, prompt: int, sample: int, turn) -> list[int] | None:
    with self._lock:
      episode = self.episodes.get((prompt, sample))
      if episode is None:
        episode = self.episodes[(prompt, sample)] = self.env.start(self.problems[prompt])
    reply = episode.step(decode_turn(self.tokenizer, turn))
    if reply.done:
      return None
    return env_turn_tokens(self.tokenizer, reply.messages, self.env.tools)

  def rewards(self, prompts: np.ndarray, group_size: int) -> np.ndarray:
    """`[len(prompts) * G]` rewards, row p * G + g the trajectory of (prompts[p], g): its
    episode's score once over, else 0 (cut at the length limit, or never ended a turn)."""
    out = np.zeros((len(prompts) * group_size,), np.float32)
    for i, p in enumerate(prompts):
      for g in range(group_size):
        episode = self.episodes.get((int(p), g))
        if episode is not None and episode.done:
          out[i * group_size + g] = episode.score()
    return out

  def metrics(self) -> dict[str, int]:
    """The episodes' outcomes, summed (`EnvMetrics`); how many there were (`episodes`: the
    trajectories that ended a turn), ended (`episodes_done`) and called a tool at least once
    (`episodes_calling`)."""
    total = EnvMetrics()
    for episode in self.episodes.values():
      total = total + episode.metrics
    return {**total.as_dict(), "episodes": len(self.episodes),
            "episodes_done": sum(bool(e.done) for e in self.episodes.values()),
            "episodes_calling": sum(e.metrics.tool_calls > 0 for e in self.episodes.values())}
