"""Multi-digit addition: the built-in procedural task with a verifiable reward.

The default tiny CPU run trains a small transformer on problems such as
``"123+45="`` whose answer is ``"168"``. The reward is exact-match on the
answer string, so it is cheap, deterministic and impossible to game.

Design of the base policy: before RL, the model is warmed up (supervised), first on
clean demonstrations and then on *noisy* ones, in which each answer digit is
independently replaced by a uniformly random different digit with probability
``digit_noise``. A model that fitted the noisy demonstrations perfectly would have
per-digit accuracy ``1 - digit_noise`` with independent errors, i.e. pass@1
``(1 - digit_noise) ** num_digits`` (:func:`expected_pass1`, an upper reference
point). The short noisy phase of ``configs/tiny.py`` (1300 clean + 200 noisy steps,
``digit_noise = 0.25``) does not fit it that far: its base measures pass@1 about
0.1-0.3 and pass@16 0.8-1.0 (docs/reasoning_task.md, "The embedded default task"), a calibrated,
imperfect policy that a verifiable reward can sharpen.

Pure Python/numpy; no JAX is needed here.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.limits import SETTING, prompt_tokens

_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "0123456789+-*= "
_DIGITS = "0123456789"
_MAX_DIGITS = 9


class CharTokenizer:
  """Character-level tokenizer over a fixed, small vocabulary.

  Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, then the characters
  ``"0123456789+-*="`` and space (vocabulary size 18), then ``extra`` characters (a task that
  writes more symbols, e.g. the chain-of-steps task's ``">"``; the first 18 ids are unchanged).
  """

  def __init__(self, extra: str = "") -> None:
    chars = _CHARS + "".join(c for c in dict.fromkeys(extra) if c not in _CHARS)
    self._id_to_char = {len(_SPECIALS) + i: c for i, c in enumerate(chars)}
    self._char_to_id = {c: i for i, c in self._id_to_char.items()}

  @property
  def vocab_size(self) -> int:
    """Number of token ids (specials plus characters)."""
    return len(_SPECIALS) + len(self._id_to_char)

  @property
  def pad_id(self) -> int:
    """Id of the padding token."""
    return 0

  @property
  def bos_id(self) -> int:
    """Id of the beginning-of-sequence token."""
    return 1

  @property
  def eos_id(self) -> int:
    """Id of the end-of-sequence token."""
    return 2

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Encodes ``text`` character by character, optionally prefixing ``<bos>``.

    Raises:
      ValueError: if ``text`` holds a character outside the vocabulary.
    """
    ids = [self.bos_id] if add_bos else []
    for ch in text:
      if ch not in self._char_to_id:
        raise ValueError(f"character {ch!r} is not in the tokenizer vocabulary")
      ids.append(self._char_to_id[ch])
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes ids to text, stopping at the first ``<eos>``.

    ``<pad>`` and ``<bos>`` are dropped; unknown ids are dropped too, so
    decoding arbitrary model samples never raises.
    """
    chars = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      ch = self._id_to_char.get(i)
      if ch is not None:
        chars.append(ch)
    return "".join(chars)


def expected_pass1(digit_noise: float, num_answer_digits: int) -> float:
  """Pass@1 of a model that fits the noisy demonstrations perfectly.

  Each of the ``num_answer_digits`` digits is right with probability
  ``1 - digit_noise``, independently, so pass@1 is their product.
  """
  return (1.0 - digit_noise) ** num_answer_digits


def _count_with_digits(d: int) -> int:
  """How many numbers have exactly ``d`` digits (0 counts as one digit)."""
  return 10 if d == 1 else 9 * 10 ** (d - 1)


def _sample_number(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
  """Draws a digit count uniformly, then a number with that many digits uniformly."""
  d = int(rng.integers(min_digits, max_digits + 1))
  low = 0 if d == 1 else 10 ** (d - 1)
  return int(rng.integers(low, 10**d))


def _make_problem(a: int, b: int, pid: int) -> Problem:
  """Builds the problem ``"a+b="`` with answer ``str(a + b)``."""
  return Problem(prompt=f"{a}+{b}=", answer=str(a + b), id=pid)


class AdditionTask:
  """Procedural multi-digit addition with a held-out evaluation set.

  Operands each have a digit count drawn uniformly from
  ``[min_digits, max_digits]`` (no leading zeros; 0 is a 1-digit number).
  The eval set is fixed by ``seed``; training problems never coincide with
  a held-out ``(a, b)`` pair.
  """

  def __init__(self, min_digits: int, max_digits: int, num_eval: int, seed: int) -> None:
    if not 1 <= min_digits <= _MAX_DIGITS:
      raise ValueError(f"min_digits must be in [1, {_MAX_DIGITS}], got {min_digits}")
    if not min_digits <= max_digits <= _MAX_DIGITS:
      raise ValueError(
        f"max_digits must be in [min_digits={min_digits}, {_MAX_DIGITS}], got {max_digits}"
      )
    if num_eval < 1:
      raise ValueError(f"num_eval must be >= 1, got {num_eval}")
    n_numbers = sum(_count_with_digits(d) for d in range(min_digits, max_digits + 1))
    if num_eval > n_numbers**2 // 2:
      raise ValueError(
        f"num_eval={num_eval} exceeds half of the {n_numbers**2} possible problems"
      )
    self.min_digits = min_digits
    self.max_digits = max_digits
    self.num_eval = num_eval
    self.seed = seed
    self._eval_pairs, self._eval = self._build_eval()

  def _sample_pair(self, rng: np.random.Generator) -> tuple[int, int]:
    """Draws one operand pair."""
    a = _sample_number(rng, self.min_digits, self.max_digits)
    b = _sample_number(rng, self.min_digits, self.max_digits)
    return a, b

  def _build_eval(self) -> tuple[frozenset[tuple[int, int]], tuple[Problem, ...]]:
    """Draws ``num_eval`` distinct pairs deterministically from ``seed``."""
    rng = np.random.default_rng(self.seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < self.num_eval:
      pair = self._sample_pair(rng)
      if pair not in seen:
        seen.add(pair)
        pairs.append(pair)
    problems = tuple(_make_problem(a, b, i) for i, (a, b) in enumerate(pairs))
    return frozenset(seen), problems

  def longest_prompt(self) -> str:
    """The longest prompt the task makes, ``"99+99="`` for ``max_digits=2``."""
    return _make_problem(10**self.max_digits - 1, 10**self.max_digits - 1, 0).prompt

  def eval_problems(self) -> list[Problem]:
    """The fixed held-out problems (ids ``0 .. num_eval - 1``)."""
    return list(self._eval)

  def is_held_out(self, a: int, b: int) -> bool:
    """Whether the pair ``(a, b)`` belongs to the held-out eval set."""
    return (a, b) in self._eval_pairs

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """``n`` fresh problems, resampling any that hit a held-out pair.

    Deterministic given the state of ``rng``. Ids start at ``num_eval``
    so they never clash with eval ids within one call.
    """
    problems = []
    while len(problems) < n:
      a, b = self._sample_pair(rng)
      if not self.is_held_out(a, b):
        problems.append(_make_problem(a, b, self.num_eval + len(problems)))
    return problems

  @staticmethod
  def score(response: str, problem: Problem) -> float:
    """1.0 iff ``response`` stripped of whitespace equals the answer, else 0.0.

    Never raises: non-string or garbage responses score 0.0.
    """
    try:
      return 1.0 if response.strip() == problem.answer else 0.0
    except Exception:  # noqa: BLE001 - reward must never crash training
      return 0.0

  @staticmethod
  def demonstration(problem: Problem, rng: np.random.Generator, *, digit_noise: float) -> str:
    """The answer with each digit independently corrupted w.p. ``digit_noise``.

    A corrupted digit becomes a uniformly random *different* digit, so a
    model fitted to these demos has per-digit accuracy ``1 - digit_noise``.
    """
    if not 0.0 <= digit_noise < 1.0:
      raise ValueError(f"digit_noise must be in [0, 1), got {digit_noise}")
    out = []
    for ch in problem.answer:
      if ch in _DIGITS and rng.random() < digit_noise:
        shift = int(rng.integers(1, 10))
        ch = _DIGITS[(int(ch) + shift) % 10]
      out.append(ch)
    return "".join(out)


def make_addition_task(config) -> tuple[AdditionTask, CharTokenizer]:
  """The addition task of `config.task` (seeded by `config.seed`) and its tokenizer; refuses a
  `sampling.max_prompt_len` its prompts do not fit in (:func:`check_addition_prompts`)."""
  settings = config.task
  task = AdditionTask(settings.min_digits, settings.max_digits, settings.num_eval, config.seed)
  tokenizer = CharTokenizer()
  check_addition_prompts(task, tokenizer, config.sampling.max_prompt_len)
  return task, tokenizer


def check_addition_prompts(task: AdditionTask, tokenizer, max_prompt_len: int) -> None:
  """Refuses a `sampling.max_prompt_len` the addition task's longest prompt does not fit in.

  Checked before the supervised warm-up, which would otherwise run for minutes and leave the
  failure to the first rollout. (Once the prompts fit, the warm-up's sequences,
  `max_prompt_len + max_new_tokens` long, hold every prompt and at least one answer token.)
  """
  prompt = task.longest_prompt()
  need = prompt_tokens(tokenizer, prompt)
  if max_prompt_len < need:
    raise ConfigError(
        f"config.{SETTING}={max_prompt_len}: the addition task's longest prompt {prompt!r} "
        f"(task.max_digits={task.max_digits}) is {need} tokens with BOS; must be >= {need}")
