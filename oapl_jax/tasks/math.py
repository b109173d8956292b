"""Math word problems (files or TFDS) scored by the math reward (oapl_jax/rewards/math.py).

Prompt format (DeepScaleR-style): the question, a newline, then :data:`MATH_INSTRUCTION`,
sent as one user turn through the model's chat template (:meth:`HFTokenizer.chat_prompt`).

Data: any source :func:`oapl_jax.data.read_rows` reads (a JSONL / JSON / Parquet file, or
``tfds:NAME[/CONFIG]`` with a split) whose rows have string ``question`` / ``answer`` fields
(names configurable); malformed rows raise ``ValueError`` naming ``file:line`` (``file:row N``),
or are skipped, counted and logged with ``skip_bad_rows=True``.
"""

from __future__ import annotations

import logging

import numpy as np

from oapl_jax.data.sources import host_shard, normalize_text, read_file, read_rows
from oapl_jax.rewards.math import extract_boxed, score_batch, score_math  # noqa: F401 (re-exported)
from oapl_jax.tasks.arithmetic import Problem
from oapl_jax.tasks.limits import too_long

_log = logging.getLogger(__name__)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


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
                           required=_fields(question_field, answer_field, id_field))
  return (rows, report.skipped) if skip_bad_rows else rows


def _fields(question_field: str, answer_field: str, id_field: str | None = None) -> dict:
  required = {question_field: str, answer_field: str}
  if id_field is not None:
    required[id_field] = (str, int)
  return required


normalize_question = normalize_text  # text for de-duplication: lower-cased, spaces collapsed


class MathTask:
  """Math problems from train / eval sources (JSONL / JSON / Parquet files or ``tfds:NAME``
  with ``train_split`` / ``eval_split``), scored by :func:`score_math`.

  * Prompt: ``tokenizer.chat_prompt(question + "\\n" + MATH_INSTRUCTION, thinking=thinking)``.
  * Eval problems: the first ``num_eval`` rows of ``eval_path`` (all if None), ids
    ``0 .. num_eval - 1``.
  * Train problems: drawn uniformly *with replacement* from this host's shard (`host_shard`) of the
    rows of ``train_path`` whose
    normalized question (:func:`normalize_question`) does not occur anywhere in the eval
    file (all of its rows, not only the first ``num_eval``), so training never sees an eval
    question. Deterministic given ``rng``. A train problem's id is ``len(eval file) + its
    row index`` in the train file: stable across draws, disjoint from eval ids.
  * Malformed rows are fatal, or with ``skip_bad_rows`` skipped; either way each source's
    :meth:`RowReport.summary` is logged (a warning if rows were skipped). With
    ``max_prompt_len``, a row whose prompt (BOS included) is longer is malformed too.
  * :meth:`score_batch` scores a rollout on ``reward_workers`` processes.

  Raises:
    FileNotFoundError: if a file does not exist.
    ValueError: malformed rows (``file:line`` / ``file:row N``), an empty source, a bad
      ``num_eval``, or a train source whose questions all occur in the eval set.
  """

  def __init__(self, train_path: str, eval_path: str, *, tokenizer, question_field: str = "question",
               answer_field: str = "answer", thinking: bool | None = None,
               num_eval: int | None = None, fallback_last_number: bool = False,
               skip_bad_rows: bool = False, train_split: str = "train", eval_split: str = "test",
               data_dir: str | None = None, reward_workers: int = 2,
               max_prompt_len: int | None = None) -> None:
    self.reward_workers = reward_workers
    self.tokenizer = tokenizer
    self.thinking = thinking
    self.fallback_last_number = fallback_last_number
    self.question_field = question_field
    self.answer_field = answer_field
    self.max_prompt_len = max_prompt_len
    rows = {}
    for role, source, split in (("train", train_path, train_split),
                                ("eval", eval_path, eval_split)):
      rows[role], report = read_rows(source, split=split, data_dir=data_dir,
                                     skip_bad_rows=skip_bad_rows,
                                     required=_fields(question_field, answer_field),
                                     convert=self._prompted)
      _log.log(logging.WARNING if report.skipped else logging.INFO, "math %s data: %s", role,
               report.summary())
    train_rows, eval_rows = rows["train"], rows["eval"]
    if not eval_rows:
      raise ValueError(f"{eval_path}: no rows")
    if not train_rows:
      raise ValueError(f"{train_path}: no rows")
    if num_eval is not None and not 1 <= num_eval <= len(eval_rows):
      raise ValueError(f"num_eval={num_eval}: must be in [1, {len(eval_rows)}] "
                       f"(the rows of {eval_path})")

    held_out = {normalize_question(r["question"]) for r in eval_rows}
    chosen = eval_rows if num_eval is None else eval_rows[:num_eval]
    self._eval = tuple(Problem(prompt=r["prompt"], answer=r["answer"], id=i)
                       for i, r in enumerate(chosen))
    id_offset = len(eval_rows)
    kept = [(i, r) for i, r in enumerate(train_rows)
            if normalize_question(r["question"]) not in held_out]
    self.num_train_dropped = len(train_rows) - len(kept)
    self._train = tuple(Problem(prompt=r["prompt"], answer=r["answer"], id=id_offset + i)
                        for i, r in host_shard(kept))
    if not self._train:
      raise ValueError(f"{train_path}: every question also occurs in {eval_path}")

  def _prompted(self, row: dict) -> dict:
    """``{"question", "answer", "prompt"}`` of a row; ``ValueError`` if the prompt is too long
    (read_rows then names the file and line, and skips the row with ``skip_bad_rows``)."""
    prompt = self.make_prompt(row[self.question_field])
    why = too_long(self.tokenizer, prompt, self.max_prompt_len)
    if why:
      raise ValueError(why)
    return {"question": row[self.question_field], "answer": row[self.answer_field],
            "prompt": prompt}

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

  def score_batch(self, responses: list[str], problems: list[Problem]) -> list[float]:
    """:meth:`score` of each pair, on ``reward_workers`` processes (rewards/math.py)."""
    return score_batch(responses, [p.answer for p in problems], workers=self.reward_workers,
                       fallback_last_number=self.fallback_last_number)
