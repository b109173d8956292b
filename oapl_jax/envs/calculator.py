"""The calculator environment: the model may call `calculator(expression)` before it answers.

The worked example of docs/agents.md. The tool evaluates arithmetic safely: the expression is
parsed (`ast`, never `eval`) and only numbers, + - * / // % **, unary signs and parentheses
are evaluated; names, calls, attributes, strings and everything else are refused with a
message. Every value is bounded (|x| <= 1e100, exponents checked before they are computed,
expressions of at most 200 characters), so a call is pure and quick: it runs in the
environment's process (`Tool.in_process`). The final answer (the model's plain turn) is scored
by the config's task (`task.score`).
"""

from __future__ import annotations

import ast
import math
import operator

from oapl_jax.envs.tool_env import Limits, Tool, ToolEnvironment

MAX_CHARS = 200  # longest expression
MAX_ABS = 10 ** 100  # largest magnitude of any value along the way

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
  """Why an expression is not evaluated (shown to the model)."""


def _bounded(x):
  if isinstance(x, float) and not math.isfinite(x):
    raise CalcError("the result is not a finite number")
  if abs(x) > MAX_ABS:
    raise CalcError("a value is larger than 1e100")
  return x


def _power(base, exp):
  if abs(exp) > 1000 or (base not in (0, 1, -1) and abs(exp) * math.log10(max(abs(base), 1e-300)) > 100):
    raise CalcError("a power is larger than 1e100")
  if base == 0 and exp < 0:
    raise CalcError("division by zero")
  return base ** exp


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
      return _bounded(_power(left, right))
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
      raise CalcError("division by zero")
    return _bounded(_BINARY[type(node.op)](left, right))
  raise CalcError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def evaluate(expression: str):
  """The value of an arithmetic `expression` (int or float); CalcError says why not."""
  if not isinstance(expression, str):
    raise CalcError("the expression is not a string")
  if len(expression) > MAX_CHARS:
    raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise CalcError(f"not an arithmetic expression ({e.msg})") from None
  return _eval(tree)


def calculator(expression: str) -> str:
  """The tool: the value of `expression` as text (a float that is a whole number without its
  ".0"); raises CalcError (shown to the model as an error) when it is not evaluated."""
  value = evaluate(expression)
  if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    value = int(value)
  return str(value)


TOOL = Tool(name="calculator", description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                        "required": ["expression"]},
            function="oapl_jax.envs.calculator:calculator", in_process=True)


def make_calculator_env(env_config, task) -> ToolEnvironment:
  """The calculator environment on `task` (its `score` scores the final answer). env_config:
  the config's `env` section (limits)."""
  return ToolEnvironment([TOOL], Limits(max_turns=env_config.max_turns, timeout_s=env_config.tool_timeout_s,
                                        max_chars=env_config.tool_output_chars), getattr(task, "score", None))
