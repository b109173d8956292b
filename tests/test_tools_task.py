"""The built-in tool task (configs/tools.py, oapl_jax/tasks/tool_mix.py; issue 61 point 5): the
character tokenizer's chat layer renders the calculator's turns as a run's episodes do, the
warm-up lays a calling demonstration out as a run's trajectory (the environment's tokens not
targets), and the smoke run's trajectories hold calls the calculator answered."""

import json

import numpy as np

from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.envs import make_env, tool_calls
from oapl_jax.envs.episodes import EpisodeTurns, decode_turn, env_turn_tokens
from oapl_jax.errors import ConfigError
from oapl_jax.tasks import tool_mix
from oapl_jax.tasks.base import Problem
from oapl_jax.tasks.registry import make_task
from oapl_jax.warmup import demo_answer

PROBLEM = Problem(prompt="123x45=", answer="5535", id=0)


def _task():
  c = config_lib.repo_config("tools.py:smoke")
  return c, *make_task(c)


def test_a_call_is_few_tokens_and_decodes_to_qwen3s_tool_call():
  _, task, tok = _task()
  ids = tok.encode(tool_mix.call_text(PROBLEM))
  assert len(ids) == 2 + len("123*45")
  assert tok.vocab_size <= 32  # the tiny_addition model's vocabulary
  calls = tool_calls.parse(decode_turn(tok, ids + [tok.eos_id]))
  assert calls == [tool_calls.ToolCall("calculator", {"expression": "123*45"})]


def test_the_calculator_answers_through_the_chat_layer():
  c, task, tok = _task()
  env = make_env(c.env, task)
  turns = EpisodeTurns(env, [PROBLEM], tok, insert_width=c.env.max_env_tokens, workers=1)
  reply = turns.respond(0, 0, tok.encode(tool_mix.call_text(PROBLEM)) + [tok.eos_id])
  assert tok.decode(reply) == "<tool_response>5535</tool_response>" and len(reply) == 6
  assert turns.respond(0, 0, tok.encode(">5535") + [tok.eos_id]) is None  # the answer ends it
  assert turns.rewards(np.array([0]), 1).tolist() == [1.0]
  assert turns.metrics()["tool_ok"] == 1 and turns.metrics()["episodes_calling"] == 1
  # a reply that is not a whole number (an error) is one "?" between the markers
  assert tok.decode(env_turn_tokens(tok, [{"role": "tool", "content": "error: division by zero"}], None)) == \
      "<tool_response>?</tool_response>"


def test_a_calling_demonstration_is_laid_out_as_a_trajectory():
  _, task, tok = _task()
  task.tool_demos = 1.0
  demo = task.demonstration(PROBLEM, np.random.default_rng(0), digit_noise=0.0)
  tokens, targets = demo_answer(tok, demo)
  call = tok.encode(tool_mix.call_text(PROBLEM)) + [tok.eos_id]
  env = env_turn_tokens(tok, [{"role": "tool", "content": "5535"}], None)
  assert tokens == call + env + tok.encode(">5535") + [tok.eos_id]
  assert targets == [1.0] * len(call) + [0.0] * len(env) + [1.0] * 6  # the reply is context
  task.tool_demos = 0.0
  chain = task.demonstration(PROBLEM, np.random.default_rng(0), digit_noise=0.0)
  assert isinstance(chain, str) and task.score(chain, PROBLEM) == 1.0


def test_scores_take_a_chain_or_the_bare_answer():
  _, task, _ = _task()
  assert task.score(">5535", PROBLEM) == 1.0
  assert task.score(">5536", PROBLEM) == 0.0
  assert task.score("5535", PROBLEM) == 0.0
  assert task.score(tool_mix.call_text(PROBLEM), PROBLEM) == 0.0


def test_the_task_needs_the_calculator():
  c = config_lib.repo_config("tools.py:smoke")
  c.env.name = None
  try:
    make_task(c)
  except ConfigError as e:
    assert "env.name" in str(e)
  else:
    raise AssertionError("a tool_mix run without the calculator was not refused")


def test_the_smoke_run_calls_the_calculator(tmp_path):
  """configs/tools.py:smoke end to end (warm-up with calling demonstrations, eval, OAPL steps):
  its trajectories hold calls the calculator answered (env_tool_ok), in training and in eval."""
  c = config_lib.repo_config("tools.py:smoke")
  summary = train.run(c, str(tmp_path))
  assert summary["trainer_steps"] == c.train.steps
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  sampled = [r for r in rows if "env_tool_ok" in r]
  assert sampled and sum(r["env_tool_ok"] for r in sampled) > 0
  assert all(r["env_episodes_done"] <= r["env_episodes"] for r in sampled)


def test_a_whole_trajectory_decodes_and_scores_as_its_last_turn():
  _, task, tok = _task()
  demo, _ = demo_answer(tok, [tool_mix.call_text(PROBLEM), [{"role": "tool", "content": "5535"}], ">5535"])
  text = tok.decode(demo)
  assert text.endswith("<tool_response>5535</tool_response>>5535")
  assert task.final_answer(text) == "5535" and task.score(text, PROBLEM) == 1.0
