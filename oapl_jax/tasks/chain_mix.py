"""Three column rules in one task: addition, subtraction and multiplication by a digit, each
answered by a chain of steps (`task.name="chain_mix"`; issue 41's task that is meant not to
saturate).

The built-in reasoning task (chain.py) has one rule to learn: write the carry. Its base drops
carries, RL finds the rule, and every method ends near pass@1 1 with pass@k = 1 for k > 1, so
it cannot tell methods apart late in training. This task draws each problem's operation from
`task.operations` and answers it with a chain of column steps, right to left, each with its
own carry rule::

    47381+29465=  ->  1+5+0=06 8+6+0=14 3+4+1=08 7+9+0=16 4+2+1=07 >76846
    47381-29465=  ->  1-5-0=16 8-6-1=01 3-4-0=19 7-9-1=17 4-2-1=01 >17916
    47381*7=      ->  1*7+0=07 8*7+0=56 3*7+5=26 7*7+2=51 4*7+5=33 >331667
    47381x29=     ->  1x29+00=029 8x29+02=234 3x29+23=110 7x29+11=214 4x29+21=137 >1374049

A step is ``x?y?c=kd``: the column's digits, the carry (or borrow) in, then the carry out k and
the column's digit d (subtraction: k = 1 when the column borrowed; multiplication: k is the tens
digit of x*y + c, 0 to 8). Every step is 9 tokens with its space. Operation ``x`` (a two-digit
multiplier yz, 10-99; only when `operations` holds it) writes ``x x yz + cc = kkd``: the carry in
cc and out kk two digits each (0-98), 12 tokens with the space; its column products are a table
of 900 facts the base must compute, not one carry rule. The final answer follows ``>`` (no
leading zeros; a product's last carry leads it). The reward reads the final answer
only (1 if the chain is well formed and its answer is right), as chain.py's does.

Skills: the three carry rules (a 0/1 carry added, a 0/1 borrow subtracted, a 0-8 carry added
after a product), and the products of the digit table. The base's mistakes (`demonstration`,
the warm-up's noisy phase): each carry or borrow out of a column is dropped (written as 0 in the
next step, the chain going on consistently from there) with probability `digit_noise`, so a
problem is solved about as often as all its carries survive: products (a carry out of most
columns) rarely, sums and differences (a carry out of about half of them) more often.

Pure Python/numpy; no JAX is needed here.
"""

from __future__ import annotations

import re

import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.tasks import chain as chain_lib
from oapl_jax.tasks.arithmetic import CharTokenizer, _sample_number, check_addition_prompts
from oapl_jax.tasks.base import Problem

ANSWER_MARK = chain_lib.ANSWER_MARK
OPERATIONS = "+-*x"  # what task.operations may hold ("x": times a two-digit number)
DEFAULT_OPERATIONS = "+-*"  # configs/mix.py's
_STEP = r"\d[-+*]\d[-+]\d=\d\d"
_WIDE_STEP = r"\dx\d\d\+\d\d=\d\d\d"  # operation "x"
_CHAIN = re.compile(rf"^(?:(?:{_STEP} )+|(?:{_WIDE_STEP} )+){ANSWER_MARK}(\d+)$")
_PROMPT = re.compile(r"^(\d+)([-+*x])(\d+)=$")


def parse(problem: Problem) -> tuple[int, str, int]:
  """(a, operation, b) of a problem ``"a?b="``."""
  a, op, b = _PROMPT.match(problem.prompt).groups()
  return int(a), op, int(b)


def result(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b  # "*" and "x" multiply


def chain(a: int, op: str, b: int, dropped: frozenset[int] = frozenset()) -> str:
  """The chain of steps of ``a op b`` (``op`` in "+-*x"; for "-", a >= b; for "*", b one
  digit; for "x", two). A carry or borrow out of column ``i`` (0 = units) in `dropped` is written as 0 in the
  next step, and the chain goes on consistently (a wrong final answer)."""
  xs = str(a)[::-1]
  times = op in "*x"
  ys = "" if times else str(b)[::-1]
  steps, digits, carry = [], [], 0
  for i in range(len(xs) if times else max(len(xs), len(ys))):
    x = int(xs[i]) if i < len(xs) else 0
    y = b if times else (int(ys[i]) if i < len(ys) else 0)
    if op == "+":
      v = x + y + carry
      out, digit = v // 10, v % 10
      steps.append(f"{x}+{y}+{carry}={out}{digit}")
    elif op == "-":
      v = x - y - carry
      out, digit = (1, v + 10) if v < 0 else (0, v)
      steps.append(f"{x}-{y}-{carry}={out}{digit}")
    else:  # "*" one-digit fields, "x" two-digit carries
      out, digit = divmod(x * y + carry, 10)
      steps.append(f"{x}*{y}+{carry}={out}{digit}" if op == "*" else f"{x}x{y}+{carry:02d}={out:02d}{digit}")
    digits.append(str(digit))
    carry = 0 if i in dropped else out
  lead = str(carry) if carry and op != "-" else ""  # a >= b: no borrow out of the top column
  final = (lead + "".join(reversed(digits))).lstrip("0") or "0"
  return " ".join(steps) + f" {ANSWER_MARK}{final}"


def final_answer(response: str) -> str | None:
  """The final answer of a well-formed chain, else None (never raises)."""
  return chain_lib.final_answer(response, _CHAIN)


class ChainMixTask(chain_lib.ScoredByFinalAnswer):
  """Problems ``"a+b="``, ``"a-b="`` (a >= b), ``"a*d="`` (d a digit 2-9) and ``"axn="`` (n
  10-99), the operation
  drawn uniformly from `operations`, operands of `min_digits`..`max_digits` digits; a fixed
  held-out set of `num_eval` problems (by `seed`) that training never draws."""

  def __init__(self, min_digits: int, max_digits: int, num_eval: int, seed: int,
               operations: str = DEFAULT_OPERATIONS, noisy_operations: str | None = None) -> None:
    if not 1 <= min_digits <= max_digits <= 9:
      raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
    if not operations or any(op not in OPERATIONS for op in operations) or len(set(operations)) != len(operations):
      raise ValueError(f"operations must be distinct characters of {OPERATIONS!r}, got {operations!r}")
    if num_eval < 1:
      raise ValueError(f"num_eval must be >= 1, got {num_eval}")
    self.min_digits, self.max_digits, self.num_eval, self.seed = min_digits, max_digits, num_eval, seed
    self.operations = operations
    # the operations whose noisy demonstrations drop carries (the others' stay clean)
    self.noisy_operations = operations if noisy_operations is None else noisy_operations
    if any(op not in operations for op in self.noisy_operations):
      raise ValueError(f"noisy_operations must be among operations={operations!r}, got {noisy_operations!r}")
    rng = np.random.default_rng(seed)
    held: list[tuple[int, str, int]] = []
    while len(held) < num_eval:
      triple = self._sample(rng)
      if triple not in held:
        held.append(triple)
    self._held = frozenset(held)
    self._eval = tuple(self._problem(t, i) for i, t in enumerate(held))

  def _sample(self, rng: np.random.Generator) -> tuple[int, str, int]:
    op = self.operations[int(rng.integers(len(self.operations)))]
    a = _sample_number(rng, self.min_digits, self.max_digits)
    if op == "*":
      return a, op, int(rng.integers(2, 10))
    if op == "x":
      return a, op, int(rng.integers(10, 100))
    b = _sample_number(rng, self.min_digits, self.max_digits)
    return (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)

  @staticmethod
  def _problem(triple: tuple[int, str, int], pid: int) -> Problem:
    a, op, b = triple
    return Problem(prompt=f"{a}{op}{b}=", answer=str(result(a, op, b)), id=pid)

  def eval_problems(self) -> list[Problem]:
    return list(self._eval)

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` fresh problems, none held out (ids from `num_eval`)."""
    out = []
    while len(out) < n:
      triple = self._sample(rng)
      if triple not in self._held:
        out.append(self._problem(triple, self.num_eval + len(out)))
    return out

  def longest_prompt(self) -> str:
    top = 10 ** self.max_digits - 1
    return f"{top}+{top}="

  def longest_answer_tokens(self) -> int:
    """Tokens of the longest chain (EOS included): a sum of two max_digits operands, or with
    "x" a product by two digits (12-token steps, up to max_digits + 2 answer digits)."""
    n = self.max_digits
    return max(9 * n + 1 + n + 1 + 1, 12 * n + 1 + n + 2 + 1 if "x" in self.operations else 0)

  final_answer = staticmethod(final_answer)

  def demonstration(self, problem: Problem, rng: np.random.Generator, *, digit_noise: float) -> str:
    """The chain of `problem`, each carry or borrow dropped independently w.p. `digit_noise`
    (none for an operation outside `noisy_operations`)."""
    a, op, b = parse(problem)
    if op not in self.noisy_operations:
      digit_noise = 0.0
    columns = len(str(a)) if op in "*x" else max(len(str(a)), len(str(b)))
    return chain(a, op, b, chain_lib.dropped_columns(columns, rng, digit_noise))


def make_chain_mix_task(config) -> tuple[ChainMixTask, CharTokenizer]:
  """The task of `config.task` (seeded by `config.seed`) and its tokenizer (the addition
  task's characters plus ``>``); refuses prompts longer than `sampling.max_prompt_len` or a
  `sampling.max_new_tokens` the longest chain does not fit in."""
  t = config.task
  try:
    task = ChainMixTask(t.min_digits, t.max_digits, t.num_eval, config.seed, t.operations,
                        t.get("noisy_operations"))
  except ValueError as e:
    raise ConfigError(f"config.task: {e}") from e
  tokenizer = CharTokenizer(extra=ANSWER_MARK + ("x" if "x" in task.operations else ""))
  check_addition_prompts(task, tokenizer, config.sampling.max_prompt_len)
  need = task.longest_answer_tokens()
  if config.sampling.max_new_tokens < need:
    raise ConfigError(f"config.sampling.max_new_tokens={config.sampling.max_new_tokens}: the "
                      f"longest chain of {t.max_digits}-digit operands (task.max_digits) is "
                      f"{need} tokens with EOS; must be >= {need}")
  return task, tokenizer
