"""Errors a user can cause (a setting, a file, a row, a workdir, a signal).

The command-line entry points print a `UserError` as one line on stderr and exit with its
`exit_code` (2 unless it says otherwise); a traceback is only for bugs (or with `--verbose`).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any


class UserError(Exception):
  """Something the user can fix; its message names the setting, file or workdir."""

  exit_code = 2


class ConfigError(UserError, ValueError):
  """A setting has a value the run cannot use (the message names it: `config.rl.lag=0: ...`)."""


def one_line(message: str) -> str:
  r"""`message` on one line: "a:\n  b\n  c" -> "a: b; c"."""
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  out = lines[0] if lines else ""
  for line in lines[1:]:
    out += (" " if out.endswith(":") else "; ") + line
  return out


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
      return main(argv)
    except UserError as e:
      if flags.FLAGS.verbose:
        traceback.print_exc()
      else:
        print(f"error: {one_line(e)}", file=sys.stderr)
      sys.stderr.flush()
      sys.exit(e.exit_code)

  def parse(argv):
    """The command line; a flag it cannot take (an unknown or malformed setting, a config file
    that is missing, fails to load, lacks get_config or refuses its `:variant`) is one line and
    exit code 2 (`--verbose`: the traceback)."""
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
