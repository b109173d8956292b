"""The Python environment: the model may run programs in the bubblewrap sandbox before it answers.

One tool, `python(code)`. Each call runs `code` as a fresh program in the sandbox of the code
reward (rewards/sandbox.py: no network, a read-only file system but for a small private /tmp,
rlimits on memory, CPU time and processes, a wall-clock limit, an output cap), then the sandbox
is gone: nothing is kept between calls, so a program that needs an earlier result recomputes it.
The model is shown what the program printed on stdout and, when it raised, the exception's last
line (`ZeroDivisionError: division by zero`); stderr is not shown. The interpreter is the base
interpreter of this one, with its own packages (not the trainer's virtual environment's).

What a call comes to (`ToolResult.status`, counted in `EnvMetrics`):

  "ok"       ran and exited 0: its stdout (a note when it printed nothing)
  "error"    raised or exited nonzero, was killed (memory, CPU), or the call's arguments were not
             {"code": str}: its stdout and the error's line
  "timeout"  still running at `env.tool_timeout_s`: killed; what it printed so far and a note
  "flood"    printed more than `env.tool_output_chars` characters: cut there (stopped at ~4x that)
  "sandbox"  not run: bubblewrap is missing (and `env.allow_unsandboxed` is False) or the
             sandbox does not start here; said once in the log, in one line, and to the model

The tool keeps its own limits, so it runs in the environment's process (`Tool.run`): the sandbox
is a child process killed at its limit; no call raises out of the episode. The final answer
(the model's plain turn) is scored by the config's task (`task.score`), as the calculator's.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading

from oapl_jax.envs.tool_env import Limits, Tool, ToolEnvironment
from oapl_jax.envs.tools import ToolResult
from oapl_jax.rewards import sandbox

_log = logging.getLogger(__name__)

MAX_PROCESSES = 16  # tasks (processes + threads) per sandbox
TMPFS_MB = 16  # the sandbox's writable /tmp
ERROR_CHARS = 300  # longest error line shown

# Trusted: runs inside the sandbox before the model's code (argv: this file, the code's file).
# The code's stderr goes to /dev/null; the exception's last line goes to the real stderr (fd 2
# as the sandbox gave it), which is all the caller reads there.
_DRIVER = """\
import os, sys


def _report(line):
  os.write(_ERR, (line.replace("\\n", " ") + "\\n").encode("utf-8", "replace"))


_ERR = os.dup(2)
_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 2)
with open(sys.argv[1], encoding="utf-8", errors="replace") as _f:
  _source = _f.read()
sys.argv = ["<code>"]
_scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
  exec(compile(_source, "<code>", "exec"), _scope)
except SystemExit as e:
  if e.code not in (None, 0):
    sys.stdout.flush()
    _report(f"SystemExit: {e.code}")
    os._exit(1)
except BaseException as e:
  try:
    sys.stdout.flush()
  except BaseException:
    pass
  text = str(e)
  _report(f"{type(e).__name__}: {text}" if text else type(e).__name__)
  os._exit(1)
sys.stdout.flush()
"""


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


class PythonTool:
  """The `python` tool's runner (`Tool.run`): `tool({"code": ...})` -> ToolResult; never raises
  for anything the code does. Settings as `env` holds them (timeout_s: env.tool_timeout_s,
  max_chars: env.tool_output_chars, memory_mb: env.sandbox_memory_mb, allow_unsandboxed:
  env.allow_unsandboxed). The sandbox is set up (and checked, once) at the first call."""

  def __init__(self, *, timeout_s: float, max_chars: int, memory_mb: int, allow_unsandboxed: bool,
               python: str | None = None, tmp_dir: str | None = None):
    self.timeout_s, self.max_chars = float(timeout_s), int(max_chars)
    self.memory_mb, self.allow_unsandboxed = int(memory_mb), bool(allow_unsandboxed)
    self.python, self.tmp_dir = python, tmp_dir
    self._lock = threading.Lock()
    self._settings: sandbox.Settings | None = None
    self._unavailable: str | None = None  # why no call can run here (said once in the log)

  def _sandbox(self) -> sandbox.Settings | None:
    with self._lock:
      if self._settings is None and self._unavailable is None:
        try:
          # A UTF-8 character is at most 4 bytes: this many bytes hold max_chars + 1 characters.
          s = sandbox.settings(self.timeout_s, self.memory_mb, 4 * self.max_chars + 4, MAX_PROCESSES,
                               self.allow_unsandboxed, self.python, self.tmp_dir, TMPFS_MB)
          if s.sandboxed:
            sandbox.check(s)
          self._settings = s
        except (RuntimeError, OSError) as e:
          why = str(e).splitlines()[0] if str(e) else type(e).__name__
          self._unavailable = why
          _log.error("env python: no program is run here, each call is answered with an error: %s "
                     "(config.env.allow_unsandboxed=%s)", why, self.allow_unsandboxed)
      return self._settings

  def __call__(self, arguments: dict) -> ToolResult:
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str) or set(arguments) != {"code"}:
      return ToolResult('error: the python tool takes {"code": "<a Python program>"}', "error")
    s = self._sandbox()
    if s is None:
      return ToolResult("error: the python tool cannot run code here (no working sandbox)", "sandbox")
    workdir = sandbox.make_workdir({"driver.py": _DRIVER, "code.py": code}, self.tmp_dir)
    try:
      r = sandbox.run_in(workdir, ["driver.py", "code.py"], [], b"", s)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
    return self._result(r)

  def _result(self, r: sandbox.RunResult) -> ToolResult:
    if r.status == "sandbox_error":
      why = r.stderr.decode(errors="replace").strip().splitlines()
      _log.error("env python: the sandbox did not start: %s", why[0] if why else "(no message)")
      return ToolResult("error: the python tool's sandbox did not start", "sandbox")
    text = r.stdout.decode("utf-8", errors="replace")
    stopped = r.status == "output_limit"
    cut = stopped or len(text) > self.max_chars
    if cut:
      text = (text[:self.max_chars] + f"\n[output cut at {self.max_chars} characters"
              + ("; the program was stopped" if stopped else "") + "]")
    sep = "\n" if text and not text.endswith("\n") else ""
    if r.status == "timeout":
      return ToolResult(f"{text}{sep}error: the program was stopped after {self.timeout_s:g} s (time limit)",
                        "timeout")
    if r.status == "ok" or stopped:
      if not text:
        text = "(the program printed nothing; print what you want to see)"
      return ToolResult(text, "flood" if cut else "ok")
    lines = r.stderr.decode("utf-8", errors="replace").strip().splitlines()
    code = r.returncode
    if lines:
      why = lines[-1][:ERROR_CHARS]
      if why == "MemoryError":
        why += f" (the memory limit is {self.memory_mb} MiB)"
    elif code is not None and (code < 0 or code > 128):  # bwrap's PID 1 reports a signal as 128 + it
      why = f"the program was killed by {_signal_name(-code if code < 0 else code - 128)}"
    else:
      why = f"the program exited with code {code}"
    return ToolResult(f"{text}{sep}{why}", "flood" if cut else "error")


DESCRIPTION = ("Run a Python program (no network, nothing kept between calls) and see what it prints "
               "on stdout; print the values you need.")
PARAMETERS = {"type": "object",
              "properties": {"code": {"type": "string", "description": "the Python program to run"}},
              "required": ["code"]}


def make_python_env(env_config, task) -> ToolEnvironment:
  """The Python environment on `task` (its `score` scores the final answer). env_config: the
  config's `env` section (limits, sandbox settings)."""
  runner = PythonTool(timeout_s=env_config.tool_timeout_s, max_chars=env_config.tool_output_chars,
                      memory_mb=env_config.sandbox_memory_mb, allow_unsandboxed=env_config.allow_unsandboxed)
  tool = Tool(name="python", description=DESCRIPTION, parameters=PARAMETERS, run=runner)
  return ToolEnvironment([tool], Limits(max_turns=env_config.max_turns, timeout_s=env_config.tool_timeout_s,
                                        max_chars=env_config.tool_output_chars), getattr(task, "score", None))
