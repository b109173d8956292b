"""What every task is: `Problem`, the `Task` and `Tokenizer` interfaces, and the registry.

`TASKS` maps each `task.name` a config may hold to the builder of that task; `make_task(config)`
calls it. This module imports nothing heavy (no JAX, Flax or transformers; each builder imports
its task's module when called), so `oapl_jax.config` checks `task.name` against `TASKS` itself.

Every prompt a task makes must fit in `sampling.max_prompt_len` tokens (oapl_jax/tasks/limits.py):
the addition builder refuses a limit its longest prompt cannot fit in, the row-based tasks treat
a row whose prompt is longer as a bad row (file and line named; skipped with task.skip_bad_rows),
and reasoning_gym refuses a generated prompt that is longer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol

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


def _hf_tokenizer(config):
  """The Hugging Face tokenizer of `task.tokenizer_path`, else of the model's folder."""
  from oapl_jax.tasks.hf_tokenizer import HFTokenizer  # noqa: PLC0415 (transformers is slow)
  return HFTokenizer(config.task.tokenizer_path or config.model.path)


def _make_addition(config):
  from oapl_jax.tasks.arithmetic import make_addition_task  # noqa: PLC0415
  return make_addition_task(config)


def _make_chain_addition(config):
  from oapl_jax.tasks.chain import make_chain_task  # noqa: PLC0415
  return make_chain_task(config)


def _make_math(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.math import MathTask  # noqa: PLC0415
  return MathTask.from_config(config.task, tokenizer,
                              max_prompt_len=config.sampling.max_prompt_len), tokenizer


def _make_code(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.code import CodeTask  # noqa: PLC0415
  return CodeTask.from_config(config.task, tokenizer,
                              max_prompt_len=config.sampling.max_prompt_len), tokenizer


def _make_reasoning_gym(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.reasoning_gym import ReasoningGymTask  # noqa: PLC0415
  return ReasoningGymTask.from_config(config.task, tokenizer, seed=config.seed,
                                      max_prompt_len=config.sampling.max_prompt_len), tokenizer


# The task names a config may use, each with its builder (config -> (task, tokenizer)).
TASKS: dict[str, Callable] = {
    "addition": _make_addition,  # procedural, embedded (arithmetic.py); character tokenizer
    "chain_addition": _make_chain_addition,  # addition answered by a chain of steps (chain.py)
    "math": _make_math,  # rows of files / TFDS (math.py)
    "code": _make_code,  # rows of files / TFDS, sandboxed tests (code.py)
    "reasoning_gym": _make_reasoning_gym,  # procedural, the gym's verifiers (reasoning_gym.py)
}


def make_task(config) -> tuple[Task, Tokenizer]:
  """Returns (task, tokenizer) for `config.task` (`task.name` one of `TASKS`).

  Raises:
    ValueError: an unknown `task.name`; a bad data row (a prompt too long for
      `sampling.max_prompt_len` is one).
    ConfigError: `sampling.max_prompt_len` too small for the addition task's longest prompt,
      or for a generated reasoning_gym prompt.
  """
  build = TASKS.get(config.task.name)
  if build is None:
    raise ValueError(f"config.task.name={config.task.name!r}: unknown task")
  return build(config)
