"""Code problems (DeepCoder / LiveCodeBench style) scored by running the program's tests in a sandbox.

Rows come from any source :func:`oapl_jax.data.read_rows` reads (JSONL / JSON / Parquet file, or
``tfds:NAME[/CONFIG]`` with a split), each with a problem statement and tests in one of these forms:
  * {"inputs": [...], "outputs": [...]} (stdin/stdout), optionally with "fn_name" (call-based);
  * the same as a JSON string (how DeepCoder's files store it);
  * a LiveCodeBench list of {"input", "output", "testtype"} (converted on load; functional tests
    take their function name from the row's ``metadata["func_name"]``).
A row without a statement, with missing / empty / unreadable tests, or (with ``max_prompt_len``)
whose prompt is longer than that many tokens is malformed: fatal, or with ``skip_bad_rows``
skipped, counted and logged.
The prompt asks for one fenced Python block; the last such block of the answer is the program.
Tests never enter the prompt, and expected outputs never enter the sandbox (rewards/code.py).
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np

from oapl_jax.data.sources import host_shard, normalize_text, read_rows
from oapl_jax.rewards import code as code_reward
from oapl_jax.tasks.arithmetic import Problem
from oapl_jax.tasks.limits import too_long

_log = logging.getLogger(__name__)

CODE_INSTRUCTION_STDIN = (
    "Write a complete Python 3 program that solves the problem above. It must read its input "
    "from standard input and print the answer to standard output. Put the program in a single "
    "fenced code block:\n```python\n# your code\n```")
CODE_INSTRUCTION_CALL = (
    "Write a Python 3 solution to the problem above as the function `{fn_name}` (inside "
    "`class Solution` if the starter code uses one). Put the code in a single fenced code "
    "block:\n```python\n# your code\n```")
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str | None:
  """The last fenced code block of `response`, or None."""
  blocks = _FENCE.findall(response or "")
  return blocks[-1] if blocks else None


def metadata_func_name(metadata) -> str | None:
  """``metadata["func_name"]`` of a row (metadata may be a dict or a JSON string), or None."""
  if isinstance(metadata, str):
    try:
      metadata = json.loads(metadata) if metadata.strip() else {}
    except json.JSONDecodeError:
      return None
  name = metadata.get("func_name") if isinstance(metadata, dict) else None
  return name if isinstance(name, str) and name else None


def parse_tests(raw, where: str, *, fn_name: str | None = None) -> dict:
  """Tests of one row in our {"inputs", "outputs"[, "fn_name"]} form; ValueError naming `where`.

  `fn_name` is used for LiveCodeBench functional test lists (their rows keep it in metadata).
  An empty `where` leaves the message unprefixed.
  """
  where = f"{where}: " if where else ""
  if isinstance(raw, str):
    try:
      raw = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}tests are not valid JSON ({e.msg})") from None
  if isinstance(raw, list):
    try:
      raw = code_reward.from_livecodebench(raw, [], fn_name=fn_name)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{where}unreadable LiveCodeBench tests ({e})") from None
  if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), list) \
      or not isinstance(raw.get("outputs"), list):
    raise ValueError(f"{where}tests need lists 'inputs' and 'outputs'")
  if not raw["inputs"] or len(raw["inputs"]) != len(raw["outputs"]):
    raise ValueError(f"{where}tests are empty or inputs/outputs differ in length")
  return raw


class CodeTask:
  """Train/eval code problems from JSONL files; reward = sandboxed tests pass (rewards/code.py)."""

  def __init__(self, train_path: str, eval_path: str, *, tokenizer, question_field: str,
               tests_field: str, thinking: bool | None, num_eval: int | None,
               sandbox: dict, skip_bad_rows: bool = False, train_split: str = "train",
               eval_split: str = "test", data_dir: str | None = None,
               max_prompt_len: int | None = None):
    self.tokenizer, self.thinking, self.sandbox = tokenizer, thinking, dict(sandbox)
    self.max_prompt_len = max_prompt_len
    load = dict(question_field=question_field, tests_field=tests_field, data_dir=data_dir,
                skip_bad_rows=skip_bad_rows)
    eval_rows = self._load(eval_path, eval_split, role="eval", **load)
    held_out = {normalize_text(r["q"]) for r in eval_rows}
    train_rows = [r for r in self._load(train_path, train_split, role="train", **load)
                  if normalize_text(r["q"]) not in held_out]
    if not eval_rows:
      raise ValueError(f"{eval_path}: no rows")
    if not train_rows:
      raise ValueError(f"{train_path}: no training problem left after removing eval questions")
    eval_rows = eval_rows[:num_eval] if num_eval else eval_rows
    self._eval = [self._problem(r, i) for i, r in enumerate(eval_rows)]
    self._train = [self._problem(r, len(eval_rows) + i)
                   for i, r in host_shard(list(enumerate(train_rows)))]

  @classmethod
  def from_config(cls, t, tokenizer, *, max_prompt_len: int | None = None) -> "CodeTask":
    sandbox = dict(timeout_s=t.timeout_s, memory_mb=t.memory_mb, fraction=t.partial_credit,
                   allow_unsandboxed=t.allow_unsandboxed)
    return cls(t.train_path, t.eval_path, tokenizer=tokenizer, question_field=t.question_field,
               tests_field=t.tests_field, thinking=t.thinking, num_eval=t.num_eval, sandbox=sandbox,
               skip_bad_rows=t.skip_bad_rows, train_split=t.train_split, eval_split=t.eval_split,
               data_dir=t.data_dir, max_prompt_len=max_prompt_len)

  def _load(self, source, split, *, role, question_field, tests_field, data_dir, skip_bad_rows):
    """[{"q", "tests", "prompt"}] of `source`; rows with bad tests or too long a prompt are
    malformed (read_rows)."""
    def convert(row):
      if tests_field not in row:
        raise ValueError(f"missing field {tests_field!r}")
      tests = parse_tests(row[tests_field], "", fn_name=metadata_func_name(row.get("metadata")))
      prompt = self.make_prompt(row[question_field], tests)
      why = too_long(self.tokenizer, prompt, self.max_prompt_len)
      if why:
        raise ValueError(why)
      return {"q": row[question_field], "tests": tests, "prompt": prompt}

    rows, report = read_rows(source, split=split, data_dir=data_dir, skip_bad_rows=skip_bad_rows,
                             required={question_field: str}, convert=convert)
    _log.log(logging.WARNING if report.skipped else logging.INFO, "code %s data: %s", role,
             report.summary())
    return rows

  def make_prompt(self, question: str, tests: dict) -> str:
    """The chat-formatted prompt: the statement and the instruction (stdin or `fn_name`)."""
    instruction = (CODE_INSTRUCTION_CALL.format(fn_name=tests["fn_name"]) if tests.get("fn_name")
                   else CODE_INSTRUCTION_STDIN)
    return self.tokenizer.chat_prompt(question + "\n\n" + instruction, thinking=self.thinking)

  @staticmethod
  def _problem(row: dict, pid: int) -> Problem:
    return Problem(prompt=row["prompt"], answer=json.dumps(row["tests"]), id=pid)

  def eval_problems(self) -> list[Problem]:
    return list(self._eval)

  def train_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` problems drawn uniformly with replacement (deterministic given `rng`)."""
    return [self._train[int(i)] for i in rng.integers(0, len(self._train), size=n)]

  def score(self, response: str, problem: Problem) -> float:
    return self.score_batch([response], [problem])[0]

  def score_batch(self, responses: list[str], problems: list[Problem]) -> list[float]:
    """Runs the programs in parallel sandboxes; an answer without a code block scores 0."""
    programs = [extract_program(r) for r in responses]
    todo = [i for i, p in enumerate(programs) if p is not None]
    scores = [0.0] * len(responses)
    if todo:
      results = code_reward.score_batch([programs[i] for i in todo],
                                        [json.loads(problems[i].answer) for i in todo],
                                        **self.sandbox)
      for i, s in zip(todo, results):
        scores[i] = float(s)
    return scores
