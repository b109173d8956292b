"""Math word problems (files or TFDS) scored by the math reward (oapl_jax/rewards/math.py).

Prompt format (DeepScaleR-style): the question, a newline, then :data:`MATH_INSTRUCTION`,
sent as one user turn through the model's chat template (:meth:`HFTokenizer.chat_prompt`).

Data: any source :func:`oapl_jax.data.read_rows` reads (a JSONL / JSON / Parquet file, or
``tfds:NAME[/CONFIG]`` with a split) whose rows have string ``question`` / ``answer`` fields
(names configurable); reading, bad rows and removing eval questions are
:class:`oapl_jax.tasks.rows.RowTask`'s.
"""

from __future__ import annotations

from oapl_jax.data.sources import normalize_text, read_file
from oapl_jax.rewards.math import extract_boxed, score_batch, score_math  # noqa: F401 (re-exported)
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.rows import RowTask, without_eval_questions

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

normalize_question = normalize_text  # text for de-duplication: lower-cased, spaces collapsed


def load_jsonl(path: str, *, question_field: str = "question", answer_field: str = "answer",
               id_field: str | None = None, skip_bad_rows: bool = False):
  """Rows (dicts) of the JSONL file ``path``; blank lines are ignored.

  Every row must be a JSON object whose ``question_field`` and ``answer_field`` are strings
  (and, if ``id_field`` is given, whose ``id_field`` is a string or an int). A thin wrapper of
  :func:`oapl_jax.data.read_file`; :class:`MathTask` reads any source with ``read_rows``.

  Returns:
    ``list[dict]``; with ``skip_bad_rows=True``, ``(rows, n_skipped)`` where malformed rows
    were skipped and counted instead of raising.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: ``"path:line: why"`` for the first malformed row (unless ``skip_bad_rows``).
  """
  rows, report = read_file(path, "jsonl", skip_bad_rows=skip_bad_rows,
                           required=_required_fields(question_field, answer_field, id_field))
  return (rows, report.skipped) if skip_bad_rows else rows


def _required_fields(question_field: str, answer_field: str, id_field: str | None = None) -> dict:
  """Field -> type every math row must have (for ``read_rows``' ``required``)."""
  required = {question_field: str, answer_field: str}
  if id_field is not None:
    required[id_field] = (str, int)
  return required


class MathTask(RowTask):
  """Math problems from train / eval sources (JSONL / JSON / Parquet files or ``tfds:NAME``
  with ``train_split`` / ``eval_split``), scored by :func:`score_math`.

  * Prompt: ``tokenizer.chat_prompt(question + "\\n" + MATH_INSTRUCTION, thinking=thinking)``.
  * Eval problems: the first ``num_eval`` rows of ``eval_path`` (all if None), ids
    ``0 .. num_eval - 1``.
  * Train problems: the rows of ``train_path`` whose question is no eval question (all eval
    rows count, not only the first ``num_eval``; ``num_train_dropped`` counts the others), all
    of them on every host. A train problem's id is ``len(eval file) + its row index`` in the
    train file: stable across draws, disjoint from eval ids.
  * :meth:`score_batch` scores a rollout on ``reward_workers`` processes.

  Raises:
    FileNotFoundError: if a file does not exist.
    ValueError: malformed rows (``file:line`` / ``file:row N``), an empty source, a bad
      ``num_eval``, or a train source whose questions all occur in the eval set.
  """

  name = "math"

  def __init__(self, train_path: str, eval_path: str, *, tokenizer, question_field: str = "question",
               answer_field: str = "answer", thinking: bool | None = None,
               num_eval: int | None = None, fallback_last_number: bool = False,
               skip_bad_rows: bool = False, train_split: str = "train", eval_split: str = "test",
               data_dir: str | None = None, reward_workers: int = 2,
               max_prompt_len: int | None = None, tools: list[dict] | None = None) -> None:
    super().__init__(tokenizer=tokenizer, thinking=thinking, max_prompt_len=max_prompt_len,
                     data_dir=data_dir, skip_bad_rows=skip_bad_rows, tools=tools)
    self.reward_workers = reward_workers
    self.fallback_last_number = fallback_last_number
    self.question_field = question_field
    self.answer_field = answer_field
    required = _required_fields(question_field, answer_field)
    train_rows = self._read("train", train_path, train_split, required)
    eval_rows = self._read("eval", eval_path, eval_split, required)
    if not eval_rows:
      raise ValueError(f"{eval_path}: no rows")
    if not train_rows:
      raise ValueError(f"{train_path}: no rows")
    if num_eval is not None and not 1 <= num_eval <= len(eval_rows):
      raise ValueError(f"num_eval={num_eval}: must be in [1, {len(eval_rows)}] "
                       f"(the rows of {eval_path})")
    kept = without_eval_questions(train_rows, eval_rows)
    self.num_train_dropped = len(train_rows) - len(kept)
    self._set_eval(eval_rows[:num_eval])
    self._set_train(kept, id_offset=len(eval_rows))
    if not self._train:
      raise ValueError(f"{train_path}: every question also occurs in {eval_path}")

  @classmethod
  def from_config(cls, t, tokenizer, *, max_prompt_len: int | None = None,
                  tools: list[dict] | None = None) -> "MathTask":
    """The task of the config's `task` section `t` (configs/math.py)."""
    return cls(t.train_path, t.eval_path, tokenizer=tokenizer, question_field=t.question_field,
               answer_field=t.answer_field, thinking=t.thinking, num_eval=t.num_eval,
               fallback_last_number=t.fallback_last_number, skip_bad_rows=t.skip_bad_rows,
               train_split=t.train_split, eval_split=t.eval_split, data_dir=t.data_dir,
               reward_workers=t.reward_workers, max_prompt_len=max_prompt_len, tools=tools)

  def _fields(self, row: dict) -> dict:
    """``{"question", "answer", "prompt"}`` of a row."""
    return {"question": row[self.question_field], "answer": row[self.answer_field],
            "prompt": self.make_prompt(row[self.question_field])}

  def make_prompt(self, question: str) -> str:
    """The chat-formatted prompt for ``question``."""
    return self._chat(question + "\n" + MATH_INSTRUCTION)

  def score(self, response: str, problem: Problem) -> float:
    """:func:`score_math` of ``response`` against ``problem.answer``; never raises."""
    return score_math(response, problem.answer, fallback_last_number=self.fallback_last_number)

  def score_batch(self, responses: list[str], problems: list[Problem]) -> list[float]:
    """:meth:`score` of each pair, on ``reward_workers`` processes (rewards/math.py)."""
    return score_batch(responses, [p.answer for p in problems], workers=self.reward_workers,
                       fallback_last_number=self.fallback_last_number)
