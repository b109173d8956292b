"""Code reward: run a generated Python program on its tests inside a bubblewrap sandbox.

:func:`score` takes a program and tests in the APPS / TACO / DeepCoder form
``{"inputs": [...], "outputs": [...]}`` (a JSON string of that is accepted too):

* **stdin/stdout** (no ``fn_name``): the program runs with ``inputs[i]`` on stdin; its stdout
  must equal ``outputs[i]`` after normalising line endings, trailing whitespace on each line and
  trailing blank lines. It must also exit with status 0. A list of lines stands for the lines
  joined with ``"\\n"`` (old APPS rows).
* **call-based** (``"fn_name"`` set): a trusted driver, written next to the program, loads it as
  a module (after ``from typing import *`` and a few LeetCode-style imports, so ``List[int]``
  annotations work), calls ``Solution().fn_name(*args)`` if the program defines a class
  ``Solution`` with that method, else the module-level ``fn_name(*args)``, and prints
  ``json.dumps(result)`` on its own copy of stdout (the program's prints go to stderr).
  ``inputs[i]`` is the argument list (a non-list is one argument). The trusted side parses the
  JSON and compares plain values (bool is not a number here; tuples arrive as lists), passing if
  the result equals ``outputs[i]`` or, as in APPS, ``outputs[i][0]`` when that is a one-element
  list. An object that "equals everything" cannot pass: it does not survive JSON.

The reward is 1.0 if every test passes, else 0.0 (with ``fraction=True``: the fraction passed;
without it the first failure stops the run). A crash, timeout, oversized output, wrong output
or sandbox failure fails that test; :func:`score` never raises because of what the program
does. :func:`score_batch` scores many programs on a thread pool (each run is a subprocess).
:func:`from_livecodebench` (``oapl_jax/data/code_tests.py``, where every layout of tests is
read) converts LiveCodeBench test lists to the form above.

Sandbox (``oapl_jax/rewards/sandbox.py``, where its isolation and limits are described): each
test is one fresh sandbox; the expected outputs never enter it. Without ``bwrap``,
:func:`score` raises ``RuntimeError`` unless ``allow_unsandboxed=True``: then the program runs
directly under rlimits only, with a loud warning. That is NOT safe for untrusted code.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import shutil
from typing import Any, Sequence

from oapl_jax.data.code_tests import from_livecodebench  # noqa: F401 (re-exported)
from oapl_jax.rewards import sandbox
from oapl_jax.rewards.sandbox import RunResult

_log = logging.getLogger(__name__)


# What a LeetCode-style solution may use without importing it.
_PRELUDE = """\
from typing import *
import bisect, collections, functools, heapq, itertools, math, operator, re, string
from collections import Counter, OrderedDict, defaultdict, deque
from functools import cache, lru_cache, reduce
from heapq import heapify, heappop, heappush, heappushpop, heapreplace, nlargest, nsmallest
from bisect import bisect, bisect_left, bisect_right, insort, insort_left, insort_right
from itertools import accumulate, combinations, permutations, product
from math import ceil, comb, floor, gcd, inf, isqrt, lcm, log, log2, sqrt
"""

# Call-based driver: argv = program path, function name; stdin = JSON list of arguments.
_DRIVER = """\
import importlib.util, json, os, sys


def _main():
  prog, fn_name = sys.argv[1], sys.argv[2]
  args = json.loads(sys.stdin.buffer.read().decode("utf-8"))
  out = os.dup(1)  # the result goes here; the program's own prints go to stderr
  os.dup2(2, 1)
  sys.argv = [prog]
  spec = importlib.util.spec_from_file_location("solution", prog)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["solution"] = mod
  exec(PRELUDE, mod.__dict__)
  spec.loader.exec_module(mod)
  cls = getattr(mod, "Solution", None)
  if isinstance(cls, type) and hasattr(cls, fn_name):
    fn = getattr(cls(), fn_name)
  else:
    fn = getattr(mod, fn_name)
  data = json.dumps(fn(*args)).encode("utf-8")
  view = memoryview(data)
  while view:
    view = view[os.write(out, view):]
  os._exit(0)


PRELUDE = %r
_main()
""" % _PRELUDE


@dataclasses.dataclass(frozen=True)
class _Case:
  stdin: bytes
  expected: Any


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def _plain(value):
  """A JSON round trip: tuples become lists, dict keys strings; raises on non-JSON values."""
  return json.loads(json.dumps(value))


def _parse_tests(tests) -> tuple[str | None, list[_Case]]:
  if isinstance(tests, (str, bytes)):
    tests = json.loads(tests)
  inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
  if len(inputs) != len(outputs):
    raise ValueError(f"tests: {len(inputs)} inputs but {len(outputs)} outputs")
  fn_name = tests.get("fn_name") or None
  cases = []
  for inp, out in zip(inputs, outputs):
    if fn_name is not None:
      args = inp if isinstance(inp, list) else [inp]
      cases.append(_Case(json.dumps(args).encode("utf-8"), _plain(out)))
    else:
      if isinstance(inp, list):
        inp = "\n".join(map(str, inp))
      if isinstance(out, list):
        out = "\n".join(map(str, out))
      cases.append(_Case(str(inp).encode("utf-8"), str(out)))
  return fn_name, cases


def _lines(text: str) -> list[str]:
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
  while lines and not lines[-1]:
    lines.pop()
  return lines


def _json_equal(a, b) -> bool:
  """== on parsed JSON values, except that a bool only equals a bool."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
  if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
    return False
  return a == b


def _passes(fn_name: str | None, case: _Case, result: RunResult) -> bool:
  if result.status != "ok":
    return False
  text = result.stdout.decode("utf-8", errors="replace")
  if fn_name is None:
    return _lines(text) == _lines(case.expected)
  try:
    got = json.loads(text)
  except ValueError:
    return False
  exp = case.expected
  return _json_equal(got, exp) or (
      isinstance(exp, list) and len(exp) == 1 and _json_equal(got, exp[0]))


def _files(program: str, fn_name: str | None) -> tuple[dict[str, str], list[str], list[str]]:
  """(workdir files, the files to run, extra arguments): the program itself, or with
  `fn_name` the call-based driver on it."""
  if fn_name is None:
    return {"prog.py": program}, ["prog.py"], []
  return {"prog.py": program, "driver.py": _DRIVER}, ["driver.py", "prog.py"], [fn_name]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def run_program(program: str, stdin: str | bytes = b"", *, fn_name: str | None = None,
                timeout_s: float, memory_mb: int, max_output_bytes: int = 1 << 20,
                max_processes: int = 32, allow_unsandboxed: bool = False,
                python: str | None = None, tmp_dir: str | None = None,
                tmpfs_mb: int = 64) -> RunResult:
  """Runs `program` once in the sandbox and returns what happened (for debugging and tests).

  With `fn_name`, `stdin` is the JSON list of arguments and stdout the JSON result. Settings:
  see :func:`score`.
  """
  s = sandbox.settings(timeout_s, memory_mb, max_output_bytes, max_processes, allow_unsandboxed,
                       python, tmp_dir, tmpfs_mb)
  if s.sandboxed:
    sandbox.check(s)
  files, run, args = _files(program, fn_name)
  workdir = sandbox.make_workdir(files, tmp_dir)
  try:
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    return sandbox.run_in(workdir, run, args, data, s)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def score(program: str, tests, *, timeout_s: float, memory_mb: int,
          max_output_bytes: int = 1 << 20, max_processes: int = 32, fraction: bool = False,
          allow_unsandboxed: bool = False, python: str | None = None,
          tmp_dir: str | None = None, tmpfs_mb: int = 64) -> float:
  """Reward of `program` on `tests` (see the module docstring): 1.0 if all pass, else 0.0,
  or with `fraction=True` the fraction of tests passed.

  timeout_s: wall-clock limit per test (CPU limit: the same, rounded up, plus 1 s).
  memory_mb: address-space limit of the program. These two have no default here: a run takes
  them from its config (`task.timeout_s`, `task.memory_mb` of configs/code.py), their one owner.
  max_output_bytes: stdout cap per test.
  max_processes: task limit (processes + threads) per sandbox. python: the interpreter to run
  programs with (default: this one's base interpreter). tmp_dir: where the per-run directories
  are made (default: tempfile's). tmpfs_mb: size of the sandbox's writable /tmp.
  Raises RuntimeError if bwrap is missing (unless allow_unsandboxed) or does not work, and
  ValueError for malformed tests; never because of the program's behaviour.
  """
  s = sandbox.settings(timeout_s, memory_mb, max_output_bytes, max_processes, allow_unsandboxed,
                       python, tmp_dir, tmpfs_mb)
  fn_name, cases = _parse_tests(tests)
  if not cases:
    return 0.0
  if s.sandboxed:
    sandbox.check(s)
  passed = 0
  files, run, args = _files(program, fn_name)
  workdir = sandbox.make_workdir(files, tmp_dir)
  try:
    for case in cases:
      try:
        ok = _passes(fn_name, case, sandbox.run_in(workdir, run, args, case.stdin, s))
      except Exception:  # noqa: BLE001 (a reward must not crash training; log and fail the test)
        _log.exception("code reward: unexpected error while running a test")
        ok = False
      passed += ok
      if not ok and not fraction:
        break
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if fraction:
    return passed / len(cases)
  return float(passed == len(cases))


def score_batch(programs: Sequence[str], tests: Sequence, *, workers: int = 2,
                **settings) -> list[float]:
  """[score(p, t, **settings) for p, t in zip(programs, tests)], `workers` at a time
  (`settings` must hold score's `timeout_s` and `memory_mb`)."""
  if len(programs) != len(tests):
    raise ValueError(f"{len(programs)} programs but {len(tests)} test sets")
  fn = functools.partial(score, **settings)
  if workers <= 1 or len(programs) <= 1:
    return [fn(p, t) for p, t in zip(programs, tests)]
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                             thread_name_prefix="code_reward") as ex:
    return list(ex.map(fn, programs, tests))


__all__ = ["RunResult", "from_livecodebench", "run_program", "score", "score_batch"]
