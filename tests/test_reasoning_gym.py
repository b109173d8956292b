"""ReasoningGymTask (oapl_jax/tasks/reasoning_gym.py) and configs/reasoning_gym.py end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest

from configs import reasoning_gym as rg_config
from oapl_jax.config import ConfigError, validate
from oapl_jax.models.tiny_hf import make_tiny_hf
from oapl_jax.tasks import make_task
from oapl_jax.tasks.hf_tokenizer import HFTokenizer
from oapl_jax.tasks.reasoning_gym import ANSWER_INSTRUCTION, ReasoningGymTask, extract_answer

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~200 distinct questions


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
  return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny_qwen3"), preset="tiny_qwen3")


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
  return HFTokenizer(tiny_qwen3)


@pytest.mark.parametrize("response, want", [
    ("I think <answer> 42 </answer>", "42"),
    ("<answer>1</answer> no wait <answer>2</answer>.", "2"),
    ("<answer>multi\nline</answer>", "multi\nline"),
    ("  17 \n", "17"),
    ("<answer>unclosed", "<answer>unclosed"),
    (None, ""),
])
def test_extract_answer(response, want):
  assert extract_answer(response) == want


def test_task_prompts_and_scores_with_the_gyms_verifier(tokenizer):
  task = ReasoningGymTask("chain_sum", tokenizer=tokenizer, size=50, seed=3, num_eval=8,
                          dataset_kwargs={"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                          "max_digits": 2})
  evals = task.eval_problems()
  assert [p.id for p in evals] == list(range(len(evals))) and 6 <= len(evals) <= 8
  p = next(p for p in evals if int(p.answer) > 0)
  assert p.prompt.startswith("<|im_start|>user\n") and p.prompt.endswith("<|im_start|>assistant\n")
  assert "State the final answer to the following arithmetic problem" in p.prompt
  assert ANSWER_INSTRUCTION in p.prompt
  assert task.score(f"Let me add. <answer>{p.answer}</answer>", p) == 1.0
  assert task.score(f"<answer>{int(p.answer) + 1}</answer>", p) == 0.0
  assert task.score(f"<answer>{p.answer}</answer> hmm, rather <answer>{int(p.answer) + 1}</answer>", p) == 0.0
  assert task.score(f" {p.answer} ", p) == 1.0  # no tags: the whole response is the answer
  # The gym's own verifier, not string equality: chain_sum accepts "+0042.00" for 42.
  assert task.score(f"<answer>+0{p.answer}.00</answer>", p) == 1.0
  train = task.train_problems(np.random.default_rng(0), 5)
  assert all(task.score(f"<answer>{q.answer}</answer>", q) == 1.0 for q in train)
  assert task.score("<answer>1</answer>", type(p)(prompt="x", answer="1", id=10_000)) == 0.0


def test_eval_and_train_are_disjoint_and_deterministic(tokenizer):
  task = ReasoningGymTask("chain_sum", tokenizer=tokenizer, size=400, seed=0, num_eval=40,
                          dataset_kwargs=SMALL)
  eval_questions = {p.prompt for p in task.eval_problems()}
  assert len(eval_questions) == len(task.eval_problems())  # repeats dropped
  a = task.train_problems(np.random.default_rng(5), 300)
  assert a == task.train_problems(np.random.default_rng(5), 300)
  assert a != task.train_problems(np.random.default_rng(6), 300)
  assert not eval_questions & {p.prompt for p in a}
  assert min(p.id for p in a) >= 40
  # With ~200 possible questions, the train entries do repeat eval questions: they were redrawn.
  assert any(v is None for v in task._train.values())


def test_bad_settings(tokenizer):
  with pytest.raises(ValueError, match="seed and size"):
    ReasoningGymTask("chain_sum", tokenizer=tokenizer, size=10, seed=0, num_eval=2,
                     dataset_kwargs={"seed": 1})
  with pytest.raises(ValueError, match="no_such_gym_dataset"):
    ReasoningGymTask("no_such_gym_dataset", tokenizer=tokenizer, size=10, seed=0, num_eval=2)
  with pytest.raises(ValueError, match="not a JSON object"):
    ReasoningGymTask("chain_sum", tokenizer=tokenizer, size=10, seed=0, num_eval=2,
                     dataset_kwargs="{min_terms: 2")


def test_too_long_generated_prompt_names_the_setting(tokenizer):
  kw = dict(tokenizer=tokenizer, size=50, seed=0, num_eval=4, dataset_kwargs=SMALL)
  longest = max(len(tokenizer.encode(p.prompt, add_bos=True))
                for p in ReasoningGymTask("chain_sum", **kw).eval_problems())
  with pytest.raises(ConfigError, match=rf"^config\.sampling\.max_prompt_len={longest - 1}: "
                                        r"reasoning_gym chain_sum eval entry \d+ has a prompt of "
                                        rf"{longest} tokens .*raise sampling\.max_prompt_len"):
    ReasoningGymTask("chain_sum", max_prompt_len=longest - 1, **kw)
  task = ReasoningGymTask("chain_sum", max_prompt_len=longest, **kw)  # fits exactly
  task.max_prompt_len = 10  # train entries are made (and checked) when first drawn
  with pytest.raises(ConfigError, match=r"max_prompt_len=10: reasoning_gym chain_sum train entry "):
    task.train_problems(np.random.default_rng(0), 1)


def test_config_and_make_task(tiny_qwen3):
  c = rg_config.get_config("tiny")
  c.model.path = tiny_qwen3
  validate(c)
  task, tokenizer = make_task(c)
  assert isinstance(task, ReasoningGymTask) and task.dataset_name == "chain_sum"
  assert len(task.eval_problems()) == c.task.num_eval == 4
  longest = max(len(tokenizer.encode(p.prompt, add_bos=True)) for p in task.eval_problems())
  assert longest <= c.sampling.max_prompt_len
  c.sampling.max_prompt_len = 16
  with pytest.raises(ConfigError, match=r"config\.sampling\.max_prompt_len=16: reasoning_gym "
                                        r"chain_sum eval entry 0 has a prompt of \d+ tokens"):
    make_task(c)
  full = rg_config.get_config()
  assert full.model.preset == "qwen3_0_6b" and full.task.dataset_kwargs.max_digits == 4
  assert rg_config.get_config("dataset=leg_counting,lag=7").task.dataset == "leg_counting"
  with pytest.raises(ValueError, match="unknown config arg"):
    rg_config.get_config("huge")


def test_reasoning_gym_tiny_runs_rl_steps(tiny_qwen3, tmp_path):
  out = subprocess.run([sys.executable, "-m", "oapl_jax.main", "--config=configs/reasoning_gym.py:tiny",
                        f"--config.model.path={tiny_qwen3}", f"--workdir={tmp_path}"],
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["trainer_steps"] == 4 and s["policy_versions"] == 2
  assert s["samples_generated"] == 4 * 2 * 8
  assert {"pass@1", "pass@2"} <= set(s["eval_after"]) and s["eval_after"]["num_problems"] == 4
