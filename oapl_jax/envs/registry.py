"""The environment registry: each `env.name` a config may hold, and the builder of it.

`ENVS` maps a name to its builder `(env_config, task) -> Environment` (env_config: the config's
`env` section; task: the config's task, whose problems start episodes and whose `score` a
tool environment may use on the final answer). A new environment is one file under
oapl_jax/envs/ and one line here. Nothing heavy is imported (builders import their module).
"""

from __future__ import annotations

from typing import Callable


def _make_calculator(env_config, task):
  from oapl_jax.envs.calculator import make_calculator_env  # noqa: PLC0415
  return make_calculator_env(env_config, task)


def _make_python(env_config, task):
  from oapl_jax.envs.python_tool import make_python_env  # noqa: PLC0415
  return make_python_env(env_config, task)


# The environment names a config may use, each with its builder.
ENVS: dict[str, Callable] = {
    "calculator": _make_calculator,  # calculator(expression) tool; the task scores the answer (calculator.py)
    "python": _make_python,  # python(code) run in the bubblewrap sandbox; the task scores the answer (python_tool.py)
}


def tool_schemas(env_config) -> list[dict] | None:
  """The tools (chat-template schemas) of the environment `env_config.name` names; None
  without one. The prompts of a task with an environment list them (the chat template's
  `tools=`)."""
  if env_config.name is None:
    return None
  return make_env(env_config, None).tools


def make_env(env_config, task):
  """The environment `env_config.name` names (one of `ENVS`) on `task`; None when it is None
  (single-turn answers)."""
  if env_config.name is None:
    return None
  build = ENVS.get(env_config.name)
  if build is None:
    raise ValueError(f"config.env.name={env_config.name!r}: unknown environment; known: {tuple(ENVS)}")
  return build(env_config, task)
