"""An environment of tools: each model turn either calls tools or answers.

A turn holding tool calls (`tool_calls.parse`) gets one "tool" message per call, in order:
the tool's output, or why the call failed (malformed, unknown tool, the tool raised, hung or
flooded); the episode goes on. A plain turn (no call) is the answer: the episode ends and
`score` scores that turn's text. After `max_turns` model turns the episode ends whatever the
last turn was (counted in `turn_limit` if it still called tools; its score is then that of the
last turn's text, which a task scores like any answer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from oapl_jax.envs import tool_calls
from oapl_jax.envs.base import EnvMetrics, Turn
from oapl_jax.envs.tools import ToolResult, run_tool
from oapl_jax.tasks.base import Problem


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool the model may call: its chat-template schema and the function that runs it."""

  name: str
  description: str
  parameters: dict  # JSON schema of the arguments object
  function: str = ""  # "module:function", called with the arguments as keywords, returns a string
  in_process: bool = False  # run in this process (pure, bounded tools only: no time limit applies)
  # Instead of `function`: a tool that keeps its own limits (the Python sandbox, python_tool.py),
  # called in this process with the arguments dict; its ToolResult is taken as it is.
  run: Callable[[dict], ToolResult] | None = None

  @property
  def schema(self) -> dict:
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class Limits:
  max_turns: int  # model turns per episode
  timeout_s: float  # seconds per tool call
  max_chars: int  # characters of a tool's output shown to the model


class ToolEpisode:
  """One problem's episode in a `ToolEnvironment`."""

  def __init__(self, env: "ToolEnvironment", problem: Problem):
    self.env, self.problem = env, problem
    self.metrics = EnvMetrics()
    self.answer: str | None = None  # the text scored: the plain turn, or the last at the turn limit
    self.done = False

  def _call(self, call: tool_calls.ToolCall) -> str:
    m = self.metrics
    m.tool_calls += 1
    if call.error is not None:
      m.malformed_calls += 1
      return f"error: malformed tool call: {call.error}"
    tool = self.env.tools_by_name.get(call.name)
    if tool is None:
      m.unknown_tools += 1
      return f"error: unknown tool {call.name!r}; tools: {', '.join(self.env.tools_by_name)}"
    lim = self.env.limits
    if tool.run is not None:
      try:
        result = tool.run(call.arguments)
      except Exception as e:  # noqa: BLE001 - the tool's failure is an observation
        result = ToolResult(f"error: {type(e).__name__}: {e}"[:lim.max_chars], "error")
    else:
      result = run_tool(tool.function, call.arguments, timeout_s=lim.timeout_s,
                        max_chars=lim.max_chars, in_process=tool.in_process)
    counter = {"ok": "tool_ok", "error": "tool_errors", "timeout": "tool_timeouts",
               "flood": "tool_floods", "sandbox": "sandbox_errors"}[result.status]
    setattr(m, counter, getattr(m, counter) + 1)
    return result.text

  def step(self, text: str) -> Turn:
    if self.done:
      return Turn([], True)
    self.metrics.turns += 1
    calls = tool_calls.parse(text)
    self.answer = text
    if not calls:
      self.done = True
      return Turn([], True)
    if self.metrics.turns >= self.env.limits.max_turns:
      self.metrics.turn_limit += 1
      self.done = True
      return Turn([], True)
    return Turn([{"role": "tool", "content": self._call(c)} for c in calls], False)

  def score(self) -> float:
    if self.answer is None:
      return 0.0
    try:
      return float(self.env.score_answer(self.answer, self.problem))
    except Exception:  # noqa: BLE001 - a scorer's failure scores 0 (a task's score never raises)
      return 0.0


class ToolEnvironment:
  """Tools, limits and a scorer of the final answer (`score_answer(text, problem) -> float`)."""

  def __init__(self, tools: list[Tool], limits: Limits, score_answer: Callable[[str, Problem], float]):
    self.tools_by_name = {t.name: t for t in tools}
    self.tools = [t.schema for t in tools]
    self.limits = limits
    self.score_answer = score_answer

  def start(self, problem: Problem) -> ToolEpisode:
    return ToolEpisode(self, problem)
