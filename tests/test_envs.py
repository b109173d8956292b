"""Environments without the engine: tool-call parsing, the tool runner's limits, the calculator
environment's episodes, the registry and its settings."""

import time

import pytest

from oapl_jax import config as config_lib
from oapl_jax.envs import ENVS, EnvMetrics, make_env, tool_calls
from oapl_jax.envs.calculator import TOOL as CALCULATOR
from oapl_jax.envs.calculator import CalcError, calculator, evaluate
from oapl_jax.envs.tool_env import Limits, Tool, ToolEnvironment
from oapl_jax.envs.tools import run_tool
from oapl_jax.errors import ConfigError
from oapl_jax.tasks.base import Problem


# --- tools the tests call by name ("test_envs:<name>", run in a child process) ---------------

def hang(**_):
  while True:
    time.sleep(1)


def flood(**_):
  return "x" * 1_000_000


def shout(**_):
  for _ in range(100_000):
    print("spam spam spam")
  return "done"


def fail(**_):
  raise RuntimeError("the tool broke")


def _call(name, args):
  return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# --- parsing ---------------------------------------------------------------------------------

def test_qwen3_tool_calls_are_parsed_and_malformed_ones_named():
  text = "Let me compute.\n" + _call("calculator", '{"expression": "12 * 7"}') + "\n" + _call("calculator", '"{\\"expression\\": \\"1+1\\"}"')
  calls = tool_calls.parse(text)
  assert [(c.name, c.arguments, c.error) for c in calls] == [
      ("calculator", {"expression": "12 * 7"}, None), ("calculator", {"expression": "1+1"}, None)]
  assert tool_calls.parse("The answer is 84.") == []
  bad = tool_calls.parse("<tool_call>{not json}</tool_call> <tool_call>[1]</tool_call> "
                         '<tool_call>{"name": "c", "arguments": 3}</tool_call> <tool_call>{"name": "c"')
  assert [c.error.split(" (")[0] for c in bad] == [
      "not JSON", 'not an object with a string "name"', '"arguments" is not an object',
      "<tool_call> without </tool_call>"]


# --- the calculator --------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("12 * 7", "84"), ("7 / 2", "3.5"), ("6 / 2", "3"), ("-(3 + 4) ** 2", "-49"), ("17 // 5 % 3", "0"),
    ("2 ** -1", "0.5"), ("1.5e3 + 1", "1501")])
def test_calculator_evaluates_arithmetic(expression, value):
  assert calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "not Call"), ("x + 1", "not Name"), ("'a' * 3", "not Constant"),
    ("(1).real", "not Attribute"), ("9 ** 9 ** 9", "larger than 1e100"), ("10 ** 101", "larger than 1e100"),
    ("1e300 * 1e300", "larger than 1e100"), ("1 / 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("3 +", "not an arithmetic expression"), ("1" * 201, "longer than 200"), ("[1, 2]", "not List"),
    ("True + 1", "not Constant")])
def test_calculator_refuses_anything_else_without_eval(expression, why):
  with pytest.raises(CalcError, match=why.replace("(", r"\(").replace("*", r"\*")):
    evaluate(expression)


# --- the tool runner -------------------------------------------------------------------------

def test_a_hanging_tool_is_stopped_at_its_limit():
  t0 = time.perf_counter()
  out = run_tool("test_envs:hang", {}, timeout_s=1.0, max_chars=100)
  took = time.perf_counter() - t0
  assert out.status == "timeout" and "stopped after 1 s (time limit)" in out.text
  assert 1.0 <= took < 10.0, took


def test_a_flooding_tool_is_cut_at_the_cap_and_a_raising_one_reported():
  out = run_tool("test_envs:flood", {}, timeout_s=30, max_chars=50)
  assert out.status == "flood" and out.text.startswith("x" * 50 + "\n[output cut at 50 characters]")
  out = run_tool("test_envs:shout", {}, timeout_s=30, max_chars=50)
  assert out.status == "flood" and len(out.text) < 100
  out = run_tool("test_envs:fail", {}, timeout_s=30, max_chars=100)
  assert (out.status, out.text) == ("error", "error: RuntimeError: the tool broke")
  out = run_tool("test_envs:no_such_tool", {}, timeout_s=30, max_chars=100)
  assert out.status == "error" and "AttributeError" in out.text


# --- episodes --------------------------------------------------------------------------------

def _score(text, problem):
  return float(text.strip().endswith(problem.answer))


def _env(max_turns=4, timeout_s=1.0):
  tools = [CALCULATOR,
           Tool("sleep", "hangs", {"type": "object"}, "test_envs:hang"),
           Tool("flood", "floods", {"type": "object"}, "test_envs:flood"),
           Tool("fail", "raises", {"type": "object"}, "test_envs:fail")]
  return ToolEnvironment(tools, Limits(max_turns=max_turns, timeout_s=timeout_s, max_chars=40), _score)


def test_an_episode_answers_tool_calls_and_scores_the_plain_turn():
  problem = Problem(prompt="What is 12 * 7?", answer="84", id=0)
  episode = _env().start(problem)
  turn = episode.step("I'll use the tool. " + _call("calculator", '{"expression": "12 * 7"}'))
  assert turn.done is False and turn.messages == [{"role": "tool", "content": "84"}]
  turn = episode.step("The answer is 84")
  assert turn.done is True and turn.messages == []
  assert episode.score() == 1.0
  assert episode.metrics == EnvMetrics(turns=2, tool_calls=1, tool_ok=1)


def test_every_tool_failure_is_an_observation_and_a_count_never_an_exception():
  episode = _env(max_turns=10).start(Problem(prompt="p", answer="1", id=0))
  calls = [_call("calculator", '{"expression": "1/0"}'), _call("nope", "{}"),
           "<tool_call>{broken</tool_call>", _call("sleep", "{}"), _call("flood", "{}"),
           _call("fail", "{}"), _call("calculator", '{"expr": "1"}')]
  turn = episode.step("".join(calls))
  said = [m["content"] for m in turn.messages]
  assert not turn.done and len(said) == len(calls)
  assert said[0] == "error: CalcError: division by zero"
  assert said[1].startswith("error: unknown tool 'nope'; tools: calculator, sleep, flood, fail")
  assert said[2].startswith("error: malformed tool call: not JSON")
  assert "time limit" in said[3] and "output cut at 40" in said[4] and "RuntimeError" in said[5]
  assert said[6].startswith("error: TypeError: calculator() got an un")  # cut at max_chars=40
  assert episode.metrics == EnvMetrics(turns=1, tool_calls=7, malformed_calls=1, unknown_tools=1,
                                       tool_errors=3, tool_timeouts=1, tool_floods=1)
  assert episode.step("1").done and episode.score() == 1.0


def test_the_turn_limit_ends_an_episode_that_keeps_calling():
  episode = _env(max_turns=2).start(Problem(prompt="p", answer="5", id=0))
  call = _call("calculator", '{"expression": "2 + 3"}')
  assert not episode.step(call).done
  assert episode.step(call).done
  assert episode.metrics.turn_limit == 1 and episode.metrics.tool_calls == 1
  assert episode.score() == 0.0  # the last turn's text is scored: a call, not an answer
  assert episode.step("5").done and episode.metrics.turns == 2  # over: nothing more is answered


def test_the_registry_builds_the_calculator_on_the_configs_task_and_checks_its_settings():
  c = config_lib.repo_config("tiny.py")
  assert make_env(c.env, None) is None  # env.name None: single-turn answers
  c.env.name = "calculator"
  config_lib.validate(c)

  class Task:
    def score(self, response, problem):
      return float(response.strip() == problem.answer)

  env = make_env(c.env, Task())
  assert set(ENVS) >= {"calculator"} and env.tools[0]["function"]["name"] == "calculator"
  episode = env.start(Problem(prompt="2+3?", answer="5", id=0))
  assert episode.step(_call("calculator", '{"expression": "2+3"}')).messages[0]["content"] == "5"
  assert episode.step("5").done and episode.score() == 1.0
  for setting, value in (("name", "no_such_env"), ("max_turns", 0), ("tool_timeout_s", 0.0),
                         ("tool_output_chars", 0)):
    bad = config_lib.repo_config("tiny.py")
    bad.env[setting] = value
    with pytest.raises(ConfigError, match=f"env.{setting}"):
      config_lib.validate(bad)
