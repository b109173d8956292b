"""Code problems' tests: every layout the datasets store them in, read into one form.

Our form (what :func:`oapl_jax.rewards.code.score` runs and the code task's rows hold):
``{"inputs": [...], "outputs": [...]}`` (stdin/stdout), with ``"fn_name"`` for call-based tests.

Layouts read here:

* our form, or a JSON string of it (how DeepCoder's files store it);
* LiveCodeBench lists of ``{"input", "output", "testtype": "stdin" | "functional"}``, as a list,
  a JSON string, or the dataset's compressed string (base64 of zlib of a pickled JSON string);
  functional tests take their function name from the row's ``metadata["func_name"]``
  (:func:`metadata_func_name`);
* DeepCoder's other lists, of ``{"type": "stdin_stdout" | "function_call", "input", "output"
  [, "fn_name"]}`` (PrimeIntellect / Codeforces rows; :func:`from_deepcoder`, used by
  ``launch/convert_hf_datasets.py``).

:func:`parse_tests` is the check every row passes (the code task's reader and the converter):
it returns our form with non-empty ``inputs`` and ``outputs`` of equal length, or raises
``ValueError``.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib


def metadata_func_name(metadata) -> str | None:
  """``metadata["func_name"]`` of a row (metadata may be a dict or a JSON string), or None."""
  if isinstance(metadata, str):
    try:
      metadata = json.loads(metadata) if metadata.strip() else {}
    except json.JSONDecodeError:
      return None
  name = metadata.get("func_name") if isinstance(metadata, dict) else None
  return name if isinstance(name, str) and name else None


def _json_value(raw, where: str = ""):
  """``raw`` decoded if it is a string (JSON), else ``raw``; ValueError prefixed by ``where``."""
  if not isinstance(raw, str):
    return raw
  try:
    return json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}tests are not valid JSON ({e.msg})") from None


def parse_tests(raw, where: str, *, fn_name: str | None = None) -> dict:
  """Tests of one row in our ``{"inputs", "outputs"[, "fn_name"]}`` form; ValueError naming
  ``where``.

  ``raw`` is our form, its JSON string, or a LiveCodeBench test list (``fn_name`` names the
  function of functional ones: their rows keep it in metadata). An empty ``where`` leaves the
  message unprefixed.
  """
  where = f"{where}: " if where else ""
  raw = _json_value(raw, where)
  if isinstance(raw, list):
    try:
      raw = from_livecodebench(raw, [], fn_name=fn_name)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{where}unreadable LiveCodeBench tests ({e})") from None
  if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), list) \
      or not isinstance(raw.get("outputs"), list):
    raise ValueError(f"{where}tests need lists 'inputs' and 'outputs'")
  if not raw["inputs"] or len(raw["inputs"]) != len(raw["outputs"]):
    raise ValueError(f"{where}tests are empty or inputs/outputs differ in length")
  return raw


# --------------------------------------------------------------------------------------------
# LiveCodeBench
# --------------------------------------------------------------------------------------------


class _NoClassesUnpickler(pickle.Unpickler):
  """Unpickles plain values only (LiveCodeBench's private tests are a pickled string)."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _lcb_tests(tests) -> list[dict]:
  """A LiveCodeBench test list: a list, a JSON string, or the dataset's compressed string
  (base64 of zlib of a pickled JSON string; unpickled without allowing any class)."""
  if tests is None:
    return []
  if isinstance(tests, (str, bytes)):
    try:
      tests = json.loads(tests)
    except ValueError:
      raw = zlib.decompress(base64.b64decode(tests))
      tests = json.loads(_NoClassesUnpickler(io.BytesIO(raw)).load())
  out = []
  for t in tests:
    if not isinstance(t, dict):
      t = {k: getattr(t, k) for k in ("input", "output", "testtype")}
    out.append(t)
  return out


def from_livecodebench(public_tests, private_tests=None, *, fn_name: str | None = None) -> dict:
  """LiveCodeBench tests ({"input", "output", "testtype": "stdin"|"functional"} each) to the
  {"inputs", "outputs"[, "fn_name"]} form of :func:`oapl_jax.rewards.code.score`.

  Functional tests need `fn_name` (the row's ``metadata["func_name"]``); their input is one
  JSON value per line (one per argument) and their output one JSON value.
  """
  tests = _lcb_tests(public_tests) + _lcb_tests(private_tests)
  kinds = {str(getattr(t.get("testtype"), "value", t.get("testtype"))) for t in tests}
  if len(kinds) > 1:
    raise ValueError(f"mixed LiveCodeBench test types {sorted(kinds)}")
  if kinds == {"functional"}:
    if not fn_name:
      raise ValueError("functional LiveCodeBench tests need fn_name (metadata['func_name'])")
    inputs = [[json.loads(line) for line in t["input"].split("\n") if line.strip()]
              for t in tests]
    return {"inputs": inputs, "outputs": [json.loads(t["output"]) for t in tests],
            "fn_name": fn_name}
  if kinds - {"stdin"}:
    raise ValueError(f"unknown LiveCodeBench test type {sorted(kinds)}")
  return {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}


# --------------------------------------------------------------------------------------------
# DeepCoder
# --------------------------------------------------------------------------------------------


def from_deepcoder(raw, *, fn_name: str | None = None) -> dict:
  """DeepCoder's ``tests`` (JSON string or value) in our form, not yet checked
  (:func:`parse_tests` does that).

  Seen layouts: TACO's {"inputs", "outputs"[, "fn_name"]}; PrimeIntellect / Codeforces lists of
  {"type": "stdin_stdout" | "function_call", "input", "output"[, "fn_name"]}; LiveCodeBench lists
  of {"input", "output", "testtype"}, whose function name is ``fn_name`` (the row's metadata).
  """
  raw = _json_value(raw)
  if isinstance(raw, list) and not raw:
    raise ValueError("tests are empty")
  if isinstance(raw, list) and all(isinstance(t, dict) for t in raw):
    if any("testtype" in t for t in raw):
      return from_livecodebench(raw, None, fn_name=fn_name)
    return _from_typed_list(raw)
  if isinstance(raw, dict):
    tests = {"inputs": raw.get("inputs"), "outputs": raw.get("outputs")}
    if isinstance(raw.get("fn_name"), str) and raw["fn_name"]:
      tests["fn_name"] = raw["fn_name"]
    return tests
  raise ValueError(f"tests must be a JSON object or a non-empty list of objects, got "
                   f"{type(raw).__name__}")


def _from_typed_list(raw: list[dict]) -> dict:
  """A PrimeIntellect / Codeforces list of {"type", "input", "output"[, "fn_name"]} in our form."""
  kinds = {t.get("type", "stdin_stdout") for t in raw}
  if len(kinds) > 1:
    raise ValueError(f"mixed test types {sorted(map(str, kinds))}")
  tests = {"inputs": [t["input"] for t in raw], "outputs": [t["output"] for t in raw]}
  if kinds == {"function_call"}:
    names = {t.get("fn_name") for t in raw}
    if len(names) != 1 or not isinstance(next(iter(names)), str) or not next(iter(names)):
      raise ValueError(f"function_call tests need one fn_name, got {sorted(map(str, names))}")
    tests["fn_name"] = names.pop()
  elif kinds != {"stdin_stdout"}:
    raise ValueError(f"unknown test type {sorted(map(str, kinds))}")
  return tests
