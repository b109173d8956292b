"""Throughput of the sandboxed code reward (oapl_jax.rewards.code.score_batch).

Scores ~40 small correct programs (3 tests each; stdin/stdout and call-based mixed) with a
thread pool of `--workers`, `--reps` times, and prints the median programs/s (and tests/s).
Every program must score 1.0, so a broken sandbox cannot pass for a fast one.

  python benchmarks/rewards.py [--programs 40] [--workers 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oapl_jax.rewards import code  # noqa: E402

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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--programs", type=int, default=40)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  programs, tests = workload(args.programs)
  code.score_batch(programs[:2], tests[:2], workers=1)  # sandbox self-check, interpreter probe
  rates = []
  for _ in range(args.reps):
    start = time.perf_counter()
    scores = code.score_batch(programs, tests, workers=args.workers)
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
