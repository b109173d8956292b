"""Math word problems from JSONL files, scored by the math reward (oapl_jax/rewards/math.py).

Prompt format (DeepScaleR-style): the question, a newline, then :data:`MATH_INSTRUCTION`,
sent as one user turn through the model's chat template (:meth:`HFTokenizer.chat_prompt`).

Data (:func:`load_jsonl`): one JSON object per line with string ``question`` / ``answer``
fields (names configurable); malformed rows raise ``ValueError`` naming ``file:line``, or are
skipped and counted with ``skip_bad_rows=True``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from oapl_jax.rewards.math import extract_boxed, score_math  # noqa: F401 (re-exported)
from oapl_jax.tasks.arithmetic import Problem

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

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
