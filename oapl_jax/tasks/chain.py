"""Addition written out as a chain of steps: the built-in reasoning task (`task.name="chain_addition"`).

The embedded addition task answers in at most 4 tokens, so nothing about long answers (large
summed log-ratios, a lagged sampler drifting over many tokens, several ways to go wrong) can
show on it. This task keeps its problems (``"4738+2946="``, held-out split, operand digits
drawn by `AdditionTask`) but the answer is a scratchpad: one step per column, right to left,
``x+y+c=s`` (the column's digits, the carry in, the two-digit column total), then ``>`` and the
final answer::

    4738+2946=  ->  8+6+0=14 3+4+1=08 7+9+0=16 4+2+1=07 >7684

A column of C digits is 9 tokens, so C = 4..8 columns make answers of 42..83 tokens (EOS
included). The reward reads the final answer only (1 if the chain is well formed and its
final answer is the sum, else 0; the steps are not checked, and a malformed chain, a truncated
one included, scores 0 without raising).

The base policy's mistakes (`demonstration`, used by the supervised warm-up's noisy phase): a
*dropped carry*. Each carry of the chain is independently written as 0 in the next step with
probability ``digit_noise`` (the warm-up's setting), and the chain goes on consistently from
there, so its final answer is wrong. A model fitted to such demonstrations forgets carries at
that rate, so a problem with K carries is solved with probability about (1 - noise)^K: easy
problems (few carries) almost always, hard ones (many) rarely. That spread is meant to keep
pass@256 below 1, leaving RL something to fix at every k (how far it does depends on the noise:
docs/reasoning_task.md, "Calibration of the base").

Pure Python/numpy; no JAX is needed here.
"""

from __future__ import annotations

import re

import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.tasks.arithmetic import AdditionTask, CharTokenizer, check_addition_prompts
from oapl_jax.tasks.base import Problem

ANSWER_MARK = ">"  # precedes the final answer
_STEP = r"\d\+\d\+[01]=\d\d"
_CHAIN = re.compile(rf"^(?:{_STEP} )+{ANSWER_MARK}(\d+)$")


def operands(problem: Problem) -> tuple[int, int]:
  """(a, b) of a problem ``"a+b="``."""
  a, b = problem.prompt.rstrip("=").split("+")
  return int(a), int(b)


def chain(a: int, b: int, dropped: frozenset[int] = frozenset()) -> str:
  """The chain of steps for ``a + b``; a carry out of column ``i`` (0 = units) in `dropped` is
  written as 0 in the next step, and the chain continues consistently (a wrong final answer)."""
  xs, ys = str(a)[::-1], str(b)[::-1]
  steps, digits, carry = [], [], 0
  for i in range(max(len(xs), len(ys))):
    x = int(xs[i]) if i < len(xs) else 0
    y = int(ys[i]) if i < len(ys) else 0
    s = x + y + carry
    steps.append(f"{x}+{y}+{carry}={s:02d}")
    digits.append(str(s % 10))
    carry = 0 if i in dropped else s // 10
  final = (str(carry) if carry else "") + "".join(reversed(digits))
  return " ".join(steps) + f" {ANSWER_MARK}{final}"


def carries(a: int, b: int) -> int:
  """Carries out of the columns of ``a + b`` (what the noisy demonstrations can drop)."""
  return sum(int(step[6]) for step in chain(a, b).split(f" {ANSWER_MARK}")[0].split(" "))


def final_answer(response: str, pattern: re.Pattern = _CHAIN) -> str | None:
  """The final answer of a chain well formed by `pattern` (its group 1), else None (never
  raises)."""
  try:
    match = pattern.match(response.strip())
  except Exception:  # noqa: BLE001 - a reward must never crash training
    return None
  return match.group(1) if match else None


def dropped_columns(columns: int, rng: np.random.Generator, digit_noise: float) -> frozenset[int]:
  """The columns whose carry a noisy demonstration drops: each independently with probability
  `digit_noise` (one draw of `rng` per column, none at noise 0)."""
  if not 0.0 <= digit_noise < 1.0:
    raise ValueError(f"digit_noise must be in [0, 1), got {digit_noise}")
  return frozenset(i for i in range(columns) if digit_noise and rng.random() < digit_noise)


def answer_tokens(num_columns: int, sum_digits: int) -> int:
  """Tokens of a chain of `num_columns` steps with a `sum_digits`-digit answer, EOS included."""
  return 9 * num_columns + 1 + sum_digits + 1


class ScoredByFinalAnswer:
  """A task whose reward is 1.0 iff the answer a response commits to, `final_answer(response)`
  (a staticmethod each task sets: its own chain's parser; None if malformed, never raising), is
  the problem's answer; else 0.0. maj@k votes on the same `final_answer`."""

  final_answer: staticmethod

  @classmethod
  def score(cls, response: str, problem: Problem) -> float:
    return 1.0 if cls.final_answer(response) == problem.answer else 0.0


class ChainAdditionTask(ScoredByFinalAnswer, AdditionTask):
  """`AdditionTask`'s problems and held-out split, answered with a chain of steps."""

  final_answer = staticmethod(final_answer)

  @staticmethod
  def demonstration(problem: Problem, rng: np.random.Generator, *, digit_noise: float) -> str:
    """The chain of `problem`, each carry dropped independently with probability `digit_noise`."""
    a, b = operands(problem)
    return chain(a, b, dropped_columns(max(len(str(a)), len(str(b))), rng, digit_noise))

  def longest_answer_tokens(self) -> int:
    """Tokens of the longest answer the task's problems have (EOS included)."""
    return answer_tokens(self.max_digits, self.max_digits + 1)


def make_chain_task(config) -> tuple[ChainAdditionTask, CharTokenizer]:
  """The chain-of-steps task of `config.task` (seeded by `config.seed`) and its tokenizer
  (the addition task's characters plus ``>``); refuses a `sampling.max_prompt_len` its
  prompts do not fit in, or a `sampling.max_new_tokens` its longest chain does not."""
  settings = config.task
  task = ChainAdditionTask(settings.min_digits, settings.max_digits, settings.num_eval, config.seed)
  tokenizer = CharTokenizer(extra=ANSWER_MARK)
  check_addition_prompts(task, tokenizer, config.sampling.max_prompt_len)
  need = task.longest_answer_tokens()
  if config.sampling.max_new_tokens < need:
    raise ConfigError(f"config.sampling.max_new_tokens={config.sampling.max_new_tokens}: the "
                      f"chain of a {task.max_digits}-digit addition (task.max_digits) is up to "
                      f"{need} tokens with EOS; must be >= {need}")
  return task, tokenizer
