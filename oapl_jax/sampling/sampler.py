"""The sampler layer: problems -> encode -> engines -> decode -> score, written once.

Training rollouts (`rl.loop`), evaluation (`eval.evaluate`) and `Run.sample_answers` all sample
through a `Sampler`: engine replicas (`parallel.Replicas`) plus the task that poses the
problems and scores the answers, and its tokenizer. `make_replicas` builds the engines from
the config, with the `SamplingParams` that the trainer's log-prob kernel is handed too.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from oapl_jax import placement
from oapl_jax.envs import make_env
from oapl_jax.envs.episodes import EpisodeTurns, check_tokenizer
from oapl_jax.placement import seq_len
from oapl_jax.sampling.engine import Engine, EngineParams
from oapl_jax.sampling.layout import check_tensor
from oapl_jax.sampling.parallel import Replicas
from oapl_jax.sampling.processing import SamplingParams
from oapl_jax.sampling.rollout import Rollout


def make_engine(config, model_cfg, graphdef, sampling: SamplingParams, mesh=None) -> Engine:
  """One engine replica with the config's sampling settings, on `mesh` (`sampling.tensor`
  devices): `placement.engine_slots` slots (sampling.max_slots over the replicas of all
  processes), weights laid out by `sharding.rules`."""
  s = config.sampling
  return Engine(graphdef, model_cfg, sampling, max_slots=placement.engine_slots(config),
                max_prefill_length=s.max_prompt_len, max_len=seq_len(config),
                steps_per_call=s.steps_per_call, attn_chunk=s.attn_chunk,
                cache_bucket=s.cache_bucket, max_prefill_batch=s.max_prefill_batch,
                min_decode_width=s.min_decode_width, mesh=mesh, rules=config.sharding.rules,
                exact_rounding=config.model.exact_rounding)


def make_replicas(config, model_cfg, graphdef, sampling: SamplingParams, devices=None) -> Replicas:
  """This process's engine replicas (`placement.local_engines`: `sampling.engines` over all
  processes) of `sampling.tensor` devices each, on the first of `devices` (default: the local
  ones; `rl.loop.engine_devices` picks a run's), numbered globally (`parallel` module docstring)."""
  s = config.sampling
  check_tensor(model_cfg, s.tensor)  # before any engine is built
  local = placement.local_engines(config, jax.process_count())
  return Replicas(lambda mesh: make_engine(config, model_cfg, graphdef, sampling, mesh), local,
                  devices, s.tensor, first=jax.process_index() * local, total=s.engines)


def make_sampler(config, replicas: Replicas, task, tokenizer) -> Sampler:
  """The `Sampler` of a config: its task and tokenizer on `replicas`, with the environment
  `config.env.name` names (None: single-turn answers)."""
  env = make_env(config.env, task)
  if env is not None:
    check_tokenizer(tokenizer, config.env.name)
  return Sampler(replicas, task, tokenizer, max_new_tokens=config.sampling.max_new_tokens, env=env,
                 env_tokens=config.env.max_env_tokens, env_workers=config.env.workers)


def decode_answers(tokenizer, ro: Rollout) -> list[str]:
  """The text of every answer of a rollout, row order."""
  return [tokenizer.decode(ro.answers[i, :ro.lengths[i]]) for i in range(ro.num_samples)]


def score_rollout(task, tokenizer, problems, ro: Rollout) -> np.ndarray:
  """Rewards `[P*G]` of a rollout whose prompt p is `problems[p]`.

  Tasks with a `score_batch(responses, problems)` method (code: parallel sandboxes) get the
  whole rollout at once; others are scored answer by answer with `score(response, problem)`.
  """
  g = ro.group_size
  responses = decode_answers(tokenizer, ro)
  owners = [problems[i // g] for i in range(ro.num_samples)]
  if hasattr(task, "score_batch"):
    return np.asarray(task.score_batch(responses, owners), np.float32)
  return np.array([task.score(r, p) for r, p in zip(responses, owners)], np.float32)


@dataclasses.dataclass
class Scored:
  """G answers to each of P problems, with their rewards (row p * G + g answers problems[p]).

  Multi-host: this process's share of the problems asked for (`index`: their places in that
  list); on one process all of them (index 0 .. P - 1)."""

  problems: list
  rollout: Rollout
  rewards: np.ndarray  # [P*G] float32
  index: np.ndarray | None = None  # [P] places of `problems` in the list sampled
  seconds_sampling: float = 0.0  # the engines' rollout (prefill and decode, to the host)
  seconds_rewards: float = 0.0  # scoring its answers
  env_metrics: dict | None = None  # multi-turn: the episodes' outcomes (EpisodeTurns.metrics)


class Sampler:
  """Samples and scores answers to a task's problems with engine replicas.

  env: an environment (`oapl_jax.envs`, `make_sampler` builds the config's): each answer is
  then a multi-turn trajectory (`envs.episodes.EpisodeTurns`: tool calls answered while the
  engines go on), scored by its episode; `Scored.env_metrics` counts the episodes' outcomes."""

  def __init__(self, replicas: Replicas, task, tokenizer, *, max_new_tokens: int, env=None,
               env_tokens: int = 1, env_workers: int = 8):
    self.replicas = replicas
    self.task = task
    self.tokenizer = tokenizer
    self.max_new_tokens = max_new_tokens
    self.env, self.env_tokens, self.env_workers = env, env_tokens, env_workers
    self._loaded = (None, None, None)  # (params, version, their copies on the engines)

  def load(self, params, version: int) -> list[EngineParams]:
    """pi_theta `params` (an `nnx.State`, any dtype and sharding) in every engine's layout on its
    devices, stamped with `version` (on device: `layout.load_weights`); once per (params, version)."""
    loaded_params, loaded_version, weights = self._loaded
    if loaded_params is not params or loaded_version != version:
      # the old copy let go first: with nothing else holding it (sync mode: no rollout in
      # flight) its memory is free for the new one, not two engine copies at a refresh
      self._loaded = loaded_params = weights = None
      weights = self.replicas.load_params(params, version=version)
      self._loaded = (params, version, weights)
    return weights

  def release(self) -> None:
    """Lets go of the engines' copy `load` made (sampling.release_weights): the next `load`
    lays the weights out again, the same bit for bit."""
    self._loaded = (None, None, None)

  def sample(self, weights, problems: list, *, group_size: int, key: jax.Array) -> Scored:
    """G = `group_size` answers per problem (multi-host: to this process's share of them, each
    host scoring its own). weights: from `load`, or bare params (version -1)."""
    t0 = time.perf_counter()
    prompts = [self.tokenizer.encode(p.prompt, add_bos=True) for p in problems]
    turns = None if self.env is None else EpisodeTurns(
        self.env, problems, self.tokenizer, insert_width=self.env_tokens, workers=self.env_workers)
    ro = self.replicas.rollout(weights, prompts, group_size=group_size,
                               max_new_tokens=self.max_new_tokens, eos_id=self.tokenizer.eos_id,
                               pad_id=self.tokenizer.pad_id, key=key, turns=turns)
    index = self.replicas.local_prompts(len(problems))
    mine = [problems[j] for j in index]
    t1 = time.perf_counter()
    if turns is None:
      rewards = score_rollout(self.task, self.tokenizer, mine, ro)
      return Scored(mine, ro, rewards, index, t1 - t0, time.perf_counter() - t1)
    rewards = turns.rewards(index, group_size)  # the episodes' scores (tools ran while sampling)
    return Scored(mine, ro, rewards, index, t1 - t0, time.perf_counter() - t1, turns.metrics())

  def decode(self, ro: Rollout) -> list[str]:
    return decode_answers(self.tokenizer, ro)
