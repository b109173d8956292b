"""Errors a user can cause (a setting, a file, a row, a workdir, a signal).

The command-line entry points print a `UserError` as one line on stderr and exit with its
`exit_code` (2 unless it says otherwise); a traceback is only for bugs (or with `--verbose`).
"""

from __future__ import annotations


class UserError(Exception):
  """Something the user can fix; its message names the setting, file or workdir."""

  exit_code = 2
