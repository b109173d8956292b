"""The task registry: each `task.name` a config may hold, and the builder of that task.

`TASKS` maps a name to its builder (config -> (task, tokenizer)); `make_task(config)` calls it.
This module imports nothing heavy (no JAX, Flax or transformers; each builder imports its
task's module when called), so `oapl_jax.config` checks `task.name` against `TASKS` itself.
"""

from __future__ import annotations

from typing import Callable

from oapl_jax.tasks.base import Task, Tokenizer


def _hf_tokenizer(config):
  """The Hugging Face tokenizer of `task.tokenizer_path`, else of the model's folder."""
  from oapl_jax.tasks.hf_tokenizer import HFTokenizer  # noqa: PLC0415 (transformers is slow)
  return HFTokenizer(config.task.tokenizer_path or config.model.path)


def _make_addition(config):
  from oapl_jax.tasks.arithmetic import make_addition_task  # noqa: PLC0415
  return make_addition_task(config)


def _make_chain_addition(config):
  from oapl_jax.tasks.chain import make_chain_task  # noqa: PLC0415
  return make_chain_task(config)


def _make_chain_mix(config):
  from oapl_jax.tasks.chain_mix import make_chain_mix_task  # noqa: PLC0415
  return make_chain_mix_task(config)


def _make_tool_mix(config):
  from oapl_jax.tasks.tool_mix import make_tool_mix_task  # noqa: PLC0415
  return make_tool_mix_task(config)


def _tools(config) -> list[dict] | None:
  """The schemas of the tools `config.env` offers (None: no environment), which the chat
  template puts in the prompt."""
  from oapl_jax.envs.registry import tool_schemas  # noqa: PLC0415
  return tool_schemas(config.env)


def _make_math(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.math import MathTask  # noqa: PLC0415
  return MathTask.from_config(config.task, tokenizer, max_prompt_len=config.sampling.max_prompt_len,
                              tools=_tools(config)), tokenizer


def _make_code(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.code import CodeTask  # noqa: PLC0415
  return CodeTask.from_config(config.task, tokenizer, max_prompt_len=config.sampling.max_prompt_len,
                              tools=_tools(config)), tokenizer


def _make_reasoning_gym(config):
  tokenizer = _hf_tokenizer(config)
  from oapl_jax.tasks.reasoning_gym import ReasoningGymTask  # noqa: PLC0415
  return ReasoningGymTask.from_config(config.task, tokenizer, seed=config.seed,
                                      max_prompt_len=config.sampling.max_prompt_len), tokenizer


# The task names a config may use, each with its builder (config -> (task, tokenizer)).
TASKS: dict[str, Callable] = {
    "addition": _make_addition,  # procedural, embedded (arithmetic.py); character tokenizer
    "chain_addition": _make_chain_addition,  # addition answered by a chain of steps (chain.py)
    "chain_mix": _make_chain_mix,  # +, - and x a digit, each a chain of steps (chain_mix.py)
    "tool_mix": _make_tool_mix,  # chain_mix with the calculator the model may call (tool_mix.py)
    "math": _make_math,  # rows of files / TFDS (math.py)
    "code": _make_code,  # rows of files / TFDS, sandboxed tests (code.py)
    "reasoning_gym": _make_reasoning_gym,  # procedural, the gym's verifiers (reasoning_gym.py)
}


def make_task(config) -> tuple[Task, Tokenizer]:
  """Returns (task, tokenizer) for `config.task` (`task.name` one of `TASKS`).

  Raises:
    ValueError: an unknown `task.name`; a bad data row (a prompt too long for
      `sampling.max_prompt_len` is one).
    ConfigError: `sampling.max_prompt_len` too small for the addition task's longest prompt,
      or for a generated reasoning_gym prompt.
  """
  build = TASKS.get(config.task.name)
  if build is None:
    raise ValueError(f"config.task.name={config.task.name!r}: unknown task")
  return build(config)
