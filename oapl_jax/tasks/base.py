"""What every task is: `Problem`, and the `Task` and `Tokenizer` interfaces every task implements.

The registry of task names (`TASKS`, `make_task`) is `oapl_jax/tasks/registry.py`.

Every prompt a task makes must fit in `sampling.max_prompt_len` tokens (oapl_jax/tasks/limits.py):
the addition builder refuses a limit its longest prompt cannot fit in, the row-based tasks treat
a row whose prompt is longer as a bad row (file and line named; skipped with task.skip_bad_rows),
and reasoning_gym refuses a generated prompt that is longer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: the `prompt` the policy answers, the `answer` its score checks against (the
  sum for addition, the gold answer for math, the tests as JSON for code), and an `id`
  (eval problems `0 .. num_eval - 1`; train ids never clash with them)."""

  prompt: str
  answer: str
  id: int


class Tokenizer(Protocol):
  """What the trainer, the sampler and the tasks need of a tokenizer (CharTokenizer,
  HFTokenizer)."""

  vocab_size: int  # number of token ids
  pad_id: int
  bos_id: int | None  # None: the tokenizer has no BOS (e.g. Qwen)
  eos_id: int  # generation stops here

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class Task(Protocol):
  """A source of problems with a verifiable reward.

  A task may also have `score_batch(responses, problems) -> list[float]` (math and code: many
  answers scored in parallel); the sampler uses it when present, else `score` one by one.
  """

  def eval_problems(self) -> list[Problem]:
    """The fixed held-out problems, ids `0 .. len - 1`."""

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` training problems, never a held-out one; deterministic given the state of `rng`."""

  def score(self, response: str, problem: Problem) -> float:
    """Reward of the decoded `response` to `problem`, in [0, 1]; never raises."""


# --------------------------------------------------------------------------------------------
# Registry: task.name -> builder(config) -> (task, tokenizer)
# --------------------------------------------------------------------------------------------
