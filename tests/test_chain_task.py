"""The chain-of-steps addition task (oapl_jax/tasks/chain.py) and maj@k / diversity (eval/passk.py)."""

import itertools

import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax.eval.passk import diversity, group_ids, maj_at_k, maj_at_k_table
from oapl_jax.tasks import make_task
from oapl_jax.tasks.arithmetic import CharTokenizer
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.chain import ChainAdditionTask, carries, chain, final_answer, operands

GOOD = "8+6+0=14 3+4+1=08 7+9+0=16 4+2+1=07 >7684"
PROBLEM = Problem("4738+2946=", "7684", 0)


def test_chain_writes_every_column_and_the_sum():
  assert chain(4738, 2946) == GOOD
  assert chain(95, 7) == "5+7+0=12 9+0+1=10 >102"  # shorter operand padded; final carry leads
  assert carries(4738, 2946) == 2 and carries(95, 7) == 2 and carries(11, 22) == 0
  rng = np.random.default_rng(0)
  for _ in range(200):
    a, b = (int(x) for x in rng.integers(0, 10**8, 2))
    assert final_answer(chain(a, b)) == str(a + b)


def test_score_reads_the_final_answer_of_a_well_formed_chain_only():
  task = ChainAdditionTask
  assert task.score(GOOD, PROBLEM) == 1.0
  assert task.score("  " + GOOD + " ", PROBLEM) == 1.0  # surrounding whitespace is not an error
  # wrong steps, right final answer: the reward reads the final answer only
  assert task.score("1+1+0=02 >7684", PROBLEM) == 1.0
  for bad in [GOOD[:-1] + "5",  # wrong final answer
              GOOD.replace(" >", " "),  # no answer mark
              GOOD[:30],  # truncated (cut at max_new_tokens)
              GOOD.replace("=14", "=4"),  # a one-digit column total
              GOOD.replace("+0=14", "+2=14"),  # carry 2
              GOOD + " >7684",  # two answers
              "7684", ">7684", "", "garbage >7684", GOOD.replace(" ", "  ")]:
    assert task.score(bad, PROBLEM) == 0.0, bad
  assert task.score(None, PROBLEM) == 0.0  # never raises
  assert task.score(12, PROBLEM) == 0.0
  assert final_answer(GOOD) == "7684" and final_answer(GOOD[:20]) is None


def test_noisy_demonstrations_drop_carries_consistently():
  rng = np.random.default_rng(1)
  task = ChainAdditionTask(6, 6, 16, 0)
  assert task.demonstration(PROBLEM, rng, digit_noise=0.0) == GOOD
  wrong = total = 0
  for p in task.train_problems(rng, 400):
    a, b = operands(p)
    demo = task.demonstration(p, rng, digit_noise=0.5)
    assert final_answer(demo) is not None  # always well formed
    steps = demo.split(" >")[0].split(" ")
    carry = 0
    for step in steps:  # each step's total is its digits plus the carry it writes
      x, y, c, s = int(step[0]), int(step[2]), int(step[4]), int(step[6:8])
      assert s == x + y + c and c <= carry
      carry = s // 10
    total += carries(a, b) > 0
    wrong += final_answer(demo) != p.answer
  assert 0.4 * total < wrong < 0.95 * total  # a dropped carry makes the answer wrong
  with pytest.raises(ValueError, match="digit_noise"):
    task.demonstration(PROBLEM, rng, digit_noise=1.0)


def test_eval_split_is_deterministic_and_never_trained_on():
  t1, t2, t3 = (ChainAdditionTask(1, 1, 40, s) for s in (3, 3, 4))
  assert t1.eval_problems() == t2.eval_problems() != t3.eval_problems()
  held = {p.prompt for p in t1.eval_problems()}
  train = t1.train_problems(np.random.default_rng(0), 500)  # 100 pairs in all: collisions happen
  assert not held & {p.prompt for p in train}
  assert train == t1.train_problems(np.random.default_rng(0), 500)


def test_tokenizer_adds_the_answer_mark_and_keeps_the_addition_ids():
  base, tok = CharTokenizer(), CharTokenizer(extra=">")
  assert tok.vocab_size == base.vocab_size + 1
  assert tok.encode("12+3= ") == base.encode("12+3= ")
  assert tok.decode(tok.encode(GOOD, add_bos=True) + [tok.eos_id, 5]) == GOOD


def test_config_builds_the_task_and_refuses_short_answers():
  c = config_lib.repo_config("reason.py")
  config_lib.validate(c)
  task, tok = make_task(c)
  assert isinstance(task, ChainAdditionTask) and task.longest_answer_tokens() == 53
  longest = max(len(tok.encode(chain(*operands(p)))) + 1 for p in task.eval_problems())
  assert 30 <= longest <= c.sampling.max_new_tokens == 54
  c.sampling.max_new_tokens = 40
  with pytest.raises(config_lib.ConfigError, match="sampling.max_new_tokens=40"):
    make_task(c)


# --- maj@k and diversity --------------------------------------------------------------------


def _exact_maj(ids, correct, k):
  """maj@k by enumerating every k-subset (ties split evenly)."""
  gold = ids[correct.argmax()]
  wins = []
  for sub in itertools.combinations(range(len(ids)), k):
    votes = {}
    for i in sub:
      if ids[i] >= 0:
        votes[ids[i]] = votes.get(ids[i], 0) + 1
    top = max(votes.values(), default=0)
    tied = [a for a, v in votes.items() if v == top]
    wins.append(1 / len(tied) if top and gold in tied else 0.0)
  return float(np.mean(wins))


def test_group_ids_and_maj_at_k_on_known_counts():
  answers = ["5", "7", None, "5", "9", "7", "5", None]
  ids = group_ids(answers)
  assert ids.tolist() == [0, 1, -1, 0, 4, 1, 0, -1]
  correct = np.array([a == "5" for a in answers])
  m = maj_at_k(ids, correct, [1, 2, 4, 8], trials=4000, seed=0)
  assert m[1] == 3 / 8  # exact
  assert m[8] == 1.0  # "5" has 3 votes of 6
  for k in (2, 4):
    assert abs(m[k] - _exact_maj(ids, correct, k)) < 0.03
  assert maj_at_k(ids, np.zeros(8, bool), [1, 8]) == {1: 0.0, 8: 0.0}
  tie = np.array([0, 0, 2, 2])
  assert maj_at_k(tie, np.array([True, True, False, False]), [4])[4] == 0.5
  assert maj_at_k(tie, np.ones(4, bool) & (tie == 0), [1, 4], seed=3) == {1: 0.5, 4: 0.5}
  table = maj_at_k_table(np.array([ids, ids]), np.array([correct, np.zeros(8, bool)]), [1, 8])
  assert table == {"maj@1": 3 / 16, "maj@8": 0.5}
  with pytest.raises(ValueError, match="k=9"):
    maj_at_k(ids, correct, [9])


def test_diversity_counts_distinct_answers_and_chains():
  answer_ids = np.array([[0, 0, -1, 3], [0, 1, 2, 3]])
  chain_ids = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
  correct = np.array([[True, True, False, False], [False, False, False, False]])
  assert diversity(answer_ids, chain_ids, correct) == {
      "distinct_answers": (2 + 4) / 2, "distinct_chains": 4.0, "distinct_correct_chains": 1.0}
