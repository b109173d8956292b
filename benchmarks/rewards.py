"""Throughput of the rewards: sandboxed code (rewards.code.score_batch), math (rewards.math.score_batch).

Code: scores ~40 small correct programs (3 tests each; stdin/stdout and call-based mixed) with
a thread pool of `--workers`, `--reps` times, and prints the median programs/s (and tests/s).
Every program must score 1.0, so a broken sandbox cannot pass for a fast one.

Math: scores `--math-answers` responses (groups of 8 sharing a gold answer: fractions, integers,
surds; half right in a form that needs math_verify, half wrong) on the process pool of
`--workers`, `--reps` times (fresh gold answers each rep, so no parse cache carries over), and
prints the median answers/s. Every score must match its expected value.

  python benchmarks/rewards.py [--only all|code|math] [--programs 40] [--math-answers 128]
                               [--workers 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax.rewards import code  # noqa: E402
from oapl_jax.rewards import math as math_reward  # noqa: E402

_STDIN = [
    ("a, b = map(int, input().split())\nprint(a + b)\n",
     {"inputs": ["1 2\n", "40 2\n", "-5 5\n"], "outputs": ["3\n", "42\n", "0\n"]}),
    ("import sys\nxs = sys.stdin.read().split()\nprint(' '.join(sorted(xs, key=int)))\n",
     {"inputs": ["3 1 2\n", "5\n", "9 -1 4 4\n"], "outputs": ["1 2 3\n", "5\n", "-1 4 4 9\n"]}),
    ("s = input().strip()\nprint(s[::-1])\nprint(len(s))\n",
     {"inputs": ["abc\n", "racecar\n", "x\n"], "outputs": ["cba\n3\n", "racecar\n7\n", "x\n1\n"]}),
]
_CALL = [
    ("def fib(n):\n  a, b = 0, 1\n  for _ in range(n):\n    a, b = b, a + b\n  return a\n",
     {"inputs": [[0], [10], [30]], "outputs": [[0], [55], [832040]], "fn_name": "fib"}),
    ("class Solution:\n  def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
     "    seen = {}\n    for i, x in enumerate(nums):\n      if target - x in seen:\n"
     "        return [seen[target - x], i]\n      seen[x] = i\n",
     {"inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6], [[3, 3], 6]],
      "outputs": [[0, 1], [1, 2], [0, 1]], "fn_name": "twoSum"}),
]


def workload(n: int) -> tuple[list[str], list[dict]]:
  pool = _STDIN + _CALL
  programs, tests = [], []
  for i in range(n):
    prog, t = pool[i % len(pool)]
    programs.append(f"# program {i}\n{prog}")  # distinct texts, same behaviour
    tests.append(t)
  return programs, tests


def math_workload(n: int, rep: int) -> list[tuple[str, str, float]]:
  """`n` (response, gold, expected score) triples; the golds differ between reps."""
  out = []
  for i in range(n):
    k = 1000 * (rep + 1) + i // 8 + 2  # one gold per group of 8 answers
    kind, j = (i // 8) % 3, i % 4
    if kind == 0:
      gold = f"\\frac{{{k}}}{{{k + 1}}}"
      cands = [(f"\\boxed{{{k}/{k + 1}}}", 1.0),
               (f"\\boxed{{\\dfrac{{{2 * k}}}{{{2 * k + 2}}}}}", 1.0),
               (f"\\boxed{{\\frac{{{k + 1}}}{{{k}}}}}", 0.0), (f"so it is {k}", 0.0)]
    elif kind == 1:
      gold = str(k)
      cands = [(f"\\boxed{{{k - 1} + 1}}", 1.0), (f"\\boxed{{{2 * k}/2}}", 1.0),
               (f"\\boxed{{{k + 2}}}", 0.0), (f"\\boxed{{{k}^2}}", 0.0)]
    else:
      gold = f"{k}\\sqrt{{2}}"
      cands = [(f"\\boxed{{\\sqrt{{{2 * k * k}}}}}", 1.0),
               (f"\\boxed{{{k}\\cdot\\sqrt{{2}}}}", 1.0),
               (f"\\boxed{{{k}\\sqrt{{3}}}}", 0.0), (f"\\boxed{{{k + 1}\\sqrt{{2}}}}", 0.0)]
    response, want = cands[j]
    out.append((f"Reasoning about problem {i}... The answer is {response}.", gold, want))
  return out


def bench_math(args) -> None:
  # Start the pool and let each worker import sympy & co. (a real comparison, not exact match).
  math_reward.score_batch(["\\boxed{2/4}"] * 8, ["\\frac{1}{2}"] * 8, workers=args.workers)
  rates = []
  for rep in range(args.reps):
    triples = math_workload(args.math_answers, rep)
    responses, golds, want = zip(*triples)
    start = time.perf_counter()
    scores = math_reward.score_batch(responses, golds, workers=args.workers)
    elapsed = time.perf_counter() - start
    if list(scores) != list(want):
      bad = [t for t, s in zip(triples, scores) if s != t[2]][:3]
      raise SystemExit(f"math reward: wrong scores, e.g. {bad}")
    rates.append(len(responses) / elapsed)
  print(f"math reward: {statistics.median(rates):.1f} answers/s (median of {args.reps}; "
        f"{args.math_answers} answers, {args.workers} worker processes, {os.cpu_count()} CPUs; "
        f"runs: {', '.join(f'{r:.1f}' for r in rates)} answers/s)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", choices=("all", "code", "math"), default="all")
  parser.add_argument("--programs", type=int, default=40)
  parser.add_argument("--math-answers", type=int, default=128)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  if args.only in ("all", "code"):
    bench_code(args)
  if args.only in ("all", "math"):
    bench_math(args)


def bench_code(args) -> None:
  programs, tests = workload(args.programs)
  task = config_lib.repo_config("code.py").task  # the sandbox limits of a code run
  limits = dict(timeout_s=task.timeout_s, memory_mb=task.memory_mb)
  code.score_batch(programs[:2], tests[:2], workers=1, **limits)  # sandbox self-check, interpreter probe
  rates = []
  for _ in range(args.reps):
    start = time.perf_counter()
    scores = code.score_batch(programs, tests, workers=args.workers, **limits)
    elapsed = time.perf_counter() - start
    if scores != [1.0] * len(programs):
      raise SystemExit(f"a correct program did not score 1.0: {scores}")
    rates.append(len(programs) / elapsed)
  n_tests = sum(len(t["inputs"]) for t in tests)
  rate = statistics.median(rates)
  print(f"code reward: {rate:.1f} programs/s, {rate * n_tests / len(programs):.1f} tests/s "
        f"(median of {args.reps}; {len(programs)} programs x 3 tests, {args.workers} workers, "
        f"{os.cpu_count()} CPUs; runs: {', '.join(f'{r:.1f}' for r in rates)} programs/s)")


if __name__ == "__main__":
  main()
