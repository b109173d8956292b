"""Data sources (oapl_jax/data): JSONL / JSON / Parquet / TFDS rows, bad-row reports, shuffling,
sharding and de-duplication; tasks reading any source; the Hugging Face conversion script; and
batched math scoring on worker processes (what the loop calls through MathTask.score_batch)."""

import base64
import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import math as math_config
from oapl_jax.config import ConfigError, validate
from oapl_jax.data import BadRowError, RowReport, dedup, read_rows, select
from oapl_jax.data.code_tests import parse_tests
from oapl_jax.errors import UserError
from oapl_jax.rewards import code as code_reward
from oapl_jax.rewards import math as math_reward
from oapl_jax.tasks import code as code_task
from oapl_jax.tasks.code import CodeTask
from oapl_jax.tasks.hf_tokenizer import HFTokenizer
from oapl_jax.tasks.math import MathTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = os.path.join(ROOT, "launch", "convert_hf_datasets.py")


def _load_script(path):
  """The script at `path` as a module, without leaving a __pycache__ folder in launch/."""
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
  try:
    spec.loader.exec_module(module)
  finally:
    sys.dont_write_bytecode = before
  return module


convert_hf_datasets = _load_script(CONVERT)

MATH = {"question": str, "answer": str}
CODE = {"problem": str, "tests": list}


def _jsonl(path, lines):
  path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
  return str(path)


def _parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


# --- JSONL / JSON ---------------------------------------------------------------------------


def test_jsonl_rows_and_report(tmp_path):
  p = _jsonl(tmp_path / "ok.jsonl", ['{"question": "a?", "answer": "1", "x": [1]}', "",
                                      '{"question": "b?", "answer": "2"}'])
  rows, report = read_rows(p, required=MATH)
  assert [r["question"] for r in rows] == ["a?", "b?"] and rows[0]["x"] == [1]
  assert (report.path, report.total, report.skipped, report.kept) == (p, 2, 0, 2)
  assert report.summary() == f"{p}: 2 rows kept, 0 skipped"


@pytest.mark.parametrize("bad, why", [
    (b'{"problem": "p", "tests": ', "malformed JSON"),
    (b'"just a string"', "expected a JSON object"),
    (b'{"tests": [1]}', "missing field 'problem'"),
    (b'{"problem": 7, "tests": [1]}', "field 'problem' must be a string, got int"),
    (b'{"problem": "p", "tests": "[1]"}', "field 'tests' must be a list, got str"),
    (b'{"problem": "p", "tests": []}', "field 'tests' is empty"),
    (b'{"problem": "caf\xe9", "tests": [1]}', "not valid UTF-8"),
])
def test_jsonl_bad_row_is_fatal_or_skipped(tmp_path, bad, why):
  good = b'{"problem": "p", "tests": [1]}'
  p = _jsonl(tmp_path / "bad.jsonl", [good, good, bad, good])
  with pytest.raises(BadRowError) as e:
    read_rows(p, required=CODE)
  assert str(e.value).startswith(f"{p}:3: ") and why in str(e.value)
  assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)  # printed as one line
  rows, report = read_rows(p, required=CODE, skip_bad_rows=True)
  assert len(rows) == 3 and (report.total, report.skipped) == (4, 1)
  assert report.reasons == [str(e.value)]
  assert report.summary() == f"{p}: 3 rows kept, 1 skipped ({e.value})"


def test_report_keeps_the_first_few_reasons(tmp_path):
  p = _jsonl(tmp_path / "many.jsonl", ['{"question": "q"}'] * 8 + ['{"question": "q", "answer": "1"}'])
  rows, report = read_rows(p, required=MATH, skip_bad_rows=True)
  assert len(rows) == 1 and report.skipped == 8 and len(report.reasons) == 5
  assert report.reasons[4].startswith(f"{p}:5: ") and report.summary().endswith("; ...)")


def test_bool_is_not_an_int_and_tuple_types(tmp_path):
  p = _jsonl(tmp_path / "ids.jsonl", ['{"id": 3}', '{"id": "x"}', '{"id": true}'])
  with pytest.raises(ValueError, match=r"ids\.jsonl:3: field 'id' must be a string or an int, got bool"):
    read_rows(p, required={"id": (str, int)})


def test_json_array_and_unknown_or_missing_sources(tmp_path):
  p = tmp_path / "rows.json"
  p.write_text(json.dumps([{"question": "a", "answer": "1"}, {"question": "b"}]))
  with pytest.raises(ValueError, match=r"rows\.json:row 1: missing field 'answer'"):
    read_rows(str(p), required=MATH)
  with pytest.raises(FileNotFoundError, match="nope.parquet"):
    read_rows(str(tmp_path / "nope.parquet"))
  with pytest.raises(ValueError, match="unknown kind of data source"):
    read_rows(str(tmp_path / "rows.csv"))


def test_convert_hook_marks_rows_malformed(tmp_path):
  p = _jsonl(tmp_path / "c.jsonl", ['{"n": 1}', '{"n": -2}', '{"n": 3}'])

  def positive(row):
    if row["n"] < 0:
      raise ValueError("n must be positive")
    return {"n2": row["n"] * 2}

  rows, report = read_rows(p, required={"n": int}, convert=positive, skip_bad_rows=True)
  assert rows == [{"n2": 2}, {"n2": 6}] and report.reasons == [f"{p}:2: n must be positive"]


# --- Parquet --------------------------------------------------------------------------------


def test_parquet_rows_bad_rows_name_file_and_row(tmp_path):
  p = _parquet(tmp_path / "code.parquet", [
      {"problem": "p0", "tests": [1, 2], "meta": {"k": "v"}},
      {"problem": "p1", "tests": [3], "meta": {"k": "w"}},
      {"problem": None, "tests": [4], "meta": {"k": "x"}},
      {"problem": "p3", "tests": [], "meta": {"k": "y"}},
  ])
  with pytest.raises(ValueError, match=rf"^{p}:row 2: field 'problem' must be a string, got NoneType$"):
    read_rows(p, required=CODE)
  rows, report = read_rows(p, required=CODE, skip_bad_rows=True)
  assert rows == [{"problem": "p0", "tests": [1, 2], "meta": {"k": "v"}},
                  {"problem": "p1", "tests": [3], "meta": {"k": "w"}}]
  assert report.reasons[1] == f"{p}:row 3: field 'tests' is empty"
  assert report.summary().startswith(f"{p}: 2 rows kept, 2 skipped (")


def test_parquet_undecodable_binary_text(tmp_path):
  table = pa.table({"question": pa.array([b"fine", b"\xff\xfe"], pa.binary()),
                    "answer": ["1", "2"]})
  p = str(tmp_path / "bytes.parquet")
  pq.write_table(table, p)
  rows, report = read_rows(p, required=MATH, skip_bad_rows=True)
  assert rows == [{"question": "fine", "answer": "1"}]
  assert report.reasons[0].startswith(f"{p}:row 1: not valid UTF-8")


# --- TFDS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """A tiny TFDS dataset `oapl_tiny_rows/main` (train: 3 rows, test: 2) prepared locally."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow_datasets as tfds

  rows = {"train": [{"question": "What is 1+1?", "answer": "2", "n": 1, "tags": ["a"]},
                    {"question": "What is 2+2?", "answer": "4", "n": 2, "tags": []},
                    {"question": "What is 5+5?", "answer": "10", "n": 3, "tags": ["b", "c"]}],
          "test": [{"question": "What is 3+3?", "answer": "6", "n": 4, "tags": ["d"]},
                   {"question": "What is 4+4?", "answer": "8", "n": 5, "tags": ["e"]}]}

  class OaplTinyRows(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="main")]

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "question": tfds.features.Text(), "answer": tfds.features.Text(),
          "n": tfds.features.Scalar(dtype=np.int64),
          "tags": tfds.features.Sequence(tfds.features.Text())}))

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(split) for split in rows}

    def _generate_examples(self, split):
      for i, row in enumerate(rows[split]):
        yield i, row

  data_dir = str(tmp_path_factory.mktemp("tfds"))
  OaplTinyRows(data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return data_dir


def test_tfds_rows_are_plain_python(tfds_dir):
  rows, report = read_rows("tfds:oapl_tiny_rows/main", split="train", data_dir=tfds_dir,
                           required=MATH)
  assert sorted(rows, key=lambda r: r["n"]) == [
      {"question": "What is 1+1?", "answer": "2", "n": 1, "tags": ["a"]},
      {"question": "What is 2+2?", "answer": "4", "n": 2, "tags": []},
      {"question": "What is 5+5?", "answer": "10", "n": 3, "tags": ["b", "c"]}]
  assert all(type(r["n"]) is int and type(r["question"]) is str for r in rows)
  assert report.path == "tfds:oapl_tiny_rows/main/train" and report.kept == 3


def test_tfds_bad_rows_and_errors(tfds_dir):
  src = "tfds:oapl_tiny_rows/main"
  rows, report = read_rows(src, split="train", data_dir=tfds_dir, skip_bad_rows=True,
                           required={"tags": list})
  assert len(rows) == 2 and report.skipped == 1
  assert report.reasons[0].startswith(f"{src}/train:row ") and "field 'tags' is empty" in report.reasons[0]
  with pytest.raises(ValueError, match="needs a split"):
    read_rows(src, data_dir=tfds_dir)
  with pytest.raises(ValueError, match=r"oapl_no_such_dataset_xyz .*cannot load it .*Nothing is downloaded"):
    read_rows("tfds:oapl_no_such_dataset_xyz", split="train", data_dir=tfds_dir)
  with pytest.raises(ValueError, match=r"split 'validation'.*cannot load it \(Unknown split"):
    read_rows(src, split="validation", data_dir=tfds_dir)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  from oapl_jax.models.tiny_hf import make_tokenizer
  folder = str(tmp_path_factory.mktemp("tok"))
  make_tokenizer(512).save_pretrained(folder)
  return HFTokenizer(folder)


def test_math_task_reads_tfds_and_parquet_and_logs_reports(tfds_dir, tmp_path, tokenizer, caplog):
  eval_p = _parquet(tmp_path / "eval.parquet", [
      {"question": "What is 2+2?", "answer": "4"}, {"question": "What is 9+9?", "answer": None},
      {"question": "What is 7+7?", "answer": "14"}])
  with pytest.raises(ValueError, match=r"eval\.parquet:row 1: field 'answer' must be a string"):
    MathTask("tfds:oapl_tiny_rows/main", eval_p, tokenizer=tokenizer, data_dir=tfds_dir)
  with caplog.at_level(logging.INFO, logger="oapl_jax.tasks.math"):
    task = MathTask("tfds:oapl_tiny_rows/main", eval_p, tokenizer=tokenizer, data_dir=tfds_dir,
                    skip_bad_rows=True, train_split="train")
  assert [p.answer for p in task.eval_problems()] == ["4", "14"]
  assert task.num_train == 2 and task.num_train_dropped == 1  # "What is 2+2?" is an eval question
  assert {p.answer for p in task.train_problems(np.random.default_rng(0), 30)} == {"2", "10"}
  text = caplog.text
  assert "tfds:oapl_tiny_rows/main/train: 3 rows kept, 0 skipped" in text
  assert f"{eval_p}: 2 rows kept, 1 skipped ({eval_p}:row 1:" in text


def test_config_accepts_tfds_sources(tmp_path):
  c = math_config.get_config()
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.json").write_text("{}")  # validate looks for the file only
  c.task.tokenizer_path = str(tmp_path / "tok")
  c.task.eval_path = _jsonl(tmp_path / "e.jsonl", ['{"problem": "q", "answer": "1"}'])
  c.task.train_path = "tfds:deep_scale_r"
  validate(c)
  c.task.train_path = str(tmp_path / "missing.parquet")
  with pytest.raises(ConfigError, match=r"task\.train_path.*no such file"):
    validate(c)
  assert c.task.skip_bad_rows is False and (c.task.train_split, c.task.eval_split) == ("train", "test")


def test_code_task_reads_parquet_with_livecodebench_tests(tmp_path, tokenizer):
  lcb = [{"input": "2\n3", "output": "6", "testtype": "functional"}]
  train = _parquet(tmp_path / "train.parquet", [
      {"problem": "Multiply two numbers.", "tests": json.dumps(lcb),
       "metadata": json.dumps({"func_name": "mul"})},
      {"problem": "Broken tests.", "tests": "{not json", "metadata": "{}"},
      {"problem": "Sum.", "tests": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}),
       "metadata": "{}"}])
  evals = _jsonl(tmp_path / "eval.jsonl",
                 ['{"problem": "Echo.", "tests": {"inputs": ["a\\n"], "outputs": ["a\\n"]}}'])
  kw = dict(tokenizer=tokenizer, question_field="problem", tests_field="tests", thinking=None,
            num_eval=None, sandbox={})
  with pytest.raises(ValueError, match=r"train\.parquet:row 1: tests are not valid JSON"):
    CodeTask(train, evals, **kw)
  task = CodeTask(train, evals, skip_bad_rows=True, **kw)
  problems = task.train_problems(np.random.default_rng(0), 20)
  mul = next(p for p in problems if "Multiply" in p.prompt)
  assert "`mul`" in mul.prompt
  assert json.loads(mul.answer) == {"inputs": [[2, 3]], "outputs": [6], "fn_name": "mul"}
  assert {p.id for p in problems} <= {1, 2}


def _code_prompt_len(tokenizer, problem):
  """Tokens of a stdin code problem's prompt, counted as the trainer encodes it."""
  prompt = tokenizer.chat_prompt(problem + "\n\n" + code_task.CODE_INSTRUCTION_STDIN)
  return len(tokenizer.encode(prompt, add_bos=True))


def test_code_task_over_long_prompt_is_a_bad_row(tmp_path, tokenizer):
  tests = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
  long_problem = "Add two numbers. " * 200
  train = _jsonl(tmp_path / "train.jsonl", [json.dumps({"problem": p, "tests": tests})
                                            for p in ("Sum.", long_problem, "Add.")])
  evals = _parquet(tmp_path / "eval.parquet", [
      {"problem": "Echo.", "tests": json.dumps(tests)},
      {"problem": long_problem + "Echo.", "tests": json.dumps(tests)}])
  n_train = _code_prompt_len(tokenizer, long_problem)
  n_eval = _code_prompt_len(tokenizer, long_problem + "Echo.")
  limit = max(_code_prompt_len(tokenizer, p) for p in ("Sum.", "Add.", "Echo."))
  assert limit < n_train < n_eval
  kw = dict(tokenizer=tokenizer, question_field="problem", tests_field="tests", thinking=None,
            num_eval=None, sandbox={}, max_prompt_len=limit)
  with pytest.raises(ValueError) as e:
    CodeTask(train, evals, **kw)
  assert str(e.value) == (f"{evals}:row 1: prompt of {n_eval} tokens (chat template and BOS "
                          f"included) is longer than sampling.max_prompt_len={limit}")
  task = CodeTask(train, evals, skip_bad_rows=True, **kw)
  assert [p.prompt for p in task.eval_problems()] == [
      tokenizer.chat_prompt("Echo.\n\n" + code_task.CODE_INSTRUCTION_STDIN)]
  assert {p.id for p in task.train_problems(np.random.default_rng(0), 30)} == {1, 2}
  with pytest.raises(ValueError, match=rf"train\.jsonl:2: prompt of {n_train} tokens .*"
                                       rf"sampling\.max_prompt_len={n_train - 1}$"):
    short_eval = _jsonl(tmp_path / "e.jsonl", [json.dumps({"problem": "Echo.", "tests": tests})])
    CodeTask(train, short_eval, **{**kw, "max_prompt_len": n_train - 1})


def test_make_task_checks_code_prompts_against_the_setting(tmp_path, tokenizer):
  from configs import code as code_config
  from oapl_jax.tasks import make_task
  c = code_config.get_config("tiny")
  c.task.tokenizer_path = tokenizer.path
  tests = {"inputs": ["1\n"], "outputs": ["1\n"], "fn_name": "echo"}
  c.task.train_path = _jsonl(tmp_path / "train.jsonl", [
      json.dumps({"problem": "Echo.", "tests": tests}),
      json.dumps({"problem": "Echo it. " * 100, "tests": tests})])
  c.task.eval_path = _jsonl(tmp_path / "eval.jsonl",
                           [json.dumps({"problem": "Copy.", "tests": tests})])
  c.sampling.max_prompt_len = 200  # the instruction alone is about 150 tokens
  with pytest.raises(ValueError, match=r"train\.jsonl:2: prompt of \d+ tokens .*"
                                       r"sampling\.max_prompt_len=200$"):
    make_task(c)
  c.task.skip_bad_rows = True
  task, _ = make_task(c)
  assert {p.id for p in task.train_problems(np.random.default_rng(0), 10)} == {1}


# --- select / dedup -------------------------------------------------------------------------


def test_select_shuffles_deterministically_and_shards():
  rows = [{"i": i} for i in range(23)]
  a = select(rows, seed=7, num_shards=1)
  assert a == select(rows, seed=7) and a != rows and a != select(rows, seed=8)
  assert sorted(r["i"] for r in a) == list(range(23))
  shards = [select(rows, seed=7, num_shards=4, shard_index=k) for k in range(4)]
  assert [len(s) for s in shards] == [6, 6, 6, 5]
  for k, shard in enumerate(shards):
    assert shard == a[k::4]  # row i of the shuffled order goes to shard i % 4
  assert sorted(r["i"] for s in shards for r in s) == list(range(23))
  assert select(rows, seed=None, num_shards=2, shard_index=1) == rows[1::2]
  with pytest.raises(ValueError, match="shard_index"):
    select(rows, seed=0, num_shards=2, shard_index=2)


def test_dedup_by_normalised_text():
  rows = [{"q": "What is  1+1?"}, {"q": "what is 1+1?\n"}, {"q": "What is 2+2?"},
          {"q": "WHAT IS 2+2?"}, {"q": "What is 1 + 1?"}]
  assert dedup(rows, "q") == [rows[0], rows[2], rows[4]]
  assert dedup(rows, lambda r: r["q"][:4]) == [rows[0]]


def test_row_report_summary_without_reasons():
  assert RowReport("x.jsonl", total=5, skipped=2).summary() == "x.jsonl: 3 rows kept, 2 skipped"


# --- launch/convert_hf_datasets.py ----------------------------------------------------------


def _read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_convert_deepscaler(tmp_path, capsys):
  src = _parquet(tmp_path / "train-00000-of-00001.parquet", [
      {"problem": "Find $x$ if $2x = 4$.", "answer": "2", "solution": "x = 2"},
      {"problem": "find $x$ if  $2x = 4$.", "answer": "2", "solution": "dup"},
      {"problem": "Compute $\\frac{1}{2} + \\frac{1}{2}$.", "answer": "1", "solution": "..."},
      {"problem": "No answer here.", "answer": None, "solution": "..."},
      {"problem": "  ", "answer": "3", "solution": "..."}])
  out = str(tmp_path / "deepscaler.jsonl")
  assert convert_hf_datasets.main(["--recipe=deepscaler", f"--out={out}", src]) == 0
  assert _read_jsonl(out) == [{"problem": "Find $x$ if $2x = 4$.", "answer": "2"},
                              {"problem": "Compute $\\frac{1}{2} + \\frac{1}{2}$.", "answer": "1"}]
  log = capsys.readouterr().out
  assert f"{src}: 3 rows kept, 2 skipped ({src}:row 3: no answer field" in log
  assert f"{src}:row 4: problem must be a non-empty string" in log
  assert "1 duplicate problems dropped" in log and "wrote 2 math problems" in log


@pytest.mark.parametrize("recipe, rows, want", [
    ("aime2025", [{"problem_idx": 1, "problem": "AIME I-1?", "answer": 70, "problem_type": ["NT"]},
                  {"problem_idx": 2, "problem": "AIME I-2?", "answer": 588, "problem_type": ["G"]}],
     [("AIME I-1?", "70"), ("AIME I-2?", "588")]),
    ("hmmt2025", [{"id": 0, "question": "HMMT Feb 1?", "answer": "\\frac{9}{4}"},
                  {"id": 1, "question": "HMMT Nov 1?", "answer": "2\\sqrt{3}"}],
     [("HMMT Feb 1?", "\\frac{9}{4}"), ("HMMT Nov 1?", "2\\sqrt{3}")]),
    ("brumo2025", [{"problem": "BRUMO 1?", "answer": 12.0}, {"problem": "BRUMO 2?", "answer": 0.5}],
     [("BRUMO 1?", "12"), ("BRUMO 2?", "0.5")]),
])
def test_convert_math_eval_sets(tmp_path, recipe, rows, want):
  src = _parquet(tmp_path / "test.parquet", rows)
  out = str(tmp_path / f"{recipe}.jsonl")
  assert convert_hf_datasets.main([f"--recipe={recipe}", f"--out={out}", src]) == 0
  assert [(r["problem"], r["answer"]) for r in _read_jsonl(out)] == want
  assert set(_read_jsonl(out)[0]) == {"problem", "answer"}


_ADD_K_TESTS = [{"input": "[1, 2, 3]\n2", "output": "[3, 4, 5]", "testtype": "functional"},
                {"input": "[]\n5", "output": "[]", "testtype": "functional"}]
_ADD_K_ROW = {"problem": "Add k to each (LiveCodeBench).",
              "starter_code": ("class Solution:\n"
                               "    def addK(self, nums: List[int], k: int) -> List[int]:\n"),
              "tests": json.dumps(_ADD_K_TESTS), "metadata": json.dumps({"func_name": "addK"})}


def test_convert_deepcoder(tmp_path, capsys):
  lcb = _ADD_K_TESTS
  src = _parquet(tmp_path / "lcbv5.parquet", [
      {"problem": "Sum two ints (TACO).", "starter_code": "",
       "tests": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}),
       "metadata": "{}"},
      {"problem": "Echo (PrimeIntellect).", "starter_code": "",
       "tests": json.dumps([{"type": "stdin_stdout", "input": "hi\n", "output": "hi\n"}]),
       "metadata": "{}"},
      {"problem": "Square (PrimeIntellect call).", "starter_code": "",
       "tests": json.dumps([{"type": "function_call", "fn_name": "sq", "input": [3], "output": [9]}]),
       "metadata": "{}"},
      _ADD_K_ROW,
      {"problem": "No tests.", "starter_code": "", "tests": "[]", "metadata": "{}"},
      {"problem": "Bad JSON.", "starter_code": "", "tests": "[{", "metadata": "{}"},
      {"problem": "Functional without a name.", "starter_code": "", "tests": json.dumps(lcb),
       "metadata": "{}"},
  ])
  out = str(tmp_path / "deepcoder.jsonl")
  assert convert_hf_datasets.main(["--recipe=deepcoder", f"--out={out}", src]) == 0
  rows = _read_jsonl(out)
  assert [r["tests"] for r in rows[:3]] == [
      {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]},
      {"inputs": ["hi\n"], "outputs": ["hi\n"]},
      {"inputs": [[3]], "outputs": [[9]], "fn_name": "sq"}]
  assert rows[3]["tests"] == {"inputs": [[[1, 2, 3], 2], [[], 5]], "outputs": [[3, 4, 5], []],
                              "fn_name": "addK"}
  assert "```python\nclass Solution:" in rows[3]["problem"] and len(rows) == 4
  log = capsys.readouterr().out
  assert f"{src}: 4 rows kept, 3 skipped ({src}:row 4: tests are empty" in log
  assert f"{src}:row 5: tests are not valid JSON" in log and "fn_name" in log
  for row in rows:
    parse_tests(row["tests"], "converted")  # what CodeTask accepts


def test_converted_deepcoder_tests_score_in_the_sandbox(tmp_path, requires_sandbox):
  src = _parquet(tmp_path / "lcbv5.parquet", [_ADD_K_ROW])
  out = str(tmp_path / "deepcoder.jsonl")
  assert convert_hf_datasets.main(["--recipe=deepcoder", f"--out={out}", src]) == 0
  (row,) = _read_jsonl(out)
  good = "class Solution:\n  def addK(self, nums, k):\n    return [x + k for x in nums]\n"
  assert code_reward.score(good, row["tests"], timeout_s=10, memory_mb=512) == 1.0
  assert code_reward.score(good.replace("x + k", "x - k"), row["tests"], timeout_s=10,
                           memory_mb=512) == 0.0


def _lcb_compress(tests) -> str:
  return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def test_convert_livecodebench_cli_with_dates_and_strict(tmp_path):
  def row(title, date, public, private, metadata="{}", starter=""):
    return {"question_title": title, "question_content": f"Problem {title}.", "platform": "atcoder",
            "contest_date": date, "starter_code": starter, "difficulty": "easy",
            "public_test_cases": json.dumps(public), "private_test_cases": private,
            "metadata": metadata}

  stdin = [{"input": "3\n", "output": "6\n", "testtype": "stdin"}]
  call = [{"input": "4", "output": "16", "testtype": "functional"}]
  src = _parquet(tmp_path / "lcb.parquet", [
      row("A", "2024-09-01T00:00:00", stdin,
          _lcb_compress([{"input": "10\n", "output": "20\n", "testtype": "stdin"}])),
      row("B", "2024-10-05T00:00:00", call, _lcb_compress(call), json.dumps({"func_name": "sq"}),
          "class Solution:\n    def sq(self, x: int) -> int:\n"),
      row("C", "2023-01-01T00:00:00", stdin, _lcb_compress(stdin)),  # before --min-date
      row("D", "2024-11-11T00:00:00", stdin, "!!not base64!!"),
  ])
  out = tmp_path / "lcb.jsonl"
  cmd = [sys.executable, CONVERT, "--recipe=livecodebench", f"--out={out}",
         "--min-date=2024-08-01", "--max-date=2025-02-01", src]
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert res.returncode == 0, res.stderr
  rows = _read_jsonl(out)
  assert [r["problem"].split("\n")[0] for r in rows] == ["Problem A.", "Problem B."]
  assert rows[0]["tests"] == {"inputs": ["3\n", "10\n"], "outputs": ["6\n", "20\n"]}
  assert rows[1]["tests"] == {"inputs": [[4], [4]], "outputs": [16, 16], "fn_name": "sq"}
  assert f"{src}:row 3: " in res.stdout and "1 rows outside the --min-date/--max-date" in res.stdout

  before = out.read_text()
  res = subprocess.run(cmd[:-1] + ["--strict", src], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
  assert res.returncode == 1 and f"error: {src}:row 3: " in res.stderr
  assert out.read_text() == before  # a failed conversion leaves the old output alone
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".convert_")]


# --- batched math scoring -------------------------------------------------------------------


def test_math_score_batch_matches_score_and_reuses_its_pool(tmp_path, tokenizer):
  responses = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}", "no box", "\\boxed{2\\sqrt{2}}",
               "\\boxed{\\sqrt{8}}", "\\boxed{x^2 - 1}", "\\boxed{(x-1)(x+1)}", None]
  golds = ["1/2", "\\frac{1}{2}", "4", "1", "\\sqrt{8}", "2\\sqrt{2}", "(x+1)(x-1)", "x^2-1", "1"]
  want = [math_reward.score_math(r, g) for r, g in zip(responses, golds)]
  assert want == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
  assert math_reward.score_batch(responses, golds, workers=2) == want
  pool = math_reward._pool
  assert pool is not None and math_reward.score_batch(responses[:3], golds[:3], workers=2) == want[:3]
  assert math_reward._pool is pool  # one pool per process, made once
  assert math_reward.score_batch(responses, golds, workers=1) == want
  with pytest.raises(ValueError, match="ground truths"):
    math_reward.score_batch(responses, golds[:2], workers=2)

  train = _jsonl(tmp_path / "t.jsonl", ['{"question": "Half of one?", "answer": "\\\\frac{1}{2}"}'])
  evals = _jsonl(tmp_path / "e.jsonl", ['{"question": "Two plus two?", "answer": "4"}'])
  task = MathTask(train, evals, tokenizer=tokenizer, reward_workers=2)
  (p,) = task.eval_problems()
  assert task.score_batch(["\\boxed{4}", "\\boxed{5}", "\\boxed{8/2}"], [p, p, p]) == [1.0, 0.0, 1.0]


_SHARD_SCRIPT = """
import json, sys
import jax
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from oapl_jax.data.sources import host_shard
print("SHARD", json.dumps(host_shard(list(range(11)))))
"""


def test_host_shard_splits_rows_across_jax_processes(tmp_path):
  """Two local processes joined by jax.distributed.initialize each get a disjoint share."""
  import socket
  import subprocess
  import sys
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  script = tmp_path / "shard.py"
  script.write_text(_SHARD_SCRIPT)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  shards = []
  for p in procs:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    shards.append(json.loads(out.split("SHARD", 1)[1]))
  assert shards[0] == list(range(0, 11, 2)) and shards[1] == list(range(1, 11, 2))
