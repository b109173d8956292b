"""Math task: boxed extraction, math_verify scoring, JSONL loading, HF tokenizer wrapper."""

import json
import os
import time

import numpy as np
import pytest

from oapl_jax.data import BadRowError
from oapl_jax.tasks.arithmetic import Problem
from oapl_jax.tasks.hf_tokenizer import HFTokenizer
from oapl_jax.rewards import math as math_reward
from oapl_jax.rewards.math import extract_boxed, score_math
from oapl_jax.tasks.math import MATH_INSTRUCTION, MathTask, load_jsonl, normalize_question

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(_ROOT, "configs", "data", "math_tiny_train.jsonl")
EVAL = os.path.join(_ROOT, "configs", "data", "math_tiny_eval.jsonl")

_SPECIALS = ["<s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def _make_tokenizer(folder, *, chat_template=_TEMPLATE, generation_eos=None):
  """A byte-level BPE tokenizer trained on a few strings, saved to `folder`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["What is 3+4? The answer is \\boxed{7}.", MATH_INSTRUCTION] * 3,
                          trainer)
  kwargs = {} if chat_template is None else {"chat_template": chat_template}
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                 pad_token="<pad>", **kwargs)
  fast.save_pretrained(str(folder))
  if generation_eos is not None:
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": generation_eos}, f)
  return str(folder)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return _make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
  return HFTokenizer(tok_dir)


# --- extract_boxed --------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("The answer is \\boxed{7}.", "7"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{\\{2\\}}}", "\\frac{\\sqrt{3}}{\\{2\\}}"),
    ("first \\boxed{3} then \\boxed{4}", "4"),
    ("\\boxed{3} and \\fbox{5}", "5"),
    ("\\boxed 7", "7"),
    ("\\boxed{ x = 2 }", " x = 2 "),
    ("no box here: 7", None),
    ("", None),
    ("\\boxed{\\frac{1}{2}", None),
    ("\\boxed{3} then \\boxed{4", None),  # the last box is unbalanced (truncated response)
    ("ends with \\boxed", None),
])
def test_extract_boxed(text, want):
  assert extract_boxed(text) == want


# --- score_math -----------------------------------------------------------------------------


@pytest.mark.parametrize("response, gold", [
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\boxed{0.5}", "1/2"),
    ("\\boxed{1/2}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("so the answer is \\boxed{7}.", "7"),
    ("\\boxed{7}", "\\boxed{7}"),
    ("\\boxed{7}", "$7$"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
    ("\\boxed{\\dfrac{9}{2}}", "\\frac{9}{2}"),
    ("\\boxed{-12}", "-12"),
    ("wrong \\boxed{5} then fixed \\boxed{6}", "6"),
])
def test_score_math_equivalent(response, gold):
  assert score_math(response, gold) == 1.0


@pytest.mark.parametrize("response, gold", [
    ("\\boxed{8}", "7"),
    ("\\boxed{-7}", "7"),
    ("\\boxed{7} then \\boxed{8}", "7"),
    ("The answer is 7", "7"),  # no box and no fallback
    ("", "7"),
    ("\\boxed{}", "7"),
    ("\\boxed{7}", ""),
    (None, "7"),
    ("\\boxed{7}", None),
])
def test_score_math_wrong(response, gold):
  assert score_math(response, gold) == 0.0


def test_score_math_fallback_last_number():
  assert score_math("3 apples and 4 pears: 7", "7") == 0.0
  assert score_math("3 apples and 4 pears: 7", "7", fallback_last_number=True) == 1.0
  assert score_math("total 1,234.", "1234", fallback_last_number=True) == 1.0
  assert score_math("12 and then 13", "12", fallback_last_number=True) == 0.0
  # A box, when present, wins over the last number.
  assert score_math("\\boxed{7} (check: 3+4)", "7", fallback_last_number=True) == 1.0
  # A truncated (unbalanced) last box counts as no box: only the fallback can score it.
  assert score_math("so \\boxed{7", "7") == 0.0
  assert score_math("so \\boxed{7", "7", fallback_last_number=True) == 1.0


@pytest.mark.parametrize("response", [
    "\\boxed{9^{9^{9}}}",
    "\\boxed{9^9^9}",
    "\\boxed{9**9**9}",
    "\\boxed{10^{10^{100}}}",
    "\\boxed{2^{999999999}}",
    "\\boxed{100000!}",
    "\\boxed{" + "9" * 100_000 + "}",
    "x" * 100_000,
    "\\boxed{" * 1000,
    "{" * 50_000 + "\\boxed{3",
    "\\boxed{" + "\\frac{1}{" * 30 + "2" + "}" * 30 + "}",
    "\\boxed{" + "(" * 40 + "7" + ")" * 40 + "}",
])
def test_score_math_pathological_is_fast(response):
  for fallback in (False, True):
    t0 = time.perf_counter()
    assert score_math(response, "7", fallback_last_number=fallback) == 0.0
    assert time.perf_counter() - t0 < 2.0


def test_score_math_pathological_gold_is_fast():
  t0 = time.perf_counter()
  assert score_math("\\boxed{7}", "9^{9^{9}}") == 0.0
  assert score_math("\\boxed{7}", "1" * 100_000) == 0.0
  assert time.perf_counter() - t0 < 2.0


# --- load_jsonl -----------------------------------------------------------------------------


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return str(path)


def test_load_jsonl_ok(tmp_path):
  p = _write(tmp_path / "ok.jsonl", ['{"q": "a?", "a": "1", "k": 3}', "", '{"q": "b?", "a": "2"}'])
  rows = load_jsonl(p, question_field="q", answer_field="a")
  assert [r["q"] for r in rows] == ["a?", "b?"]


@pytest.mark.parametrize("bad, why", [
    ('{"question": "q", "answer": ', "malformed JSON"),
    ('["question", "answer"]', "JSON object"),
    ('{"question": "q"}', "missing field 'answer'"),
    ('{"question": "q", "answer": 7}', "'answer' must be a string"),
    ('{"question": null, "answer": "7"}', "'question' must be a string"),
])
def test_load_jsonl_errors_name_file_and_line(tmp_path, bad, why):
  good = '{"question": "What is 1+1?", "answer": "2"}'
  p = _write(tmp_path / "bad.jsonl", [good, good, bad, good])
  with pytest.raises(ValueError) as e:
    load_jsonl(p)
  assert f"{p}:3:" in str(e.value) and why in str(e.value)
  rows, skipped = load_jsonl(p, skip_bad_rows=True)
  assert len(rows) == 3 and skipped == 1


def test_load_jsonl_id_field_and_missing_file(tmp_path):
  p = _write(tmp_path / "ids.jsonl", ['{"question": "q", "answer": "1", "id": 4}',
                                      '{"question": "q", "answer": "1"}'])
  with pytest.raises(ValueError, match=r"ids\.jsonl:2: missing field 'id'"):
    load_jsonl(p, id_field="id")
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    load_jsonl(str(tmp_path / "nope.jsonl"))


# --- HFTokenizer ----------------------------------------------------------------------------


def test_hf_tokenizer_properties(tokenizer):
  hf = tokenizer.hf_tokenizer
  assert tokenizer.vocab_size == len(hf)
  assert tokenizer.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
  assert tokenizer.bos_id == hf.convert_tokens_to_ids("<s>")
  assert tokenizer.pad_id == hf.convert_tokens_to_ids("<pad>")


def test_hf_tokenizer_no_double_bos(tokenizer):
  prompt = tokenizer.chat_prompt("What is 3+4?")
  assert prompt.startswith("<s><|im_start|>user\nWhat is 3+4?<|im_end|>")
  assert prompt.endswith("<|im_start|>assistant\n")
  ids = tokenizer.encode(prompt, add_bos=True)
  assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1
  plain = tokenizer.encode("What is 3+4?", add_bos=True)
  assert plain[0] == tokenizer.bos_id and plain[1:] == tokenizer.encode("What is 3+4?")
  assert tokenizer.bos_id not in tokenizer.encode("What is 3+4?")


def test_hf_tokenizer_chat_thinking(tokenizer):
  assert "<think>" not in tokenizer.chat_prompt("hi")
  assert "<think>" not in tokenizer.chat_prompt("hi", thinking=True)
  assert tokenizer.chat_prompt("hi", thinking=False).endswith("<think>\n\n</think>\n\n")


def test_hf_tokenizer_decode_stops_at_eos(tokenizer):
  text = "The answer is \\boxed{7}."
  ids = tokenizer.encode(text)
  assert tokenizer.decode(ids) == text
  tail = tokenizer.encode(" garbage")
  out = np.array([tokenizer.bos_id] + ids + [tokenizer.eos_id] + tail, dtype=np.int32)
  assert tokenizer.decode(out) == text
  # Ids beyond the tokenizer (a model's padded embedding rows) are dropped, never raise.
  assert tokenizer.decode(ids + [tokenizer.vocab_size + 5]) == text


def test_hf_tokenizer_generation_config_and_no_template(tmp_path):
  folder = _make_tokenizer(tmp_path / "t", chat_template=None, generation_eos=[4, 3])
  tok = HFTokenizer(folder)
  assert tok.eos_id == 4  # first generation_config eos wins (<|endoftext|>)
  assert tok.chat_prompt("hi", thinking=True) == "hi"
  ids = tok.encode("hi")
  assert tok.decode(ids + [3] + ids) == "hi"  # every eos id stops decoding
  assert tok.decode(ids + [4] + ids) == "hi"


def test_hf_tokenizer_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer files"):
    HFTokenizer(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    HFTokenizer(str(tmp_path / "missing"))


# --- MathTask -------------------------------------------------------------------------------


def test_shipped_data_files():
  train, evals = load_jsonl(TRAIN), load_jsonl(EVAL)
  assert len(train) >= 30 and len(evals) >= 8
  assert not ({normalize_question(r["question"]) for r in train}
              & {normalize_question(r["question"]) for r in evals})
  assert any("\\frac" in r["answer"] for r in train)


def test_math_task_eval_and_prompts(tokenizer):
  task = MathTask(TRAIN, EVAL, tokenizer=tokenizer, num_eval=4)
  evals = task.eval_problems()
  assert len(evals) == 4 and [p.id for p in evals] == [0, 1, 2, 3]
  assert all(isinstance(p, Problem) for p in evals)
  first = load_jsonl(EVAL)[0]
  assert evals[0].answer == first["answer"]
  assert evals[0].prompt == tokenizer.chat_prompt(first["question"] + "\n" + MATH_INSTRUCTION)
  assert task.score("So \\boxed{" + first["answer"] + "}", evals[0]) == 1.0
  assert task.score("\\boxed{-1}", evals[0]) == 0.0


def test_math_task_train_disjoint_and_deterministic(tokenizer):
  task = MathTask(TRAIN, EVAL, tokenizer=tokenizer)
  eval_prompts = {p.prompt for p in task.eval_problems()}
  a = task.train_problems(np.random.default_rng(3), 64)
  b = task.train_problems(np.random.default_rng(3), 64)
  assert a == b and len(a) == 64
  assert not eval_prompts & {p.prompt for p in a}
  assert min(p.id for p in a) >= len(task.eval_problems())
  assert task.train_problems(np.random.default_rng(4), 64) != a
  assert task.train_problems(np.random.default_rng(0), 0) == []


def test_math_task_drops_eval_questions_from_train(tmp_path, tokenizer):
  train = _write(tmp_path / "train.jsonl", [
      '{"question": "What is  1+1?", "answer": "2"}',
      '{"question": "what is 2+2?", "answer": "4"}',
      '{"question": "What is 3+3?", "answer": "6"}'])
  evals = _write(tmp_path / "eval.jsonl", ['{"question": "What is 1+1?", "answer": "2"}',
                                           '{"question": "What is 2+2?", "answer": "4"}'])
  task = MathTask(train, evals, tokenizer=tokenizer, num_eval=1)
  assert task.num_train == 1 and task.num_train_dropped == 2
  assert {p.answer for p in task.train_problems(np.random.default_rng(0), 20)} == {"6"}
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    MathTask(str(tmp_path / "missing.jsonl"), evals, tokenizer=tokenizer)
  with pytest.raises(ValueError, match="num_eval"):
    MathTask(train, evals, tokenizer=tokenizer, num_eval=3)


def test_reward_api_name():
  assert math_reward.score("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
  assert math_reward.score("so \\boxed{3}", "0.5") == 0.0


# --- prompt length (sampling.max_prompt_len) --------------------------------------------------


def _prompt_len(tokenizer, question):
  """Tokens of the prompt of `question`, counted as the trainer encodes it."""
  return len(tokenizer.encode(tokenizer.chat_prompt(question + "\n" + MATH_INSTRUCTION),
                              add_bos=True))


def test_math_task_over_long_prompt_is_a_bad_row(tmp_path, tokenizer):
  long_q = "What is " + " + ".join(["3"] * 300) + "?"
  train = _write(tmp_path / "train.jsonl", [
      '{"question": "What is 3+4?", "answer": "7"}',
      json.dumps({"question": long_q, "answer": "900"}),
      '{"question": "What is 5+4?", "answer": "9"}'])
  evals = _write(tmp_path / "eval.jsonl", ['{"question": "What is 1+1?", "answer": "2"}'])
  limit = max(_prompt_len(tokenizer, q) for q in ("What is 3+4?", "What is 5+4?", "What is 1+1?"))
  n = _prompt_len(tokenizer, long_q)
  assert n > limit
  with pytest.raises(BadRowError) as e:  # a UserError: the commands print it as one line
    MathTask(train, evals, tokenizer=tokenizer, max_prompt_len=limit)
  assert str(e.value) == (f"{train}:2: prompt of {n} tokens (chat template and BOS included) is "
                          f"longer than sampling.max_prompt_len={limit}")
  task = MathTask(train, evals, tokenizer=tokenizer, max_prompt_len=limit, skip_bad_rows=True)
  assert task.num_train == 2
  assert {p.answer for p in task.train_problems(np.random.default_rng(0), 30)} == {"7", "9"}
  fits = MathTask(train, evals, tokenizer=tokenizer, max_prompt_len=n)  # n tokens: fits exactly
  assert fits.num_train == 3
  longer_q = long_q + " And what is 3+4?"  # longer than any train prompt: eval rows are checked
  long_eval = _write(tmp_path / "long_eval.jsonl", [
      '{"question": "What is 1+1?", "answer": "2"}',
      json.dumps({"question": longer_q, "answer": "9"})])
  with pytest.raises(ValueError, match=rf"long_eval\.jsonl:2: prompt of "
                                       rf"{_prompt_len(tokenizer, longer_q)} tokens .*"
                                       rf"sampling\.max_prompt_len={n}$"):
    MathTask(train, long_eval, tokenizer=tokenizer, max_prompt_len=n)
  task = MathTask(train, long_eval, tokenizer=tokenizer, max_prompt_len=n, skip_bad_rows=True)
  assert [p.answer for p in task.eval_problems()] == ["2"] and task.num_train == 3


def test_make_task_checks_math_prompts_against_the_setting(tmp_path, tok_dir, caplog):
  from configs import math as math_config
  from oapl_jax.tasks import make_task
  c = math_config.get_config("tiny")
  c.task.tokenizer_path = tok_dir
  c.task.train_path = _write(tmp_path / "train.jsonl", [
      '{"question": "What is 3+4?", "answer": "7"}',
      json.dumps({"question": "What is " + "3 + " * 100 + "4?", "answer": "304"}),
      '{"question": "What is 5+4?", "answer": "9"}'])
  c.task.eval_path = _write(tmp_path / "eval.jsonl",
                            ['{"question": "What is 1+1?", "answer": "2"}'])
  c.sampling.max_prompt_len = 64
  with pytest.raises(ValueError, match=r"train\.jsonl:2: prompt of \d+ tokens .*"
                                       r"sampling\.max_prompt_len=64$"):
    make_task(c)
  c.task.skip_bad_rows = True
  task, tokenizer = make_task(c)
  assert task.num_train == 2
  assert max(len(tokenizer.encode(p.prompt, add_bos=True))
             for p in task.train_problems(np.random.default_rng(0), 20)) <= 64
  assert "train.jsonl: 2 rows kept, 1 skipped" in caplog.text
