"""Math word problems from JSONL files, with a ``\\boxed{}`` answer verified by math_verify.

Prompt format (DeepScaleR-style): the question, a newline, then :data:`MATH_INSTRUCTION`,
sent as one user turn through the model's chat template (:meth:`HFTokenizer.chat_prompt`).

Reward (:func:`score_math`): the content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``)
anywhere in the response (thinking included: a truncated response whose last box is inside
its reasoning is scored on that box) is compared with the ground truth by ``math_verify``
(``parse`` + ``verify``): 1.0 if equivalent, else 0.0. Optionally, a response without a box
is scored on its last number. The reward never raises and never hangs:

* candidate and gold answers longer than :data:`MAX_ANSWER_CHARS`, nested deeper than
  :data:`MAX_NESTING`, holding a digit run longer than :data:`MAX_DIGITS`, a numeric power
  tower (``9^{9^{9}}``, ``9**9**9``), an integer exponent with more than
  :data:`MAX_EXPONENT_DIGITS` digits or a factorial of a number with more than
  :data:`MAX_FACTORIAL_DIGITS` digits score 0.0 without reaching sympy (Python's big-integer
  arithmetic cannot be interrupted, so a timeout alone would not be enough);
* everything else runs under math_verify's own ``signal.alarm`` timeouts (``parsing_timeout``
  and ``timeout_seconds``, whole seconds, main thread only). Off the main thread signals are
  unavailable, so the timeouts are disabled there and only the input caps apply. Each parse
  and each gold/answer comparison gets its own timeout, so a call that does reach a timeout
  can take a few times ``timeout_s``; the caps keep that from happening on the inputs above.

Data (:func:`load_jsonl`): one JSON object per line with string ``question`` / ``answer``
fields (names configurable); malformed rows raise ``ValueError`` naming ``file:line``, or are
skipped and counted with ``skip_bad_rows=True``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading

import numpy as np

from oapl_jax.tasks.arithmetic import Problem

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

MAX_ANSWER_CHARS = 1000  # longer extracted/gold answers score 0.0
MAX_DIGITS = 200  # longest allowed run of digits in an answer
MAX_EXPONENT_DIGITS = 6  # x^{1234567} and beyond are refused
MAX_FACTORIAL_DIGITS = 4  # 12345! and beyond are refused
MAX_NESTING = 10  # deepest allowed nesting of (), [], {} together (math_verify slows down fast)

# Silence math_verify's per-call warnings (timeouts, disabled timeouts): a noisy policy would
# flood the training log. Errors still propagate to the root logger.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# --------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _matching_brace(text: str, open_pos: int) -> int | None:
  """Index of the ``}`` closing the ``{`` at ``open_pos``, or None if unbalanced.

  Escaped braces ``\\{`` / ``\\}`` (and ``\\\\``) do not count.
  """
  depth = 0
  i, n = open_pos, len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2  # skip the escaped character (\{, \}, \\) or the command's first letter
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def extract_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, or None.

  Nested braces are handled (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); the last box
  wins. ``\\boxed 7`` (space form) gives ``7``. None if there is no box, or if the last one
  has unbalanced braces or no argument (e.g. a response truncated mid-box).
  """
  if not isinstance(text, str):
    return None
  last = None
  for last in _BOX_RE.finditer(text):
    pass
  if last is None:
    return None
  i = last.end()
  n = len(text)
  while i < n and text[i].isspace():
    i += 1
  if i >= n:
    return None
  if text[i] == "{":
    end = _matching_brace(text, i)
    return None if end is None else text[i + 1:end]
  if i == last.end():  # "\boxed7": not a box
    return None
  m = re.match(r"[^\s$]+", text[i:i + MAX_ANSWER_CHARS + 1])
  return m.group(0) if m else None


def _last_number(text: str) -> str | None:
  """The last number (``-12``, ``3.5``, ``1,234``) in ``text``, or None."""
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return None if last is None else last.group(0)


# --------------------------------------------------------------------------------------------
# Guards against inputs sympy cannot finish on
# --------------------------------------------------------------------------------------------

_NUMERIC_EXPR_CHARS = frozenset("0123456789^{}()[]+-*/. ")


def _exponent_spans(s: str):
  """Yields ``(exponent_text, end)`` for each ``^`` in ``s`` (``**`` already rewritten)."""
  n = len(s)
  for i, c in enumerate(s):
    if c != "^":
      continue
    j = i + 1
    while j < n and s[j] == " ":
      j += 1
    if j >= n:
      yield "", j
    elif s[j] == "{":
      end = _matching_brace(s, j)
      if end is None:
        yield s[j:], n
      else:
        yield s[j + 1:end], end + 1
    elif s[j] == "\\":
      m = re.match(r"\\[A-Za-z]+", s[j:])
      k = j + (len(m.group(0)) if m else 2)
      yield s[j:k], k
    elif s[j].isdigit():
      m = re.match(r"\d+(?:\.\d+)?", s[j:])
      yield m.group(0), j + len(m.group(0))
    else:
      yield s[j], j + 1


def _nesting_depth(s: str) -> int:
  """Deepest nesting of brackets of any kind in ``s`` (escaped braces count too)."""
  depth = best = 0
  for c in s:
    if c in "([{":
      depth += 1
      best = max(best, depth)
    elif c in ")]}":
      depth = max(0, depth - 1)
  return best


def _too_hard(s: str) -> bool:
  """Whether ``s`` could make sympy compute a gigantic number, or parse for too long."""
  if len(s) > MAX_ANSWER_CHARS or _nesting_depth(s) > MAX_NESTING:
    return True
  if re.search(r"\d{%d,}" % (MAX_DIGITS + 1), s):
    return True
  if re.search(r"\d{%d,}\s*!" % (MAX_FACTORIAL_DIGITS + 1), s):
    return True
  t = s.replace("**", "^")
  for exponent, end in _exponent_spans(t):
    if re.search(r"\d{%d,}" % (MAX_EXPONENT_DIGITS + 1), exponent):
      return True
    nested = "^" in exponent or t[end:end + 1] == "^" or t[end:].lstrip()[:1] == "^"
    if nested and set(exponent) <= _NUMERIC_EXPR_CHARS:
      return True  # numeric power tower: 9^{9^{9}}, 9^9^9, 9**9**9
  return False


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------

_STRIP_RE = re.compile(r"\s+|\\left|\\right|\\!|\\,|\\;|\$")


def _canonical(s: str) -> str:
  """Cheap normal form for the exact-match fast path."""
  return _STRIP_RE.sub("", s).rstrip(".")


def _timeouts(timeout_s: float | None) -> int | None:
  """math_verify's whole-second timeout, or None where ``signal.alarm`` is unavailable."""
  if timeout_s is None or timeout_s <= 0:
    return None
  if threading.current_thread() is not threading.main_thread():
    return None
  return max(1, math.ceil(timeout_s))


def _as_latex(answer: str) -> str:
  """``answer`` in a form math_verify's LaTeX extractor picks up as a whole."""
  if _matching_brace("{" + answer + "}", 0) == len(answer) + 1:
    return "\\boxed{" + answer + "}"
  return "$" + answer + "$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
  """Parsed ground truth (cached: a group of samples shares one gold answer)."""
  from math_verify import parse

  boxed = extract_boxed(gold) if _BOX_RE.search(gold) else None
  text = _as_latex(boxed) if boxed is not None else (gold if "$" in gold else _as_latex(gold))
  return tuple(parse(text, parsing_timeout=timeout))


def score_math(response: str, ground_truth: str, *, fallback_last_number: bool = False,
               timeout_s: float = 5.0) -> float:
  """1.0 if ``response``'s final answer is equivalent to ``ground_truth``, else 0.0.

  The final answer is the last ``\\boxed{}``/``\\fbox{}`` content; if there is none and
  ``fallback_last_number`` is set, the last number in ``response``. The ground truth may be
  plain (``"1/2"``, ``"\\frac{1}{2}"``, ``"0.5"``), boxed or in ``$...$``. Equivalence is
  math_verify's ``verify(parse(gold), parse(answer))`` under ``timeout_s`` (rounded up to
  whole seconds, per parse / comparison). Never raises; see the module docstring for the
  guards that keep it fast on pathological inputs.
  """
  try:
    if not isinstance(response, str) or not isinstance(ground_truth, str):
      return 0.0
    gold = ground_truth.strip()
    if not gold or _too_hard(gold):
      return 0.0
    answer = extract_boxed(response)
    if answer is None and fallback_last_number:
      answer = _last_number(response)
    if answer is None:
      return 0.0
    answer = answer.strip()
    if not answer or _too_hard(answer):
      return 0.0
    gold_inner = extract_boxed(gold) if _BOX_RE.search(gold) else gold
    if gold_inner is not None and _canonical(answer) == _canonical(gold_inner) != "":
      return 1.0

    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = _timeouts(timeout_s)
    try:
      gold_parsed = list(_parse_gold(gold, timeout))
      if not gold_parsed:
        return 0.0
      pred_parsed = parse(_as_latex(answer), parsing_timeout=timeout)
      if not pred_parsed:
        return 0.0
      ok = verify(gold_parsed, pred_parsed, timeout_seconds=timeout)
    except TimeoutException:
      return 0.0
    return 1.0 if ok else 0.0
  except Exception:  # noqa: BLE001 - the reward must never crash training
    return 0.0


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def load_jsonl(path: str, *, question_field: str = "question", answer_field: str = "answer",
               id_field: str | None = None, skip_bad_rows: bool = False):
  """Rows (dicts) of the JSONL file ``path``; blank lines are ignored.

  Every row must be a JSON object whose ``question_field`` and ``answer_field`` are strings
  (and, if ``id_field`` is given, whose ``id_field`` is a string or an int).

  Returns:
    ``list[dict]``; with ``skip_bad_rows=True``, ``(rows, n_skipped)`` where malformed rows
    were skipped and counted instead of raising.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: ``"path:line: why"`` for the first malformed row (unless ``skip_bad_rows``).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such JSONL file: {path!r}")
  rows: list[dict] = []
  skipped = 0
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      error = None
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        error = f"malformed JSON ({e.msg} at column {e.colno})"
      else:
        if not isinstance(row, dict):
          error = f"expected a JSON object, got {type(row).__name__}"
        else:
          for field in (question_field, answer_field):
            if field not in row:
              error = f"missing field {field!r}"
              break
            if not isinstance(row[field], str):
              error = f"field {field!r} must be a string, got {type(row[field]).__name__}"
              break
          if error is None and id_field is not None:
            if id_field not in row:
              error = f"missing field {id_field!r}"
            elif not isinstance(row[id_field], (str, int)) or isinstance(row[id_field], bool):
              error = (f"field {id_field!r} must be a string or an int, "
                       f"got {type(row[id_field]).__name__}")
      if error is not None:
        if skip_bad_rows:
          skipped += 1
          continue
        raise ValueError(f"{path}:{lineno}: {error}")
      rows.append(row)
  return (rows, skipped) if skip_bad_rows else rows


def normalize_question(text: str) -> str:
  """Question text for de-duplication: lower-cased, whitespace collapsed."""
  return " ".join(text.split()).lower()


class MathTask:
  """Math problems from JSONL train / eval files, scored by :func:`score_math`.

  * Prompt: ``tokenizer.chat_prompt(question + "\\n" + MATH_INSTRUCTION, thinking=thinking)``.
  * Eval problems: the first ``num_eval`` rows of ``eval_path`` (all if None), ids
    ``0 .. num_eval - 1``.
  * Train problems: drawn uniformly *with replacement* from the rows of ``train_path`` whose
    normalized question (:func:`normalize_question`) does not occur anywhere in the eval
    file (all of its rows, not only the first ``num_eval``), so training never sees an eval
    question. Deterministic given ``rng``. A train problem's id is ``len(eval file) + its
    row index`` in the train file: stable across draws, disjoint from eval ids.

  Raises:
    FileNotFoundError: if a file does not exist.
    ValueError: malformed rows (``file:line``), an empty file, a bad ``num_eval``, or a
      train file whose questions all occur in the eval set.
  """

  def __init__(self, train_path: str, eval_path: str, *, tokenizer, question_field: str = "question",
               answer_field: str = "answer", thinking: bool | None = None,
               num_eval: int | None = None, fallback_last_number: bool = False) -> None:
    for p in (train_path, eval_path):
      if not os.path.isfile(os.fspath(p)):
        raise FileNotFoundError(f"no such JSONL file: {os.fspath(p)!r}")
    fields = dict(question_field=question_field, answer_field=answer_field)
    train_rows = load_jsonl(train_path, **fields)
    eval_rows = load_jsonl(eval_path, **fields)
    if not eval_rows:
      raise ValueError(f"{eval_path}: no rows")
    if not train_rows:
      raise ValueError(f"{train_path}: no rows")
    if num_eval is not None and not 1 <= num_eval <= len(eval_rows):
      raise ValueError(f"num_eval={num_eval}: must be in [1, {len(eval_rows)}] "
                       f"(the rows of {eval_path})")
    self.tokenizer = tokenizer
    self.thinking = thinking
    self.fallback_last_number = fallback_last_number
    self.question_field = question_field
    self.answer_field = answer_field

    held_out = {normalize_question(r[question_field]) for r in eval_rows}
    chosen = eval_rows if num_eval is None else eval_rows[:num_eval]
    self._eval = tuple(Problem(prompt=self.make_prompt(r[question_field]),
                               answer=r[answer_field], id=i) for i, r in enumerate(chosen))
    id_offset = len(eval_rows)
    self._train = tuple(
        Problem(prompt=self.make_prompt(r[question_field]), answer=r[answer_field],
                id=id_offset + i)
        for i, r in enumerate(train_rows) if normalize_question(r[question_field]) not in held_out)
    self.num_train_dropped = len(train_rows) - len(self._train)
    if not self._train:
      raise ValueError(f"{train_path}: every question also occurs in {eval_path}")

  def make_prompt(self, question: str) -> str:
    """The chat-formatted prompt for ``question``."""
    return self.tokenizer.chat_prompt(question + "\n" + MATH_INSTRUCTION, thinking=self.thinking)

  @property
  def num_train(self) -> int:
    """Number of distinct train problems (after dropping eval questions)."""
    return len(self._train)

  def eval_problems(self) -> list[Problem]:
    """The fixed held-out problems."""
    return list(self._eval)

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` train problems drawn uniformly with replacement (deterministic given ``rng``)."""
    if n <= 0:
      return []
    idx = rng.integers(0, len(self._train), size=n)
    return [self._train[int(i)] for i in idx]

  def score(self, response: str, problem: Problem) -> float:
    """:func:`score_math` of ``response`` against ``problem.answer``; never raises."""
    return score_math(response, problem.answer, fallback_last_number=self.fallback_last_number)
