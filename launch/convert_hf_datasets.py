"""Converts locally downloaded Hugging Face files of the paper's datasets to our JSONL format.

  python launch/convert_hf_datasets.py --recipe=RECIPE --out=OUT.jsonl INPUT [INPUT ...]

Inputs are .parquet files (or .jsonl / .json: some datasets ship those); several inputs (the
shards of one split, or AIME I and II) go into one output. Output rows:

  math recipes  {"problem": str, "answer": str}
  code recipes  {"problem": str, "tests": {"inputs": [...], "outputs": [...][, "fn_name": str]}}

which configs/math.py and configs/code.py read with their default field names. Rows are
de-duplicated by normalised problem text (the first is kept); malformed rows are skipped and
reported with file and row (or, with --strict, stop the conversion). The output is written
only when everything has been read, through a temporary file, so a failed run leaves an
existing output as it was. Recipes, their datasets and fields: docs/datasets.md; the layouts
of tests read, and the check every converted row passes: oapl_jax/data/code_tests.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oapl_jax.data.code_tests import (from_deepcoder, from_livecodebench,  # noqa: E402
                                      metadata_func_name, parse_tests)
from oapl_jax.data.sources import dedup, read_rows  # noqa: E402

QUESTION_FIELDS = ("problem", "question", "Problem", "Question")
ANSWER_FIELDS = ("answer", "Answer", "final_answer")
STARTER = ("You will use the following starter code to write the solution to the problem:\n"
           "```python\n{code}\n```")


def _first(row: dict, names: tuple[str, ...], what: str):
  for name in names:
    if row.get(name) is not None:
      return row[name]
  raise ValueError(f"no {what} field (looked for {', '.join(names)}; row has {sorted(row)})")


def _text(value, what: str) -> str:
  if not isinstance(value, str) or not value.strip():
    raise ValueError(f"{what} must be a non-empty string, got {type(value).__name__} {value!r:.40}")
  return value.strip()


def _answer(value) -> str:
  if isinstance(value, bool):
    raise ValueError(f"answer must be text or a number, got {value!r}")
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if isinstance(value, (int, float)):
    value = str(value)
  return _text(value, "answer")


def math_row(row: dict) -> dict:
  """DeepScaleR / AIME / HMMT / BRUMO row -> {"problem", "answer"} (other fields dropped)."""
  return {"problem": _text(_first(row, QUESTION_FIELDS, "question"), "problem"),
          "answer": _answer(_first(row, ANSWER_FIELDS, "answer"))}


def _with_starter(problem: str, row: dict) -> str:
  starter = row.get("starter_code")
  if isinstance(starter, str) and starter.strip():
    return problem + "\n\n" + STARTER.format(code=starter.strip("\n"))
  return problem


def deepcoder_row(row: dict) -> dict:
  """DeepCoder training row (problem, tests[, metadata, starter_code]) -> {"problem", "tests"}."""
  problem = _with_starter(_text(row.get("problem"), "problem"), row)
  if row.get("tests") is None:
    raise ValueError("missing field 'tests'")
  tests = from_deepcoder(row["tests"], fn_name=metadata_func_name(row.get("metadata")))
  return {"problem": problem, "tests": parse_tests(tests, "")}


def livecodebench_row(row: dict) -> dict:
  """LiveCodeBench code_generation row -> {"problem", "tests"} (public + private tests)."""
  problem = _with_starter(_text(row.get("question_content"), "question_content"), row)
  tests = from_livecodebench(row.get("public_test_cases"), row.get("private_test_cases"),
                             fn_name=metadata_func_name(row.get("metadata")))
  return {"problem": problem, "tests": parse_tests(tests, "")}


RECIPES = {  # name -> (row function, kind)
    "deepscaler": (math_row, "math"),  # agentica-org/DeepScaleR-Preview-Dataset (train)
    "aime2025": (math_row, "math"),  # AIME 2025 I + II (eval)
    "hmmt2025": (math_row, "math"),  # HMMT February / November 2025 (eval)
    "brumo2025": (math_row, "math"),  # BRUMO 2025 (eval)
    "deepcoder": (deepcoder_row, "code"),  # agentica-org/DeepCoder-Preview-Dataset (train)
    "livecodebench": (livecodebench_row, "code"),  # livecodebench/code_generation_lite (eval)
}


def _date_filter(args):
  """None, or a function telling whether a LiveCodeBench row's contest_date is in range."""
  if not (args.min_date or args.max_date):
    return None

  def keep(row) -> bool:
    date = str(row.get("contest_date") or "")[:10]
    if not date:
      raise ValueError("no contest_date (needed by --min-date/--max-date)")
    return ((not args.min_date or date >= args.min_date)
            and (not args.max_date or date <= args.max_date))
  return keep


def convert(inputs: list[str], recipe: str, *, strict: bool = False, keep=None):
  """(rows, log lines) of `inputs` under `recipe`; ValueError/FileNotFoundError on bad input."""
  fn, _ = RECIPES[recipe]
  lines, rows, filtered = [], [], 0

  def one(row):
    nonlocal filtered
    if keep is not None and not keep(row):
      filtered += 1
      return None
    try:
      return fn(row)
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001 - KeyError, TypeError, zlib/pickle errors: a bad row
      raise ValueError(f"{type(e).__name__}: {e}") from None

  for path in inputs:
    got, report = read_rows(path, skip_bad_rows=not strict, convert=one)
    rows += [r for r in got if r is not None]
    lines.append(report.summary())
  if filtered:
    lines.append(f"{filtered} rows outside the --min-date/--max-date range left out")
  unique = dedup(rows, "problem")
  if len(unique) < len(rows):
    lines.append(f"{len(rows) - len(unique)} duplicate problems dropped (first kept)")
  return unique, lines


def write_jsonl(rows: list[dict], out: str) -> None:
  """Writes `rows` to `out` through a temporary file in the same folder (atomic replace)."""
  folder = os.path.dirname(os.path.abspath(out))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".convert_", suffix=".jsonl")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
  except BaseException:
    os.unlink(tmp)
    raise


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("inputs", nargs="+", help="local .parquet (or .jsonl / .json) files")
  parser.add_argument("--recipe", required=True, choices=sorted(RECIPES),
                      help="which dataset the inputs are (field mapping; docs/datasets.md)")
  parser.add_argument("--out", required=True, help="JSONL file to write")
  parser.add_argument("--strict", action="store_true",
                      help="stop at the first malformed row instead of skipping it")
  parser.add_argument("--min-date", default=None,
                      help="livecodebench: keep problems with contest_date >= YYYY-MM-DD")
  parser.add_argument("--max-date", default=None,
                      help="livecodebench: keep problems with contest_date <= YYYY-MM-DD")
  args = parser.parse_args(argv)
  if (args.min_date or args.max_date) and args.recipe != "livecodebench":
    parser.error("--min-date/--max-date apply to --recipe=livecodebench only")
  try:
    rows, lines = convert(args.inputs, args.recipe, strict=args.strict, keep=_date_filter(args))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  for line in lines:
    print(line)
  if not rows:
    print(f"error: no usable rows; {args.out} not written", file=sys.stderr)
    return 1
  write_jsonl(rows, args.out)
  print(f"wrote {len(rows)} {RECIPES[args.recipe][1]} problems to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
