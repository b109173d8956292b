"""Code problems (DeepCoder / LiveCodeBench style) scored by running the program's tests in a sandbox.

Rows come from any source :func:`oapl_jax.data.read_rows` reads (JSONL / JSON / Parquet file, or
``tfds:NAME[/CONFIG]`` with a split), each with a problem statement and tests in one of the
forms :func:`oapl_jax.data.code_tests.parse_tests` reads:
  * {"inputs": [...], "outputs": [...]} (stdin/stdout), optionally with "fn_name" (call-based);
  * the same as a JSON string (how DeepCoder's files store it);
  * a LiveCodeBench list of {"input", "output", "testtype"} (converted on load; functional tests
    take their function name from the row's ``metadata["func_name"]``).
A row without a statement, with missing / empty / unreadable tests, or (with ``max_prompt_len``)
whose prompt is longer than that many tokens is malformed: fatal, or with ``skip_bad_rows``
skipped, counted and logged (reading, removing eval questions and host sharding are
:class:`oapl_jax.tasks.rows.RowTask`'s).
The prompt asks for one fenced Python block; the last such block of the answer is the program.
Tests never enter the prompt, and expected outputs never enter the sandbox (rewards/code.py).
"""

from __future__ import annotations

import json
import re

from oapl_jax.data.code_tests import metadata_func_name, parse_tests  # noqa: F401 (re-exported)
from oapl_jax.rewards import code as code_reward
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.rows import RowTask, without_eval_questions

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


class CodeTask(RowTask):
  """Train / eval code problems from any row source; reward: the sandboxed tests pass
  (rewards/code.py).

  * Prompt: the statement, a blank line and :data:`CODE_INSTRUCTION_STDIN` (or
    :data:`CODE_INSTRUCTION_CALL` for call-based tests), through the chat template.
  * Eval problems: the first ``num_eval`` rows of ``eval_path`` (all if None or 0), ids
    ``0 ..``. Train problems: the rows of ``train_path`` whose statement is no eval statement,
    all of them on every host, ids ``(number of eval problems) + (index among those rows)``.
  * ``sandbox``: keyword arguments of :func:`oapl_jax.rewards.code.score_batch`.

  Raises:
    ValueError: malformed rows (``file:line`` / ``file:row N``), an empty eval source, or no
      train row left after removing eval questions.
  """

  name = "code"

  def __init__(self, train_path: str, eval_path: str, *, tokenizer, question_field: str,
               tests_field: str, thinking: bool | None, num_eval: int | None,
               sandbox: dict, skip_bad_rows: bool = False, train_split: str = "train",
               eval_split: str = "test", data_dir: str | None = None,
               max_prompt_len: int | None = None, tools: list[dict] | None = None):
    super().__init__(tokenizer=tokenizer, thinking=thinking, max_prompt_len=max_prompt_len,
                     data_dir=data_dir, skip_bad_rows=skip_bad_rows, tools=tools)
    self.sandbox = dict(sandbox)
    self._question_field, self._tests_field = question_field, tests_field
    required = {question_field: str}
    eval_rows = self._read("eval", eval_path, eval_split, required)
    train_rows = [r for _, r in without_eval_questions(
        self._read("train", train_path, train_split, required), eval_rows)]
    if not eval_rows:
      raise ValueError(f"{eval_path}: no rows")
    if not train_rows:
      raise ValueError(f"{train_path}: no training problem left after removing eval questions")
    eval_rows = eval_rows[:num_eval] if num_eval else eval_rows
    self._set_eval(eval_rows)
    self._set_train(list(enumerate(train_rows)), id_offset=len(eval_rows))

  @classmethod
  def from_config(cls, t, tokenizer, *, max_prompt_len: int | None = None,
                  tools: list[dict] | None = None) -> "CodeTask":
    """The task of the config's `task` section `t` (configs/code.py)."""
    sandbox = dict(timeout_s=t.timeout_s, memory_mb=t.memory_mb, fraction=t.partial_credit,
                   allow_unsandboxed=t.allow_unsandboxed)
    return cls(t.train_path, t.eval_path, tokenizer=tokenizer, question_field=t.question_field,
               tests_field=t.tests_field, thinking=t.thinking, num_eval=t.num_eval, sandbox=sandbox,
               skip_bad_rows=t.skip_bad_rows, train_split=t.train_split, eval_split=t.eval_split,
               data_dir=t.data_dir, max_prompt_len=max_prompt_len, tools=tools)

  def _fields(self, row: dict) -> dict:
    """``{"question", "answer" (the tests as JSON), "prompt"}`` of a row; ValueError for bad
    tests."""
    if self._tests_field not in row:
      raise ValueError(f"missing field {self._tests_field!r}")
    tests = parse_tests(row[self._tests_field], "",
                        fn_name=metadata_func_name(row.get("metadata")))
    question = row[self._question_field]
    return {"question": question, "answer": json.dumps(tests),
            "prompt": self.make_prompt(question, tests)}

  def make_prompt(self, question: str, tests: dict) -> str:
    """The chat-formatted prompt: the statement and the instruction (stdin or `fn_name`)."""
    instruction = (CODE_INSTRUCTION_CALL.format(fn_name=tests["fn_name"]) if tests.get("fn_name")
                   else CODE_INSTRUCTION_STDIN)
    return self._chat(question + "\n\n" + instruction)

  def score(self, response: str, problem: Problem) -> float:
    """:meth:`score_batch` of one answer."""
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
