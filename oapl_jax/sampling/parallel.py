"""Data-parallel rollouts: one engine per device, each in its own host thread.

On a CPU host, one XLA process uses its cores poorly for decode-sized work (a process pinned to
one core samples about as fast as one using two), while separate host devices
(`--xla_force_host_platform_device_count=N`, set before JAX starts) each run on their own core.
`parallel_rollout` splits the prompts round-robin over several `(device, engine, weights)`
shards, runs `rollout` for each under `jax.default_device(device)` in a thread, and merges the
results back into prompt order. Shard `i` samples with `fold_in(key, i)`, so the answers are
deterministic given the key and the number of shards (not equal to a one-engine rollout's).

Measured with `benchmarks/data_parallel_sampler.py`. Not used by the trainer yet.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from oapl_jax.sampling.engine import Engine
from oapl_jax.sampling.rollout import Rollout, rollout


def shard_engines(make_engine, params, devices=None) -> list[tuple]:
  """[(device, engine, weights)] with `make_engine()` built and `params` placed on each device."""
  shards = []
  for device in devices or jax.devices():
    with jax.default_device(device):
      engine: Engine = make_engine()
      shards.append((device, engine, engine.load_params(jax.device_put(params, device))))
  return shards


def parallel_rollout(shards, prompts: list[list[int]], *, group_size: int, key: jax.Array,
                     **kwargs) -> Rollout:
  """`rollout` over `shards` (from `shard_engines`); rows in the order of `prompts`.

  kwargs: the rest of `rollout`'s arguments (max_new_tokens, eos_id, pad_id, ...), except
  `answer_limits`, which is split with the prompts if given.
  """
  n = len(shards)
  limits = kwargs.pop("answer_limits", None)
  results: list[Rollout | None] = [None] * n
  errors: list[BaseException] = []

  def work(i):
    device, engine, weights = shards[i]
    try:
      with jax.default_device(device):
        results[i] = rollout(engine, weights, prompts[i::n], group_size=group_size,
                             key=jax.random.fold_in(key, i),
                             answer_limits=None if limits is None else list(limits)[i::n], **kwargs)
    except BaseException as e:  # re-raised in the caller's thread
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(n) if prompts[i::n]]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  parts = [r for r in results if r is not None]
  g, width = group_size, max(r.answers.shape[1] for r in parts)
  # shard i's local prompt j is global prompt i + j * n; its rows go to that prompt's G rows
  rows = np.concatenate([((i + n * np.arange(len(r.prompts)))[:, None] * g + np.arange(g)).ravel()
                         for i, r in enumerate(results) if r is not None])
  pad = lambda x, value: np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)  # noqa: E731
  merged = {}
  for name, value in (("answers", kwargs["pad_id"]), ("logprobs", 0.0), ("lengths", None),
                      ("finish", None), ("versions", None)):
    stacked = np.concatenate([getattr(r, name) if value is None else pad(getattr(r, name), value)
                              for r in parts])
    merged[name] = np.empty_like(stacked)
    merged[name][rows] = stacked
  stats = {k: sum(r.stats[k] for r in parts) for k in parts[0].stats}
  return Rollout(list(prompts), g, stats=stats, **merged)
