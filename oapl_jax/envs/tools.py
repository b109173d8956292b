"""Running a tool: in a child process, under a wall-clock limit and an output cap.

A tool is a module-level function `fn(**arguments) -> str` named "module:function". Each call
runs in a fresh child interpreter (the parent's `sys.path`), so that a tool that hangs is
stopped at its time limit (the child is killed, not abandoned in a thread) and nothing a tool
does (a crash, an exception, a flood of output, changed globals) reaches the caller. What
came of it is a `ToolResult`: its text (what the model is shown) and its status, one of

  "ok"       returned a string (anything else is shown as its `str`)
  "error"    raised: the exception's type and message (a bad argument is one)
  "timeout"  still running after `timeout_s`: killed
  "flood"    wrote more than `max_chars` characters (returned or printed): cut there
  "sandbox"  not run: the sandbox it needs is missing or broken (a tool with its own runner,
             `Tool.run`: the Python tool)

Cost: a child interpreter per call (0.3 s measured on the shared 2-core CI machine); an environment whose tools
are pure and bounded may run them in-process instead (`run_tool(..., in_process=True)`: no
time limit can stop it, the output cap still holds).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import os
import signal
import subprocess
import sys

STATUSES = ("ok", "error", "timeout", "flood", "sandbox")


@dataclasses.dataclass(frozen=True)
class ToolResult:
  text: str  # what the model sees
  status: str  # one of STATUSES


# The child: reads {"tool", "arguments", "max_chars"} on stdin, runs the tool with its prints
# captured (and capped), writes one JSON object {"status", "text"} on stdout.
_CHILD = r"""
import json, os, sys
reply = os.fdopen(os.dup(1), "w")  # the reply's own descriptor; fd 1 (and 2) go to /dev/null, so
null = os.open(os.devnull, os.O_WRONLY)  # a tool writing there directly cannot flood the parent
os.dup2(null, 1)
os.dup2(null, 2)
from oapl_jax.envs.tools import call_here
req = json.loads(sys.stdin.read())
out = call_here(req["tool"], req["arguments"], req["max_chars"])
reply.write(json.dumps({"status": out.status, "text": out.text}))
reply.flush()
"""


class _CappedWriter(io.TextIOBase):
  """A stdout that keeps the first `cap` characters and counts the rest."""

  def __init__(self, cap: int):
    self.cap, self.parts, self.size = cap, [], 0

  def write(self, s: str) -> int:
    if self.size < self.cap:
      self.parts.append(s[:self.cap - self.size])
    self.size += len(s)
    return len(s)

  def text(self) -> str:
    return "".join(self.parts)


def _resolve(tool: str):
  module, _, name = tool.partition(":")
  return getattr(importlib.import_module(module), name)


def call_here(tool: str, arguments: dict, max_chars: int) -> ToolResult:
  """Runs `tool` ("module:function") with `arguments` in this process, prints captured; its
  result or exception as a `ToolResult` (never raises but for KeyboardInterrupt / SystemExit)."""
  printed = _CappedWriter(max_chars)
  old, sys.stdout = sys.stdout, printed
  try:
    value = _resolve(tool)(**arguments)
  except Exception as e:  # noqa: BLE001 - the tool's failure is an observation
    return ToolResult(f"error: {type(e).__name__}: {e}"[:max_chars], "error")
  finally:
    sys.stdout = old
  value = "" if value is None else str(value)
  text, size = printed.text() + value[:max_chars], printed.size + len(value)
  if size > max_chars:
    return ToolResult(text[:max_chars] + f"\n[output cut at {max_chars} characters]", "flood")
  return ToolResult(text, "ok")


def run_tool(tool: str, arguments: dict, *, timeout_s: float, max_chars: int,
             in_process: bool = False) -> ToolResult:
  """Runs `tool` ("module:function") with `arguments` (module docstring); never raises for
  anything the tool does."""
  if in_process:
    return call_here(tool, arguments, max_chars)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
  try:
    request = json.dumps({"tool": tool, "arguments": arguments, "max_chars": max_chars})
  except (TypeError, ValueError) as e:
    return ToolResult(f"error: arguments are not JSON: {e}", "error")
  child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                           start_new_session=True)  # its own process group: killed whole
  try:
    out, _ = child.communicate(request, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(child.pid, signal.SIGKILL)  # the child and anything it started
    child.communicate()
    return ToolResult(f"error: the tool was stopped after {timeout_s:g} s (time limit)", "timeout")
  try:
    reply = json.loads(out)
    return ToolResult(str(reply["text"]), reply["status"])
  except (json.JSONDecodeError, KeyError, TypeError):
    return ToolResult(f"error: the tool's process died (exit code {child.returncode})", "error")
