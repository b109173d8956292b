"""Procedural reasoning tasks from the `reasoning_gym` package, scored by each dataset's verifier.

``reasoning_gym.create_dataset(name, size=..., seed=..., **kwargs)`` yields entries
``{"question", "answer", "metadata"}``; ``dataset.score_answer(answer=..., entry=...)`` grades a
candidate answer in [0, 1] (1 = correct; some datasets give partial credit).

* Prompt: the question, a blank line, then :data:`ANSWER_INSTRUCTION`, sent as one user turn
  through the model's chat template (:meth:`HFTokenizer.chat_prompt`).
* Answer: the content of the *last* ``<answer>...</answer>`` of the response, stripped; if the
  response has none, the whole response, stripped (:func:`extract_answer`).
* Eval problems: entries ``0 .. num_eval - 1`` of the dataset made with ``seed`` (repeated
  questions dropped), ids ``0 ..``. Train problems: drawn uniformly with replacement from
  ``size`` entries of the dataset made with ``seed + num_eval`` (reasoning_gym seeds entry
  ``i`` with ``seed + i``, so the two never share a generator seed), generated on first draw;
  an entry whose question (normalised) is an eval question is redrawn, so training never sees
  an eval problem. Train ids are ``num_eval + index``.
* Prompt length: with ``max_prompt_len``, a prompt longer than that many tokens (BOS included)
  is a ``ConfigError`` naming ``sampling.max_prompt_len``: at once for an eval entry, when first
  drawn for a train entry (they are generated lazily).
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.data.sources import normalize_text
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.limits import SETTING, prompt_tokens

ANSWER_INSTRUCTION = ("Solve the problem. Give your final answer inside <answer> and </answer> "
                      "tags, with nothing else in them: <answer>your answer</answer>.")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_REDRAWS = 1000  # draws per requested train problem before giving up on finding a non-eval one
_log = logging.getLogger(__name__)


def extract_answer(response: str) -> str:
  """The last ``<answer>...</answer>`` content of ``response`` (stripped), else the whole
  stripped response."""
  if not isinstance(response, str):
    return ""
  found = _ANSWER_RE.findall(response)
  return (found[-1] if found else response).strip()


def _dataset_kwargs_dict(dataset_kwargs) -> dict:
  """``dataset_kwargs`` as a dict: None, a mapping, a ConfigDict, or a JSON object string."""
  if dataset_kwargs is None:
    return {}
  if isinstance(dataset_kwargs, str):
    try:
      out = json.loads(dataset_kwargs) if dataset_kwargs.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"dataset_kwargs {dataset_kwargs!r}: not a JSON object ({e.msg})") from None
  elif hasattr(dataset_kwargs, "to_dict"):
    out = dataset_kwargs.to_dict()
  else:
    out = dict(dataset_kwargs)
  if not isinstance(out, dict):
    raise ValueError(f"dataset_kwargs {dataset_kwargs!r}: not a JSON object")
  return out


class ReasoningGymTask:
  """A `reasoning_gym` dataset as a task (see the module docstring).

  Raises:
    ImportError: if `reasoning_gym` is not installed.
    ValueError: an unknown dataset or bad ``dataset_kwargs`` (the dataset's own message), a
      ``dataset_kwargs`` holding ``seed``/``size``, or ``size`` / ``num_eval`` < 1.
    ConfigError: a prompt longer than ``max_prompt_len`` tokens (see the module docstring).
  """

  def __init__(self, dataset_name: str, *, tokenizer, size: int, seed: int, num_eval: int,
               dataset_kwargs: dict | None = None, thinking: bool | None = None,
               max_prompt_len: int | None = None) -> None:
    import reasoning_gym  # noqa: PLC0415 (a declared dependency; imported only for this task)

    kwargs = _dataset_kwargs_dict(dataset_kwargs)
    if {"seed", "size"} & set(kwargs):
      raise ValueError(f"dataset_kwargs {kwargs}: seed and size come from the task settings")
    if size < 1 or num_eval < 1:
      raise ValueError(f"size={size}, num_eval={num_eval}: both must be >= 1")
    try:
      self._eval_ds = reasoning_gym.create_dataset(dataset_name, size=num_eval, seed=seed, **kwargs)
      self._train_ds = reasoning_gym.create_dataset(dataset_name, size=size, seed=seed + num_eval,
                                                    **kwargs)
    except (ValueError, TypeError, AssertionError) as e:
      raise ValueError(f"reasoning_gym dataset {dataset_name!r} with {kwargs}: {e}") from e
    self.dataset_name, self.tokenizer, self.thinking = dataset_name, tokenizer, thinking
    self.size, self.num_eval, self.max_prompt_len = size, num_eval, max_prompt_len

    self._eval_entries: list[dict] = []
    self._held_out: set[str] = set()
    for entry in self._eval_ds:
      key = normalize_text(entry["question"])
      if key not in self._held_out:
        self._held_out.add(key)
        self._eval_entries.append(entry)
    if len(self._eval_entries) < num_eval:
      _log.warning("reasoning_gym %s: %d of %d eval questions were repeats and were dropped",
                   dataset_name, num_eval - len(self._eval_entries), num_eval)
    self._eval = [self._problem(e, i, f"eval entry {i}")
                  for i, e in enumerate(self._eval_entries)]
    # Train entry index -> (problem, entry), or None where the entry repeats an eval question.
    self._train: dict[int, tuple[Problem, dict] | None] = {}

  @classmethod
  def from_config(cls, t, tokenizer, *, seed: int,
                  max_prompt_len: int | None = None) -> "ReasoningGymTask":
    """The task of the config's `task` section `t` (configs/reasoning_gym.py), seeded by `seed`."""
    return cls(t.dataset, tokenizer=tokenizer, size=t.size, seed=seed, num_eval=t.num_eval,
               dataset_kwargs=t.dataset_kwargs, thinking=t.thinking, max_prompt_len=max_prompt_len)

  def make_prompt(self, question: str) -> str:
    """The chat-formatted prompt for ``question``."""
    return self.tokenizer.chat_prompt(question + "\n\n" + ANSWER_INSTRUCTION,
                                      thinking=self.thinking)

  def _problem(self, entry: dict, pid: int, which: str) -> Problem:
    """The problem of `entry` (`which` names it in the error if its prompt is too long)."""
    prompt = self.make_prompt(entry["question"])
    n = None if self.max_prompt_len is None else prompt_tokens(self.tokenizer, prompt)
    if n is not None and n > self.max_prompt_len:
      raise ConfigError(f"config.{SETTING}={self.max_prompt_len}: reasoning_gym "
                        f"{self.dataset_name} {which} has a prompt of {n} tokens (chat template "
                        f"and BOS included); raise {SETTING} or make the questions shorter "
                        "(task.dataset_kwargs)")
    return Problem(prompt=prompt, answer=str(entry["answer"]), id=pid)

  def _train_item(self, index: int) -> tuple[Problem, dict] | None:
    """Train entry ``index`` as (problem, entry), made on first use; None for an eval question."""
    if index not in self._train:
      entry = self._train_ds[index]
      held_out = normalize_text(entry["question"]) in self._held_out
      self._train[index] = (None if held_out
                            else (self._problem(entry, self.num_eval + index,
                                                f"train entry {index}"), entry))
    return self._train[index]

  def eval_problems(self) -> list[Problem]:
    """The fixed held-out problems."""
    return list(self._eval)

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` train problems drawn uniformly with replacement (deterministic given ``rng``)."""
    out: list[Problem] = []
    draws = 0
    while len(out) < n:
      draws += 1
      if draws > _MAX_REDRAWS * n:
        raise ValueError(f"reasoning_gym {self.dataset_name}: almost every train entry is an eval "
                         "question; raise task.size or lower task.num_eval")
      item = self._train_item(int(rng.integers(0, self.size)))
      if item is not None:
        out.append(item[0])
    return out

  def _entry(self, problem: Problem) -> tuple[object, dict] | None:
    """(dataset, entry) behind ``problem``, or None if it is not one of this task's problems."""
    pid = problem.id
    if 0 <= pid < len(self._eval_entries):
      return self._eval_ds, self._eval_entries[pid]
    item = self._train.get(pid - self.num_eval)
    return None if item is None else (self._train_ds, item[1])

  def score(self, response: str, problem: Problem) -> float:
    """The dataset's ``score_answer`` of :func:`extract_answer` ``(response)``; never raises."""
    found = self._entry(problem)
    if found is None:
      return 0.0
    dataset, entry = found
    try:
      return float(dataset.score_answer(answer=extract_answer(response), entry=entry))
    except Exception:  # noqa: BLE001 - a verifier bug must not crash training
      _log.exception("reasoning_gym %s: score_answer raised; scoring 0", self.dataset_name)
      return 0.0
