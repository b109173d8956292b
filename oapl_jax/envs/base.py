"""What every environment is: `Turn`, the `Episode` and `Environment` interfaces, `EnvMetrics`.

An environment starts an episode from a problem (`Environment.start`); the episode answers each
model turn (`Episode.step(text)`: the model's decoded turn, a tool call or a plain answer) with
a `Turn`: the messages the environment says back (chat messages, rendered into environment
tokens through the model's chat template by whoever runs the episode) and whether the episode is
over; when it is, `Episode.score()` is the trajectory's reward. An episode never raises out of
`step` or `score` for anything the model wrote or a tool did: a malformed call, an unknown
tool, a tool that raises, hangs or floods output each become a message the model sees and a
count in `EnvMetrics`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from oapl_jax.tasks.base import Problem


@dataclasses.dataclass
class Turn:
  """The environment's answer to one model turn."""

  messages: list[dict]  # chat messages ({"role": "tool" | "user", "content": str}); [] when done
  done: bool  # the episode is over: a plain answer, or the turn limit reached


@dataclasses.dataclass
class EnvMetrics:
  """What an episode's turns came to (summed over episodes with `+`; `as_dict` for metrics)."""

  turns: int = 0  # model turns answered
  tool_calls: int = 0  # tool calls the model made (parsed or not)
  tool_ok: int = 0  # calls that ran and returned
  malformed_calls: int = 0  # a <tool_call> whose body is not {"name": str, "arguments": object}
  unknown_tools: int = 0  # a call naming no tool of the environment
  tool_errors: int = 0  # a tool that raised (bad arguments included)
  tool_timeouts: int = 0  # a tool stopped at its time limit
  tool_floods: int = 0  # a tool whose output was cut at the output cap
  sandbox_errors: int = 0  # a call not run: the sandbox it needs is missing or does not start
  turn_limit: int = 0  # episodes ended by the turn limit while the model still called tools

  def __add__(self, other: "EnvMetrics") -> "EnvMetrics":
    return EnvMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                         for f in dataclasses.fields(self)})

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


class Episode(Protocol):
  """One problem's multi-turn exchange."""

  metrics: EnvMetrics
  done: bool  # the episode is over (its last `step` said so); `score` is its reward then

  def step(self, text: str) -> Turn:
    """The environment's answer to the model's turn `text` (decoded, special tokens dropped
    but for the tool-call markup); never raises."""

  def score(self) -> float:
    """The finished trajectory's reward; never raises."""


class Environment(Protocol):
  """A multi-turn environment: one file under oapl_jax/envs/ that joins `registry.ENVS`."""

  tools: list[dict]  # the tools' schemas, as the chat template takes them (apply_chat_template(tools=))

  def start(self, problem: Problem) -> Episode:
    """A new episode for `problem`."""
