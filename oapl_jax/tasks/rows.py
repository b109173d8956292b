"""What the row-based tasks (math, code) share: problems are rows of a train and an eval source.

* Reading: :func:`oapl_jax.data.read_rows` reads each source (a JSONL / JSON / Parquet file, or
  ``tfds:NAME[/CONFIG]`` with a split). The task turns each row into ``{"question", "answer",
  "prompt"}`` (:meth:`RowTask._fields`); a row it cannot read, or whose prompt is longer than
  ``sampling.max_prompt_len`` tokens (BOS included, :mod:`oapl_jax.tasks.limits`), is malformed:
  fatal (``file:line: why``), or with ``skip_bad_rows`` skipped and counted. Each source's
  :meth:`RowReport.summary` is logged by the task's module (a warning if rows were skipped).
* Eval questions never train: a train row whose normalised question
  (:func:`oapl_jax.data.normalize_text`) is the question of any eval row is dropped
  (:func:`without_eval_questions`).
* No host sharding: on a pod every host holds all the train rows and draws the same global
  problems; each samples its engine replicas' share of them (:mod:`oapl_jax.sampling.parallel`),
  so N hosts sample exactly what one host with all the replicas samples.
* Drawing: ``train_problems(rng, n)`` draws uniformly with replacement, deterministic given ``rng``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

from oapl_jax.data.sources import normalize_text, read_rows
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.limits import too_long


def without_eval_questions(train_rows: list[dict],
                           eval_rows: list[dict]) -> list[tuple[int, dict]]:
  """``(index, row)`` of each train row whose normalised ``"question"`` is no eval row's (all
  eval rows count, not only the first ``num_eval``); ``index``: the row's place in
  ``train_rows``."""
  held_out = {normalize_text(r["question"]) for r in eval_rows}
  return [(i, r) for i, r in enumerate(train_rows) if normalize_text(r["question"]) not in held_out]


def problems_of(indexed_rows: Iterable[tuple[int, dict]],
                id_offset: int = 0) -> tuple[Problem, ...]:
  """The problems of ``(index, row)`` pairs of read rows, ids ``id_offset + index``."""
  return tuple(Problem(prompt=r["prompt"], answer=r["answer"], id=id_offset + i)
               for i, r in indexed_rows)


class RowTask:
  """Base of the row-based tasks (see the module docstring).

  A subclass names itself in ``name`` (log lines), turns a row into its fields in
  :meth:`_fields`, and in its ``__init__`` reads both sources with :meth:`_read` and sets its
  problems with :meth:`_set_eval` and :meth:`_set_train`; the draws, the eval problems and the
  count of train problems are this class's.
  """

  name = "rows"  # how the log lines name the task: "math train data: ..."

  def __init__(self, *, tokenizer, thinking: bool | None, max_prompt_len: int | None,
               data_dir: str | None, skip_bad_rows: bool, tools: list[dict] | None = None) -> None:
    self.tokenizer = tokenizer
    self.tools = tools  # the environment's tools, listed in each prompt by the chat template (None: none)
    self.thinking = thinking  # chat template's thinking switch (None: the template's default)
    self.max_prompt_len = max_prompt_len  # None: prompts are not checked
    self._data_dir = data_dir  # TFDS folder (None: TFDS's default)
    self._skip_bad_rows = skip_bad_rows
    self._eval: tuple[Problem, ...] = ()
    self._train: tuple[Problem, ...] = ()  # all of them, on every host

  def _fields(self, row: dict) -> dict:
    """``{"question", "answer" (text), "prompt"}`` of a row that has the required fields;
    ``ValueError`` (the reason) if the row is malformed."""
    raise NotImplementedError

  def _chat(self, text: str) -> str:
    """``text`` as one user turn through the tokenizer's chat template."""
    return self.tokenizer.chat_prompt(text, thinking=self.thinking, tools=self.tools)

  def _checked_fields(self, row: dict) -> dict:
    """:meth:`_fields` of ``row``; ``ValueError`` if its prompt is too long."""
    fields = self._fields(row)
    why = too_long(self.tokenizer, fields["prompt"], self.max_prompt_len)
    if why:
      raise ValueError(why)
    return fields

  def _read(self, role: str, source: str, split: str, required: dict[str, Any]) -> list[dict]:
    """The rows of ``source`` (``role`` "train" or "eval") as fields, its report logged."""
    rows, report = read_rows(source, split=split, data_dir=self._data_dir,
                             skip_bad_rows=self._skip_bad_rows, required=required,
                             convert=self._checked_fields)
    logging.getLogger(type(self).__module__).log(
        logging.WARNING if report.skipped else logging.INFO, "%s %s data: %s", self.name, role,
        report.summary())
    return rows

  def _set_eval(self, eval_rows: list[dict]) -> None:
    """Eval problems: ``eval_rows`` in order, ids ``0 ..``."""
    self._eval = problems_of(enumerate(eval_rows))

  def _set_train(self, indexed_rows: list[tuple[int, dict]], id_offset: int) -> None:
    """Train problems: the ``(index, row)`` pairs (all of them on every host: problems are
    drawn globally), ids ``id_offset + index``."""
    self._train = problems_of(indexed_rows, id_offset)

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
