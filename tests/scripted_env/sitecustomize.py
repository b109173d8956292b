"""A scripted environment, "scripted", registered in every Python process started with this
folder on PYTHONPATH (the commands of tests/test_env_runs.py's multi-process runs; in-process
tests call `register()`).

Its episodes answer the first model turn with one tool message and end at the second; the score
is the parity of the final turn's text length (rewards that differ within a group). A random
tiny model never writes a well-formed tool call: these tests are about the run, not the tool
(tests/test_trajectories.py checks the calculator behind the same interface)."""

from oapl_jax.envs import registry
from oapl_jax.envs.base import EnvMetrics, Turn

NAME = "scripted"


class Episode:
  def __init__(self):
    self.metrics, self.done, self.last = EnvMetrics(), False, ""

  def step(self, text):
    self.metrics.turns += 1
    self.last = text
    if self.metrics.turns == 1:
      self.metrics.tool_calls += 1
      self.metrics.tool_ok += 1
      return Turn([{"role": "tool", "content": "42"}], False)
    self.done = True
    return Turn([], True)

  def score(self):
    return float(len(self.last) % 2)


class Env:
  tools = []

  def start(self, problem):
    del problem
    return Episode()


def register(envs=registry.ENVS) -> None:
  envs[NAME] = lambda env_config, task: Env()


register()
