"""The mixed chain task (oapl_jax/tasks/chain_mix.py): chains, rewards, demonstrations, split."""

import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax.tasks import chain_mix
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.registry import make_task


def test_docstring_chains():
  assert chain_mix.chain(47381, "+", 29465) == "1+5+0=06 8+6+0=14 3+4+1=08 7+9+0=16 4+2+1=07 >76846"
  assert chain_mix.chain(47381, "-", 29465) == "1-5-0=16 8-6-1=01 3-4-0=19 7-9-1=17 4-2-1=01 >17916"
  assert chain_mix.chain(47381, "*", 7) == "1*7+0=07 8*7+0=56 3*7+5=26 7*7+2=51 4*7+5=33 >331667"
  assert chain_mix.chain(47381, "x", 29) == ("1x29+00=029 8x29+02=234 3x29+23=110 7x29+11=214 "
                                             "4x29+21=137 >1374049")


def test_a_two_digit_multiplier_needs_its_own_tokens_and_steps():
  task = chain_mix.ChainMixTask(5, 5, 8, seed=0, operations="x")
  p = task.eval_problems()[0]
  a, op, b = chain_mix.parse(p)
  assert op == "x" and 10 <= b <= 99
  clean = chain_mix.chain(a, op, b)
  assert len(clean) + 1 <= task.longest_answer_tokens() == 12 * 5 + 1 + 7 + 1
  assert task.score(clean, p) == 1.0
  assert task.score(clean.replace("x", "*"), p) == 0.0  # a one-digit step shape is malformed here


@pytest.mark.parametrize("op", list(chain_mix.OPERATIONS))
def test_every_clean_chain_is_right_and_scores_1(op):
  task = chain_mix.ChainMixTask(1, 6, 4, seed=0, operations=op)
  rng = np.random.default_rng(1)
  for p in task.train_problems(rng, 300):
    a, got_op, b = chain_mix.parse(p)
    assert got_op == op and p.answer == str(chain_mix.result(a, op, b)) and int(p.answer) >= 0
    demo = task.demonstration(p, rng, digit_noise=0.0)
    assert chain_mix.final_answer(demo) == p.answer and task.score(demo, p) == 1.0
    assert len(demo) + 1 <= task.longest_answer_tokens()  # characters are tokens; + EOS


def test_a_dropped_carry_changes_the_answer_exactly_when_there_was_one():
  for a, op, b in [(199, "+", 1), (100, "-", 1), (59, "*", 9)]:
    clean = chain_mix.chain(a, op, b)
    carried = int(clean.split(" ")[0][-2])  # the units column's carry (or borrow) out
    assert carried
    assert chain_mix.final_answer(chain_mix.chain(a, op, b, frozenset({0}))) != str(chain_mix.result(a, op, b))
  # no carry out of the units: dropping it changes nothing
  assert chain_mix.chain(12, "+", 13, frozenset({0})) == chain_mix.chain(12, "+", 13)


def test_rewards_never_raise_and_need_a_well_formed_chain():
  p = Problem(prompt="12+13=", answer="25", id=0)
  for bad in ("", ">25", "25", "2+3+0=05 >25 x", "2+3+0=5 >25", None, 3):
    assert chain_mix.ChainMixTask.score(bad, p) == 0.0
  assert chain_mix.ChainMixTask.score("2+3+0=05 1+1+0=02 >25", p) == 1.0


def test_held_out_problems_are_never_drawn_for_training():
  task = chain_mix.ChainMixTask(1, 1, 60, seed=3)  # one-digit operands: few problems, many collisions
  held = {p.prompt for p in task.eval_problems()}
  assert len(held) == 60
  drawn = {p.prompt for p in task.train_problems(np.random.default_rng(0), 2000)}
  assert drawn and not drawn & held
  ops = {chain_mix.parse(p)[1] for p in task.eval_problems()}
  assert ops == set("+-*")  # every operation is drawn


def test_noisy_operations_leave_the_others_clean():
  task = chain_mix.ChainMixTask(5, 5, 40, seed=0, operations="+x", noisy_operations="+")
  rng = np.random.default_rng(0)
  right = {"+": [], "x": []}
  for p in task.eval_problems():
    right[chain_mix.parse(p)[1]].append(task.score(task.demonstration(p, rng, digit_noise=0.9), p))
  assert np.mean(right["x"]) == 1.0 and np.mean(right["+"]) < 0.5
  with pytest.raises(ValueError, match="noisy_operations"):
    chain_mix.ChainMixTask(5, 5, 4, seed=0, operations="+", noisy_operations="x")


def test_config_builds_it_and_refuses_bad_operations():
  c = config_lib.repo_config("mix.py")
  config_lib.validate(c)
  task, tok = make_task(c)
  assert isinstance(task, chain_mix.ChainMixTask) and task.operations == "+-*x" and task.noisy_operations == "+-*"
  assert c.sampling.max_new_tokens >= task.longest_answer_tokens()
  for bad in ("", "+/", "++"):
    c.task.operations = bad
    with pytest.raises(config_lib.ConfigError, match="config.task.operations="):
      config_lib.validate(c)
  c.task.operations, c.task.noisy_operations = "+-", "x"
  with pytest.raises(config_lib.ConfigError, match="config.task.noisy_operations="):
    config_lib.validate(c)


def test_a_smoke_run_trains_and_evaluates_it(tmp_path):
  """configs/mix.py:smoke end to end: warm-up, eval with maj@k and diversity, OAPL steps."""
  from oapl_jax import train  # noqa: PLC0415 (JAX)
  c = config_lib.repo_config("mix.py:smoke")
  summary = train.run(c, str(tmp_path))
  assert summary["trainer_steps"] == c.train.steps
  for key in ("pass@1", "maj@1", "distinct_answers"):
    assert key in summary["eval_after"]
  assert summary["config"]["task"]["name"] == "chain_mix"
