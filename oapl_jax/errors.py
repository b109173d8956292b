"""Errors a user can cause (a setting, a file, a row, a workdir, a signal).

The command-line entry points print a `UserError` (or an `Interrupted`) as one line on stderr and exit with its
`exit_code` (2 unless it says otherwise); a traceback is only for bugs (or with `--verbose`).
Ctrl-C outside a run's loop is one line and exit code 130; `--help` exits 0.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


INTERRUPTED_EXIT = 130  # the shell's 128 + SIGINT
HELP_FLAGS = ("--help", "-?", "--helpshort", "--helpfull", "--help=true", "--helpfull=true")


class UserError(Exception):
  """Something the user can fix; its message names the setting, file or workdir."""

  exit_code = 2


class ConfigError(UserError, ValueError):
  """A setting has a value the run cannot use (the message names it: `config.rl.lag=0: ...`)."""


class Interrupted(BaseException):
  """The command was stopped by a signal (SIGTERM / SIGINT); `exit_code` is the shell's 128 +
  the signal number. Printed as one line, as a `UserError` is.

  A `BaseException`, as `KeyboardInterrupt` is, so that code guarding against its own failures
  with `except Exception` lets it through: JAX's compiler reads its persistent cache so (a
  SIGTERM landing there was logged as an unreadable cache entry and the command went on), a
  reward's guard would score the answer 0, and a checkpoint's restore would call the step
  damaged."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


def one_line(message: str) -> str:
  r"""`message` on one line: "a:\n  b\n  c" -> "a: b; c"."""
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  out = lines[0] if lines else ""
  for line in lines[1:]:
    out += (" " if out.endswith(":") else "; ") + line
  return out


def stopped_by(e: BaseException) -> Interrupted | None:
  """The `Interrupted` that `e` was raised while handling, if any (its `__context__` chain): a
  stop signal's exception raised inside library code whose own cleanup then failed (tqdm's
  write lock, half made when the SIGTERM landed, raised AttributeError on its way out, and the
  sampler job exited 1 with a traceback instead of 143 with one line). Such an error is the
  stop's consequence, not a bug of its own."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, Interrupted):
      return e
    seen.add(id(e))
    e = e.__context__
  return None


def run_command(main: Callable[[list[str]], Any]) -> None:
  """Runs an absl `main(argv)` with `app.run`, as a command: a `UserError` is printed as
  `error: <message>` on one line of stderr and the process exits with its `exit_code`; with
  `--verbose` the traceback is printed instead (same exit code). Other exceptions are bugs
  and keep absl's traceback."""
  from absl import app, flags  # noqa: PLC0415 (absl only for the commands)
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "On an error a user can cause (a refused setting, a "
                      "missing file), print the Python traceback instead of one line.")

  def wrapped(argv):
    try:
      with said_once():
        return main(argv)
    except (UserError, Interrupted) as e:
      if flags.FLAGS.verbose:
        traceback.print_exc()
      else:
        print(f"error: {one_line(e)}", file=sys.stderr)
      sys.stderr.flush()
      sys.exit(e.exit_code)
    except Exception as e:
      stop = stopped_by(e)
      if stop is None:
        raise  # a bug: absl's traceback
      if flags.FLAGS.verbose:
        traceback.print_exc()
      print(f"error: {one_line(stop)}", file=sys.stderr, flush=True)
      sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C where no StopSignals handler turns it into a clean stop
      if flags.FLAGS.verbose:
        traceback.print_exc()
      print("error: stopped by Ctrl-C (SIGINT)", file=sys.stderr, flush=True)
      # out at once, without the interpreter's teardown: interrupted mid-computation, XLA's
      # threads were seen to crash it (a segfault, exit -11, after the line above); nothing
      # is left to flush (outputs are written whole, elsewhere, before they count)
      sys.stdout.flush()
      os._exit(INTERRUPTED_EXIT)

  def parse(argv):
    """The command line; a flag it cannot take (an unknown or malformed setting, a config file
    that is missing, fails to load, lacks get_config or refuses its `:variant`) is one line and
    exit code 2 (`--verbose`: the traceback)."""
    if any(a in HELP_FLAGS for a in argv[1:argv.index("--") if "--" in argv else len(argv)]):
      try:
        flags.FLAGS(argv)  # absl prints the usage, then exits 1: asking for help is no error
      except SystemExit as e:
        sys.exit(0 if e.code in (0, 1, None) else e.code)
    problem = not_a_config_file(argv)
    if problem:  # refused before the file is executed (flags would run it)
      print(f"error: {problem}", file=sys.stderr, flush=True)
      sys.exit(2)
    try:
      return flags.FLAGS(argv)
    except Exception as e:  # absl's flags.Error, or what loading the config file raised
      if "--verbose" in argv:
        traceback.print_exc()
      else:
        print(f"error: {_flag_error(e, argv)}", file=sys.stderr)
      sys.stderr.flush()
      sys.exit(2)

  app.run(wrapped, flags_parser=parse)


def _flag_error(e: BaseException, argv: list[str]) -> str:
  """One line for an error of the command line: absl's message, or the config file's error
  (`--config=c.py: the config file did not load: AttributeError: ... 'get_config'`)."""
  from absl import flags  # noqa: PLC0415
  text = str(e)
  if isinstance(e, flags.Error) and "Traceback (most recent call last)" not in text:
    return one_line(text)
  if isinstance(e, flags.Error):  # the config file raised: its last line says what
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = lines[-1]
  else:
    cause = e
    while cause.__cause__ is not None:
      cause = cause.__cause__
    why = f"{type(cause).__name__}: {cause}"
  spec = next((a for a in argv if a.startswith("--config=")), "--config")
  return one_line(f"{spec}: the config file did not load: {why}")


def not_a_config_file(argv: list[str]) -> str | None:
  """Why `--config=FILE[:arg]` names no config file, read without running it (a .py file
  whose top level defines `get_config`); None if it does, or names no file (absl says so)."""
  spec = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if spec is None:
    return None
  path = spec.partition(":")[0]
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
  except (OSError, SyntaxError, ValueError) as e:
    return f"--config={spec}: the config file did not load: {type(e).__name__}: {one_line(e)}"
  names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)}
  names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
  if "get_config" in names:
    return None
  return (f"--config={spec}: the config file did not load: AttributeError: it defines no "
          "get_config() at its top level: not a config file (it was not run; configs/tiny.py is one)")


class _NotSaidTwice:
  """A logging filter: drops records a module has already printed as a plain console line
  (logged with `extra={"said": True}`), so absl's handler does not print them again."""

  @staticmethod
  def filter(record) -> bool:
    return not getattr(record, "said", False)


@contextlib.contextmanager
def said_once():
  """For a command's duration, keeps its logging from printing a record a second time: the lock
  take-over or a damaged checkpoint is one plain line on stderr, not also a `W1206 ...` (absl's
  handler) or a `WARNING:root:...` (the plain handler that absl's first log call sets up outside
  `app.run`, as in the study commands: set up here instead, filtered). The filters it adds are
  removed on the way out, so a command's main called in-process (a notebook, a test) leaves the
  caller's handlers as they were (pytest's log capture once lost every later take-over so)."""
  from absl import logging as absl_logging  # noqa: PLC0415
  root = logging.getLogger()
  if not root.handlers:
    logging.basicConfig()  # what absl's first log call would do (a no-op once a handler exists)
  added = []
  for handler in (*root.handlers, absl_logging.get_absl_handler()):
    if not any(isinstance(f, _NotSaidTwice) for f in handler.filters):
      kept = _NotSaidTwice()
      handler.addFilter(kept)
      added.append((handler, kept))
  try:
    yield
  finally:
    for handler, kept in added:
      handler.removeFilter(kept)
