"""Tool calls in the model's text, in Qwen3's format (its chat template's own):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

A turn may hold several calls; text outside them is the model's own. A call is malformed when
its body is not a JSON object with a string "name" and an object "arguments" (a JSON string
holding an object is accepted, as some models write it), or when a <tool_call> is never closed.
"""

from __future__ import annotations

import dataclasses
import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed call; `error` says why it is malformed (then name and arguments may be empty)."""

  name: str
  arguments: dict
  error: str | None = None


def _parse_body(body: str) -> ToolCall:
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return ToolCall("", {}, f"not JSON ({e.msg} at column {e.colno})")
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return ToolCall("", {}, 'not an object with a string "name"')
  args = obj.get("arguments", {})
  if isinstance(args, str):
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      pass
  if not isinstance(args, dict):
    return ToolCall(obj["name"], {}, '"arguments" is not an object')
  return ToolCall(obj["name"], args)


def parse(text: str) -> list[ToolCall]:
  """The tool calls in `text`, in order ([] for a plain turn)."""
  calls = [_parse_body(m.group(1).strip()) for m in _CALL.finditer(text)]
  rest = _CALL.sub("", text)
  if OPEN in rest:  # opened and never closed (the turn was cut, or the markup is broken)
    calls.append(ToolCall("", {}, f"{OPEN} without {CLOSE}"))
  return calls
