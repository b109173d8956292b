"""Math reward: the final ``\\boxed{}`` answer, judged equivalent to the reference by math_verify.

``score(response, ground_truth)`` (alias of :func:`score_math`): the content of the *last*
``\\boxed{...}`` (or ``\\fbox{...}``) anywhere in the response (thinking included: a
truncated response whose last box is inside its reasoning is scored on that box) is compared
with the ground truth by ``math_verify`` (``parse`` + ``verify``): 1.0 if equivalent, else 0.0.
Optionally, a response without a box is scored on its last number. The reward never raises
and never hangs:

* candidate and gold answers longer than :data:`MAX_ANSWER_CHARS`, nested deeper than
  :data:`MAX_NESTING`, holding a digit run longer than :data:`MAX_DIGITS`, a numeric power
  tower (``9^{9^{9}}``, ``9**9**9``), an integer exponent with more than
  :data:`MAX_EXPONENT_DIGITS` digits or a factorial of a number with more than
  :data:`MAX_FACTORIAL_DIGITS` digits score 0.0 without reaching sympy (Python's big-integer
  arithmetic cannot be interrupted, so a timeout alone would not be enough);
* everything else runs under math_verify's own ``signal.alarm`` timeouts (``parsing_timeout``
  and ``timeout_seconds``, whole seconds, main thread only). Off the main thread signals are
  unavailable, so the timeouts are disabled there and only the input caps apply. Each parse
  and each gold/answer comparison gets its own timeout, so a call that does reach a timeout
  can take a few times ``timeout_s``; the caps keep that from happening on the inputs above.

:func:`score_batch` scores many answers on a pool of worker *processes* (math_verify's
timeouts need a process's main thread, so threads would lose them). The pool is made on first
use and reused by later calls of the same process.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import multiprocessing
import os
import re
import sys
import threading
import time
import types

MAX_ANSWER_CHARS = 1000  # longer extracted/gold answers score 0.0
MAX_DIGITS = 200  # longest allowed run of digits in an answer
MAX_EXPONENT_DIGITS = 6  # x^{1234567} and beyond are refused
MAX_FACTORIAL_DIGITS = 4  # 12345! and beyond are refused
MAX_NESTING = 10  # deepest allowed nesting of (), [], {} together (math_verify slows down fast)

# Silence math_verify's per-call warnings (timeouts, disabled timeouts): a noisy policy would
# flood the training log. Errors still propagate to the root logger.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# --------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _matching_brace(text: str, open_pos: int) -> int | None:
  """Index of the ``}`` closing the ``{`` at ``open_pos``, or None if unbalanced.

  Escaped braces ``\\{`` / ``\\}`` (and ``\\\\``) do not count.
  """
  depth = 0
  i, n = open_pos, len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2  # skip the escaped character (\{, \}, \\) or the command's first letter
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def extract_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, or None.

  Nested braces are handled (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); the last box
  wins. ``\\boxed 7`` (space form) gives ``7``. None if there is no box, or if the last one
  has unbalanced braces or no argument (e.g. a response truncated mid-box).
  """
  if not isinstance(text, str):
    return None
  last = None
  for last in _BOX_RE.finditer(text):
    pass
  if last is None:
    return None
  i = last.end()
  n = len(text)
  while i < n and text[i].isspace():
    i += 1
  if i >= n:
    return None
  if text[i] == "{":
    end = _matching_brace(text, i)
    return None if end is None else text[i + 1:end]
  if i == last.end():  # "\boxed7": not a box
    return None
  m = re.match(r"[^\s$]+", text[i:i + MAX_ANSWER_CHARS + 1])
  return m.group(0) if m else None


def _last_number(text: str) -> str | None:
  """The last number (``-12``, ``3.5``, ``1,234``) in ``text``, or None."""
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return None if last is None else last.group(0)


# --------------------------------------------------------------------------------------------
# Guards against inputs sympy cannot finish on
# --------------------------------------------------------------------------------------------

_NUMERIC_EXPR_CHARS = frozenset("0123456789^{}()[]+-*/. ")


def _exponent_spans(s: str):
  """Yields ``(exponent_text, end)`` for each ``^`` in ``s`` (``**`` already rewritten)."""
  n = len(s)
  for i, c in enumerate(s):
    if c != "^":
      continue
    j = i + 1
    while j < n and s[j] == " ":
      j += 1
    if j >= n:
      yield "", j
    elif s[j] == "{":
      end = _matching_brace(s, j)
      if end is None:
        yield s[j:], n
      else:
        yield s[j + 1:end], end + 1
    elif s[j] == "\\":
      m = re.match(r"\\[A-Za-z]+", s[j:])
      k = j + (len(m.group(0)) if m else 2)
      yield s[j:k], k
    elif s[j].isdigit():
      m = re.match(r"\d+(?:\.\d+)?", s[j:])
      yield m.group(0), j + len(m.group(0))
    else:
      yield s[j], j + 1


def _nesting_depth(s: str) -> int:
  """Deepest nesting of brackets of any kind in ``s`` (escaped braces count too)."""
  depth = best = 0
  for c in s:
    if c in "([{":
      depth += 1
      best = max(best, depth)
    elif c in ")]}":
      depth = max(0, depth - 1)
  return best


def _too_hard(s: str) -> bool:
  """Whether ``s`` could make sympy compute a gigantic number, or parse for too long."""
  if len(s) > MAX_ANSWER_CHARS or _nesting_depth(s) > MAX_NESTING:
    return True
  if re.search(r"\d{%d,}" % (MAX_DIGITS + 1), s):
    return True
  if re.search(r"\d{%d,}\s*!" % (MAX_FACTORIAL_DIGITS + 1), s):
    return True
  t = s.replace("**", "^")
  for exponent, end in _exponent_spans(t):
    if re.search(r"\d{%d,}" % (MAX_EXPONENT_DIGITS + 1), exponent):
      return True
    nested = "^" in exponent or t[end:end + 1] == "^" or t[end:].lstrip()[:1] == "^"
    if nested and set(exponent) <= _NUMERIC_EXPR_CHARS:
      return True  # numeric power tower: 9^{9^{9}}, 9^9^9, 9**9**9
  return False


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------

_STRIP_RE = re.compile(r"\s+|\\left|\\right|\\!|\\,|\\;|\$")


def _canonical(s: str) -> str:
  """Cheap normal form for the exact-match fast path."""
  return _STRIP_RE.sub("", s).rstrip(".")


def _timeouts(timeout_s: float | None) -> int | None:
  """math_verify's whole-second timeout, or None where ``signal.alarm`` is unavailable."""
  if timeout_s is None or timeout_s <= 0:
    return None
  if threading.current_thread() is not threading.main_thread():
    return None
  return max(1, math.ceil(timeout_s))


def _as_latex(answer: str) -> str:
  """``answer`` in a form math_verify's LaTeX extractor picks up as a whole."""
  if _matching_brace("{" + answer + "}", 0) == len(answer) + 1:
    return "\\boxed{" + answer + "}"
  return "$" + answer + "$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
  """Parsed ground truth (cached: a group of samples shares one gold answer)."""
  from math_verify import parse

  boxed = extract_boxed(gold) if _BOX_RE.search(gold) else None
  text = _as_latex(boxed) if boxed is not None else (gold if "$" in gold else _as_latex(gold))
  return tuple(parse(text, parsing_timeout=timeout))


def score_math(response: str, ground_truth: str, *, fallback_last_number: bool = False,
               timeout_s: float = 5.0) -> float:
  """1.0 if ``response``'s final answer is equivalent to ``ground_truth``, else 0.0.

  The final answer is the last ``\\boxed{}``/``\\fbox{}`` content; if there is none and
  ``fallback_last_number`` is set, the last number in ``response``. The ground truth may be
  plain (``"1/2"``, ``"\\frac{1}{2}"``, ``"0.5"``), boxed or in ``$...$``. Equivalence is
  math_verify's ``verify(parse(gold), parse(answer))`` under ``timeout_s`` (rounded up to
  whole seconds, per parse / comparison). Never raises; see the module docstring for the
  guards that keep it fast on pathological inputs.
  """
  try:
    if not isinstance(response, str) or not isinstance(ground_truth, str):
      return 0.0
    gold = ground_truth.strip()
    if not gold or _too_hard(gold):
      return 0.0
    answer = extract_boxed(response)
    if answer is None and fallback_last_number:
      answer = _last_number(response)
    if answer is None:
      return 0.0
    answer = answer.strip()
    if not answer or _too_hard(answer):
      return 0.0
    gold_inner = extract_boxed(gold) if _BOX_RE.search(gold) else gold
    if gold_inner is not None and _canonical(answer) == _canonical(gold_inner) != "":
      return 1.0

    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = _timeouts(timeout_s)
    try:
      gold_parsed = list(_parse_gold(gold, timeout))
      if not gold_parsed:
        return 0.0
      pred_parsed = parse(_as_latex(answer), parsing_timeout=timeout)
      if not pred_parsed:
        return 0.0
      ok = verify(gold_parsed, pred_parsed, timeout_seconds=timeout)
    except TimeoutException:
      return 0.0
    return 1.0 if ok else 0.0
  except Exception:  # noqa: BLE001 - the reward must never crash training
    return 0.0


score = score_math  # the reward API name: oapl_jax.rewards.math.score(response, ground_truth)


# --------------------------------------------------------------------------------------------
# Batched scoring on worker processes
# --------------------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_key: tuple[int, int] | None = None  # (pid that made it, workers)


def _score_chunk(responses: list, ground_truths: list, kw: dict) -> list[float]:
  """Worker side: :func:`score_math` of each pair (in the worker's main thread)."""
  return [score_math(r, g, **kw) for r, g in zip(responses, ground_truths)]


def _warm() -> None:
  """Worker start-up: import math_verify before the first batch arrives."""
  import math_verify  # noqa: F401, PLC0415


def _shutdown_pool(kill: bool) -> None:
  """Drops the pool (killing its workers if ``kill``); the next call makes a new one."""
  global _pool, _pool_key
  pool, _pool, _pool_key = _pool, None, None
  if pool is None:
    return
  if kill:
    procs = getattr(pool, "_processes", None) or {}  # no public API for this in Python 3.11
    for p in list(procs.values()):
      p.terminate()
  pool.shutdown(wait=False, cancel_futures=True)


def _get_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
  """The process's pool of ``workers`` processes, made (and its workers started) on first use.

  Workers are *spawned* (the trainer is multi-threaded, so forking it is unsafe). A spawned
  process normally re-imports the parent's ``__main__`` (for ``python -m oapl_jax.main`` that
  is JAX, TensorFlow and the trainer: ~5 s and ~1 GB per worker); the workers need only this
  module, so the parent's ``__main__`` is hidden while they start.
  """
  global _pool, _pool_key
  key = (os.getpid(), workers)
  if _pool is not None and _pool_key == key:
    return _pool
  if _pool is not None and _pool_key[0] == os.getpid():
    _shutdown_pool(kill=False)
  pool = concurrent.futures.ProcessPoolExecutor(
      max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm)
  main = sys.modules.get("__main__")
  sys.modules["__main__"] = types.ModuleType("__main__")
  try:  # workers start at submit time: submit one task per worker to start them all now
    warmups = [pool.submit(int, 0) for _ in range(workers)]
  finally:
    if main is not None:
      sys.modules["__main__"] = main
  concurrent.futures.wait(warmups)
  _pool, _pool_key = pool, key
  return pool


def score_batch(responses, ground_truths, *, workers: int, batch_timeout_s: float | None = None,
                **kw) -> list[float]:
  """``[score_math(r, g, **kw) for r, g in zip(responses, ground_truths)]`` on ``workers``
  processes (in-process for ``workers <= 1`` or a single answer). Never raises. ``workers`` has
  no default: a run takes it from its config (``task.reward_workers``), its one owner.

  The answers go out in chunks (about 4 per worker). A chunk not back after
  ``batch_timeout_s`` (default: 30 s plus 4 x ``timeout_s`` per answer of a worker) scores
  0.0 and the pool is killed and made anew; a chunk whose worker died is scored in-process.
  """
  responses, ground_truths = list(responses), list(ground_truths)
  if len(responses) != len(ground_truths):
    raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
  n = len(responses)
  if workers <= 1 or n <= 1:
    return [score_math(r, g, **kw) for r, g in zip(responses, ground_truths)]
  size = max(1, math.ceil(n / (4 * workers)))
  chunks = [(i, min(n, i + size)) for i in range(0, n, size)]
  per_answer = 4 * max(1.0, float(kw.get("timeout_s", 5.0)))
  with _pool_lock:
    try:
      pool = _get_pool(workers)
      futures = [pool.submit(_score_chunk, responses[a:b], ground_truths[a:b], kw)
                 for a, b in chunks]
    except Exception:  # noqa: BLE001 - no pool (e.g. a sandbox without process spawning)
      logging.getLogger(__name__).exception("math reward: process pool unavailable; scoring inline")
      _shutdown_pool(kill=True)
      return [score_math(r, g, **kw) for r, g in zip(responses, ground_truths)]
    deadline = time.monotonic() + (batch_timeout_s if batch_timeout_s is not None
                                   else 30.0 + per_answer * math.ceil(n / workers))
    scores: list[float] = [0.0] * n
    broken = timed_out = False
    for (a, b), fut in zip(chunks, futures):
      try:
        scores[a:b] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
      except concurrent.futures.TimeoutError:
        timed_out = True  # these answers keep 0.0
      except Exception:  # noqa: BLE001 - a dead worker (BrokenProcessPool) or a pickling error
        broken = True
        scores[a:b] = [score_math(r, g, **kw) for r, g in zip(responses[a:b], ground_truths[a:b])]
    if timed_out or broken:
      logging.getLogger(__name__).warning(
          "math reward: worker pool %s; it is replaced", "timed out" if timed_out else "broke")
      _shutdown_pool(kill=True)
    return scores
