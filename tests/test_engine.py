"""The JetStream engine: API, the log-prob contract, snapshot swaps."""

import jax
import numpy as np
import pytest
from flax import nnx
from jetstream.engine import engine_api

from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import Engine, SamplingParams, rollout
from oapl_jax.sampling.processing import keep_mask

PROMPTS = [[1, 5, 6, 7], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2], [1, 9, 9]]


def _engine(small_model, sampling, slots=8):
  cfg, graphdef, _ = small_model
  return Engine(graphdef, cfg, sampling, max_slots=slots, max_prefill_length=16, max_len=40)


def test_is_a_jetstream_engine(small_model):
  engine = _engine(small_model, SamplingParams())
  assert isinstance(engine, engine_api.Engine)
  assert engine.max_concurrent_decodes == 8 and engine.samples_per_slot == 1


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.9, top_k=6),
    SamplingParams(temperature=1.0),
])
def test_engine_logprobs_equal_trainer_kernel(small_model, sampling):
  cfg, graphdef, params = small_model
  engine = _engine(small_model, sampling)
  ro = rollout(engine, params, PROMPTS, group_size=4, max_new_tokens=12, eos_id=2, pad_id=0,
               key=jax.random.key(3))
  batch = make_batch(ro, np.zeros(ro.num_samples), seq_len=28, pad_id=0)
  logp, _ = jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t, sampling))(params, batch["tokens"])
  mask = batch["mask"] > 0
  assert mask.sum() > 50
  diff = np.abs(np.asarray(logp) - batch["sampler_logprobs"])[mask]
  assert diff.max() <= 1e-5, diff.max()
  # the processing really truncated something and log-probs are not trivially zero
  assert np.abs(batch["sampler_logprobs"][mask]).mean() > 0.05
  if sampling.top_p < 1:
    logits = nnx.merge(graphdef, params)(batch["tokens"][:, :-1]) / sampling.temperature
    kept = np.asarray(keep_mask(logits, sampling))[mask]
    assert (kept.sum(-1) < cfg.vocab_size).mean() > 0.5


def test_groups_and_finish_reasons(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(), slots=8)
  ro = rollout(engine, params, PROMPTS, group_size=4, max_new_tokens=6, eos_id=2, pad_id=0,
               key=jax.random.key(0))
  assert ro.answers.shape == (16, 6)
  for row in range(16):
    n = ro.lengths[row]
    ended_eos = ro.answers[row, n - 1] == 2
    assert (ro.finish[row] == 0) == ended_eos
    assert ended_eos or n == 6
    assert (ro.answers[row, n:] == 0).all() and (ro.logprobs[row, n:] == 0).all()


def test_rollout_is_reproducible_and_swap_changes_output(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams())
  go = lambda p, k: rollout(engine, p, PROMPTS, group_size=4, max_new_tokens=8, eos_id=2, pad_id=0,
                            key=jax.random.key(k))
  a, b = go(params, 1), go(params, 1)
  np.testing.assert_array_equal(a.answers, b.answers)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  other = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(9), x.shape), params)
  c = go(other, 1)
  assert not np.array_equal(a.logprobs, c.logprobs)


def test_prompt_longer_than_cache_is_refused(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams())
  with pytest.raises(ValueError, match="exceeds the KV cache"):
    rollout(engine, params, [[1] * 15], group_size=2, max_new_tokens=30, eos_id=2, pad_id=0,
            key=jax.random.key(0))
