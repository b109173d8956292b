"""The Python tool (oapl_jax/envs/python_tool.py): the model's programs run in the bubblewrap
sandbox through the Environment/Episode interface, every failure an observation and a count;
the `python` environment in the registry and configs/math.py:tools."""

import json
import logging
import socket
import time

import pytest

from configs import math as math_config
from oapl_jax import config as config_lib
from oapl_jax.envs import ENVS, EnvMetrics, make_env
from oapl_jax.envs.python_tool import make_python_env
from oapl_jax.envs.tool_env import Limits, Tool, ToolEnvironment
from oapl_jax.errors import ConfigError
from oapl_jax.rewards import sandbox
from oapl_jax.tasks.base import Problem


class _LastLine:
  """A task whose score is 1 when the answer's last word is the problem's answer."""

  def score(self, response, problem):
    return float(response.split()[-1:] == [problem.answer])


def _env(**settings):
  c = config_lib.repo_config("tiny.py")
  c.env.name = "python"
  c.env.tool_timeout_s = 1.0
  c.env.tool_output_chars = 200
  c.env.update(settings)
  return make_env(c.env, _LastLine())


def _call(code):
  return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


PROBLEM = Problem(prompt="What is 2**100 mod 7?", answer="2", id=0)


def test_a_program_runs_in_the_sandbox_and_its_output_is_the_observation(requires_sandbox):
  episode = _env().start(PROBLEM)
  turn = episode.step("Let me compute it. " + _call("print(pow(2, 100, 7))\nprint('in', __name__)"))
  assert turn.done is False and turn.messages == [{"role": "tool", "content": "2\nin __main__\n"}]
  turn = episode.step(_call("import os\nprint(os.getuid() != 0, os.getcwd(), sorted(os.listdir('/box')))\n"
                            "x = [1, 2]\nprint(x[5])"))
  said = turn.messages[0]["content"]
  # runs unprivileged in /tmp, sees only its own files; a raise shows stdout and the error's last line
  assert said == "True /tmp ['code.py', 'driver.py']\nIndexError: list index out of range", said
  assert episode.step("The answer is 2").done and episode.score() == 1.0
  assert episode.metrics == EnvMetrics(turns=3, tool_calls=2, tool_ok=1, tool_errors=1)


def test_a_program_that_never_halts_is_stopped_at_its_limit_and_the_episode_goes_on(requires_sandbox):
  episode = _env().start(PROBLEM)
  t0 = time.perf_counter()
  turn = episode.step(_call("print('started', flush=True)\nwhile True:\n  pass"))
  took = time.perf_counter() - t0
  assert turn.messages[0]["content"] == "started\nerror: the program was stopped after 1 s (time limit)"
  assert 1.0 <= took < 5.0, took
  turn = episode.step(_call("print(6 * 7)"))
  assert turn.messages[0]["content"] == "42\n" and not turn.done
  assert episode.metrics == EnvMetrics(turns=2, tool_calls=2, tool_ok=1, tool_timeouts=1)


def test_a_flood_of_output_is_cut_and_a_crash_or_memory_hog_reported(requires_sandbox):
  episode = _env().start(PROBLEM)
  t0 = time.perf_counter()
  turn = episode.step(_call("while True:\n  print('spam' * 100)") + _call("print('y' * 201)")
                      + _call("import os\nos.kill(os.getpid(), 9)") + _call("b = bytearray(10 ** 10)"))
  took = time.perf_counter() - t0
  said = [m["content"] for m in turn.messages]
  assert said[0] == ("spam" * 100)[:200] + "\n[output cut at 200 characters; the program was stopped]"
  assert said[1] == "y" * 200 + "\n[output cut at 200 characters]"  # exited on its own, still cut
  assert said[2] == "the program was killed by SIGKILL"
  assert said[3] == "MemoryError (the memory limit is 512 MiB)"
  assert took < 5.0, took  # the endless flood is stopped at its cap, not at the time limit
  assert episode.metrics == EnvMetrics(turns=1, tool_calls=4, tool_floods=2, tool_errors=2)


def test_the_network_is_unreachable_from_inside(requires_sandbox):
  listener = socket.create_server(("127.0.0.1", 0))
  listener.setblocking(False)
  port = listener.getsockname()[1]
  try:
    episode = _env().start(PROBLEM)
    turn = episode.step(_call(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                              "print('reached the host')"))
    said = turn.messages[0]["content"]
    assert said.startswith("ConnectionRefusedError") and "reached" not in said, said
    with pytest.raises(BlockingIOError):
      listener.accept()  # nothing came through
  finally:
    listener.close()
  assert episode.metrics.tool_errors == 1


def test_malformed_calls_and_bad_arguments_are_observations():
  episode = _env().start(PROBLEM)  # no sandbox needed: none of these runs a program
  turn = episode.step('<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
                      '<tool_call>{"name": "python", "arguments": {"program": "print(1)"}}</tool_call>'
                      '<tool_call>{"name": "python", "arguments": {"code": 3}}</tool_call>'
                      '<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>')
  said = [m["content"] for m in turn.messages]
  assert said[0].startswith("error: malformed tool call: not JSON")
  assert said[1] == said[2] == 'error: the python tool takes {"code": "<a Python program>"}'
  assert said[3] == "error: unknown tool 'shell'; tools: python"
  assert episode.metrics == EnvMetrics(turns=1, tool_calls=4, malformed_calls=1, unknown_tools=1,
                                       tool_errors=2)


def test_without_bubblewrap_a_call_is_refused_as_an_observation_said_once(monkeypatch, caplog):
  monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
  episode = _env().start(PROBLEM)
  with caplog.at_level(logging.ERROR):
    turn = episode.step(_call("print(1)") + _call("print(2)"))
  said = [m["content"] for m in turn.messages]
  assert said == ["error: the python tool cannot run code here (no working sandbox)"] * 2
  assert episode.metrics == EnvMetrics(turns=1, tool_calls=2, sandbox_errors=2)
  logged = [r.getMessage() for r in caplog.records if "env python" in r.getMessage()]
  assert len(logged) == 1 and "bubblewrap" in logged[0] and "config.env.allow_unsandboxed=False" in logged[0]
  assert "\n" not in logged[0]


def test_allow_unsandboxed_runs_the_program_bare_with_a_warning(monkeypatch):
  monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
  episode = _env(allow_unsandboxed=True).start(PROBLEM)
  with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
    turn = episode.step(_call("print(6 * 7)"))
  assert turn.messages[0]["content"] == "42\n" and episode.metrics.tool_ok == 1


def test_the_registry_and_math_tools_config_offer_the_python_tool():
  assert "python" in ENVS
  c = math_config.get_config("tiny,tools")
  config_lib.validate(c, dry_run=True)
  assert (c.env.name, c.env.max_turns, c.env.allow_unsandboxed) == ("python", 8, False)
  assert math_config.get_config("tiny").env.name is None  # the other variants offer no tool
  env = make_python_env(c.env, _LastLine())
  schema = env.tools[0]["function"]  # as apply_chat_template(tools=...) takes it
  assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
  runner = env.tools_by_name["python"].run
  assert (runner.timeout_s, runner.max_chars, runner.memory_mb) == (10.0, 2000, 1024)
  for setting, value in (("sandbox_memory_mb", 32), ("allow_unsandboxed", None)):
    bad = math_config.get_config("tiny,tools")
    bad.env[setting] = value
    with pytest.raises(ConfigError, match=f"env.{setting}"):
      config_lib.validate(bad, dry_run=True)


def test_a_runner_that_raises_is_an_observation_never_an_exception():
  def broken(arguments):
    raise OSError("no space left")

  env = ToolEnvironment([Tool("python", "runs code", {"type": "object"}, run=broken)],
                        Limits(max_turns=4, timeout_s=1.0, max_chars=100), _LastLine().score)
  episode = env.start(PROBLEM)
  assert episode.step(_call("print(1)")).messages[0]["content"] == "error: OSError: no space left"
  assert episode.metrics == EnvMetrics(turns=1, tool_calls=1, tool_errors=1)
