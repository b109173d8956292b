"""Tests for the built-in multi-digit addition task (and the task registry)."""

import subprocess
import sys

import numpy as np
import pytest

from oapl_jax.tasks.arithmetic import (
  AdditionTask,
  CharTokenizer,
  Problem,
  expected_pass1,
)


def _operands(problem: Problem) -> tuple[str, str]:
  a, b = problem.prompt.rstrip("=").split("+")
  return a, b


def test_tokenizer_round_trip_and_specials():
  tok = CharTokenizer()
  assert tok.vocab_size < 32
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  text = "123+45=168 -*"
  ids = tok.encode(text, add_bos=True)
  assert ids[0] == tok.bos_id
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(text)) == text
  # Stops at the first eos, drops pad.
  ids2 = [tok.pad_id] + tok.encode("12") + [tok.eos_id] + tok.encode("34")
  assert tok.decode(ids2) == "12"
  assert tok.decode(np.array(tok.encode("9=9"))) == "9=9"


def test_tokenizer_unknown_char():
  tok = CharTokenizer()
  with pytest.raises(ValueError, match="'x'"):
    tok.encode("12x")


def test_eval_deterministic_and_distinct():
  t1 = AdditionTask(min_digits=1, max_digits=3, num_eval=200, seed=7)
  t2 = AdditionTask(min_digits=1, max_digits=3, num_eval=200, seed=7)
  t3 = AdditionTask(min_digits=1, max_digits=3, num_eval=200, seed=8)
  e1 = t1.eval_problems()
  assert len(e1) == 200
  assert e1 == t2.eval_problems()
  assert e1 != t3.eval_problems()
  assert len({p.prompt for p in e1}) == 200
  assert [p.id for p in e1] == list(range(200))
  for p in e1:
    a, b = _operands(p)
    assert p.answer == str(int(a) + int(b))


def test_train_disjoint_from_eval():
  # Small problem space (1-digit: 100 pairs) so collisions happen often.
  task = AdditionTask(min_digits=1, max_digits=1, num_eval=40, seed=0)
  eval_prompts = {p.prompt for p in task.eval_problems()}
  rng = np.random.default_rng(1)
  train = task.train_problems(rng, 5000)
  assert len(train) == 5000
  assert not eval_prompts & {p.prompt for p in train}
  # The remaining 60 pairs all show up.
  assert len({p.prompt for p in train}) == 60


def test_train_deterministic():
  task = AdditionTask(min_digits=2, max_digits=4, num_eval=50, seed=3)
  a = task.train_problems(np.random.default_rng(123), 100)
  b = task.train_problems(np.random.default_rng(123), 100)
  c = task.train_problems(np.random.default_rng(124), 100)
  assert a == b
  assert a != c


def test_digit_counts_within_range():
  task = AdditionTask(min_digits=2, max_digits=4, num_eval=100, seed=0)
  probs = task.eval_problems() + task.train_problems(np.random.default_rng(0), 3000)
  lengths = set()
  for p in probs:
    for op in _operands(p):
      assert 2 <= len(op) <= 4
      assert op[0] != "0"
      lengths.add(len(op))
  assert lengths == {2, 3, 4}
  one = AdditionTask(min_digits=1, max_digits=1, num_eval=10, seed=0)
  ops = {op for p in one.train_problems(np.random.default_rng(0), 2000) for op in _operands(p)}
  assert ops == set("0123456789")


def test_score():
  p = Problem(prompt="123+45=", answer="168", id=0)
  assert AdditionTask.score("168", p) == 1.0
  assert AdditionTask.score("  168\n", p) == 1.0
  assert AdditionTask.score("169", p) == 0.0
  assert AdditionTask.score("1680", p) == 0.0
  assert AdditionTask.score("", p) == 0.0
  assert AdditionTask.score("+-*= 1 6 8", p) == 0.0
  assert AdditionTask.score(None, p) == 0.0  # type: ignore[arg-type]
  task = AdditionTask(min_digits=1, max_digits=3, num_eval=20, seed=0)
  for q in task.eval_problems():
    assert task.score(q.answer, q) == 1.0


def test_demonstration_noise_rate():
  task = AdditionTask(min_digits=2, max_digits=3, num_eval=10, seed=0)
  rng = np.random.default_rng(5)
  probs = task.train_problems(rng, 5000)
  noise = 0.2
  wrong = total = exact = 0
  predicted = 0.0
  for p in probs:
    demo = task.demonstration(p, rng, digit_noise=noise)
    assert len(demo) == len(p.answer)
    assert demo.isdigit()
    wrong += sum(x != y for x, y in zip(demo, p.answer))
    total += len(p.answer)
    exact += demo == p.answer
    predicted += expected_pass1(noise, len(p.answer))
  assert abs(wrong / total - noise) < 0.02
  assert abs(exact / len(probs) - predicted / len(probs)) < 0.03


def test_demonstration_zero_noise_and_validation():
  task = AdditionTask(min_digits=1, max_digits=5, num_eval=10, seed=0)
  rng = np.random.default_rng(0)
  for p in task.train_problems(rng, 500):
    assert task.demonstration(p, rng, digit_noise=0.0) == p.answer
  p = task.eval_problems()[0]
  with pytest.raises(ValueError, match="digit_noise"):
    task.demonstration(p, rng, digit_noise=1.0)


def test_expected_pass1():
  assert expected_pass1(0.0, 5) == 1.0
  assert expected_pass1(0.2, 4) == pytest.approx(0.8**4)
  assert 0.30 <= expected_pass1(0.2, 4) <= 0.45


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(min_digits=0, max_digits=2, num_eval=5, seed=0), "min_digits"),
    (dict(min_digits=10, max_digits=10, num_eval=5, seed=0), "min_digits"),
    (dict(min_digits=3, max_digits=2, num_eval=5, seed=0), "max_digits"),
    (dict(min_digits=1, max_digits=10, num_eval=5, seed=0), "max_digits"),
    (dict(min_digits=1, max_digits=2, num_eval=0, seed=0), "num_eval"),
    (dict(min_digits=1, max_digits=1, num_eval=51, seed=0), "num_eval"),
  ],
)
def test_constructor_validation(kwargs, name):
  with pytest.raises(ValueError, match=name):
    AdditionTask(**kwargs)


def test_longest_prompt():
  assert AdditionTask(min_digits=2, max_digits=2, num_eval=5, seed=0).longest_prompt() == "99+99="
  task = AdditionTask(min_digits=1, max_digits=3, num_eval=50, seed=0)
  longest = max(len(p.prompt) for p in task.train_problems(np.random.default_rng(0), 3000))
  assert len(task.longest_prompt()) == longest == 8


def test_make_task_refuses_a_max_prompt_len_the_prompts_do_not_fit():
  from configs import tiny
  from oapl_jax.config import ConfigError
  from oapl_jax.tasks import make_task

  c = tiny.get_config("smoke")
  c.sampling.max_prompt_len = 2
  with pytest.raises(ConfigError) as e:
    make_task(c)
  assert str(e.value) == ("config.sampling.max_prompt_len=2: the addition task's longest prompt "
              "'99+99=' (task.max_digits=2) is 7 tokens with BOS; must be >= 7")
  c.sampling.max_prompt_len = 7  # "<bos>99+99=" fits exactly
  task, tokenizer = make_task(c)
  assert len(tokenizer.encode(task.longest_prompt(), add_bos=True)) == 7
  c.task.max_digits = 3
  with pytest.raises(ConfigError, match=r"sampling\.max_prompt_len=7: .*'999\+999=' "
                                        r"\(task\.max_digits=3\) is 9 tokens"):
    make_task(c)


def test_task_registry_imports_no_jax_flax_or_transformers():
  # oapl_jax.config checks task.name against TASKS; importing it must stay cheap.
  code = ("import sys; from oapl_jax.tasks.registry import TASKS; print(list(TASKS)); "
          "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'transformers'}))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split("\n")[:2] == ["['addition', 'chain_addition', 'chain_mix', 'tool_mix', 'math', 'code', 'reasoning_gym']", "[]"]
