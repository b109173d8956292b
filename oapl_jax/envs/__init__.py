"""Multi-turn environments: an episode per problem, tool calls answered, the trajectory scored.

  base.py        Turn, Episode and Environment (the interface), EnvMetrics (counted outcomes)
  registry.py    ENVS (env.name -> builder) and make_env
  tool_calls.py  tool calls parsed from the model's text (Qwen3's <tool_call>{json}</tool_call>)
  tools.py       run_tool: a tool in a child process, under a time limit and an output cap
  tool_env.py    ToolEnvironment: an environment of tools (a plain turn ends the episode)
  calculator.py  the calculator environment (safe arithmetic, no eval) on the config's task
  python_tool.py the Python environment: the model's programs run in the bubblewrap sandbox

docs/agents.md describes the interface, with the calculator as its worked example. Nothing here
imports JAX: the engine's integration (pausing a slot on a tool call) will call these from the
host loop.
"""

from oapl_jax.envs.base import Environment, EnvMetrics, Episode, Turn
from oapl_jax.envs.registry import ENVS, make_env

__all__ = ["ENVS", "EnvMetrics", "Environment", "Episode", "Turn", "make_env"]
