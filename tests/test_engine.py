"""The JetStream engine: API, continuous batching, the log-prob contract, no recompiles, swaps."""

import collections

import jax
import numpy as np
import pytest
from flax import nnx
from jetstream.engine import engine_api

from oapl_jax import config as config_lib
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import (FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Engine, SamplingParams,
                               rollout)
from oapl_jax.sampling.engine import engine_settings
from oapl_jax.sampling.processing import keep_mask

PROMPTS = [[1, 5, 6, 7], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2], [1, 9, 9]]
# The engine settings of the config's defaults (the config owns them; the engine has none).
DEFAULTS = engine_settings(config_lib.defaults("tiny_addition").sampling)
# Small chunks and cache buckets, so that tests run the chunked attention and the resizes.
SMALL = dict(attn_chunk=8, cache_bucket=8, steps_per_call=5, max_prefill_batch=4)


def _engine(small_model, sampling, slots=8, **kw):
  cfg, graphdef, _ = small_model
  return Engine(graphdef, cfg, sampling, max_slots=slots, max_prefill_length=16, max_len=40,
                **{**DEFAULTS, **kw})


def _trainer_logprobs(small_model, ro, sampling, seq_len=40):
  """(trainer log-probs, sampler log-probs, mask), `[N, seq_len-1]` each, of a rollout."""
  _, graphdef, params = small_model
  batch = make_batch(ro, np.zeros(ro.num_samples), seq_len=seq_len, pad_id=0)
  logp, _ = jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t, sampling))(params, batch.tokens)
  return np.asarray(logp), batch.sampler_logprobs, batch.mask > 0


def test_is_a_jetstream_engine(small_model):
  engine = _engine(small_model, SamplingParams())
  assert isinstance(engine, engine_api.Engine)
  assert engine.max_concurrent_decodes == 8 and engine.samples_per_slot == 1


@pytest.mark.parametrize("layout", [{}, SMALL])
@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.9, top_k=6),
    SamplingParams(temperature=1.0),
])
def test_engine_logprobs_equal_trainer_kernel(small_model, sampling, layout):
  cfg, graphdef, params = small_model
  engine = _engine(small_model, sampling, **layout)
  ro = rollout(engine, params, PROMPTS, group_size=4, max_new_tokens=12, eos_id=2, pad_id=0,
               key=jax.random.key(3))
  logp, sampler, mask = _trainer_logprobs(small_model, ro, sampling, seq_len=28)
  assert mask.sum() > 50
  diff = np.abs(logp - sampler)[mask]
  assert diff.max() <= 1e-5, diff.max()
  # the processing really truncated something and log-probs are not trivially zero
  assert np.abs(sampler[mask]).mean() > 0.05
  if sampling.top_p < 1:
    tokens = make_batch(ro, np.zeros(ro.num_samples), seq_len=28, pad_id=0).tokens
    logits = nnx.merge(graphdef, params)(tokens[:, :-1]) / sampling.temperature
    kept = np.asarray(keep_mask(logits, sampling))[mask]
    assert (kept.sum(-1) < cfg.vocab_size).mean() > 0.5


def _load_prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [[1] + list(rng.integers(3, 40, rng.integers(0, 15))) for _ in range(n)]


def test_logprob_contract_under_load(small_model):
  """Continuous batching, mixed prompt/answer lengths, refills, temperature != 1, top-p < 1."""
  _, _, params = small_model
  sampling = SamplingParams(temperature=0.7, top_p=0.85)
  engine = _engine(small_model, sampling, slots=8, **SMALL)
  prompts = _load_prompts(14, seed=0)  # 14 groups x 3 answers through 8 slots
  limits = list(np.random.default_rng(1).integers(1, 21, len(prompts)))
  ro = rollout(engine, engine.load_params(params, version=4), prompts, group_size=3,
               max_new_tokens=20, eos_id=2, pad_id=0, key=jax.random.key(7),
               answer_limits=limits, stop_sequences=[[7, 8]])
  assert ro.stats["prefill_calls"] > 3 and ro.stats["decode_calls"] > 5  # refilled many times
  logp, sampler, mask = _trainer_logprobs(small_model, ro, sampling)
  assert mask.sum() > 150
  assert np.abs(logp - sampler)[mask].max() <= 1e-5
  assert (ro.versions == 4).all()
  for row in range(ro.num_samples):
    n, answer = ro.lengths[row], list(ro.answers[row, :ro.lengths[row]])
    assert 1 <= n <= limits[row // 3]
    assert ro.finish[row] in (FINISH_EOS, FINISH_LENGTH, FINISH_STOP)
    assert (ro.finish[row] == FINISH_EOS) == (answer[-1] == 2)
    assert (ro.finish[row] == FINISH_STOP) == (answer[-2:] == [7, 8] and answer[-1] != 2)
    if ro.finish[row] == FINISH_LENGTH:
      assert n == limits[row // 3]
    assert 2 not in answer[:-1] and (ro.answers[row, n:] == 0).all()


def test_stop_sequences_end_answers(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(), **SMALL)
  go = lambda stops: rollout(engine, params, PROMPTS, group_size=4, max_new_tokens=12,
                             eos_id=-1, pad_id=0, key=jax.random.key(1), stop_sequences=stops)
  free = go(())
  bigrams = collections.Counter(tuple(a[i:i + 2]) for a, n in zip(free.answers, free.lengths)
                                for i in range(n - 1))
  stop = list(bigrams.most_common(1)[0][0])
  ro = go([stop, [39, 38, 37]])
  hits = ro.finish == FINISH_STOP
  assert hits.sum() >= 2
  for row in np.nonzero(hits)[0]:
    answer = list(ro.answers[row, :ro.lengths[row]])
    assert answer[-2:] == stop
    assert all(answer[i:i + 2] != stop for i in range(len(answer) - 2))  # the first occurrence


def test_groups_and_finish_reasons(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(), slots=8)
  ro = rollout(engine, params, PROMPTS, group_size=4, max_new_tokens=6, eos_id=2, pad_id=0,
               key=jax.random.key(0))
  assert ro.answers.shape == (16, 6)
  assert (ro.versions == -1).all()  # bare params carry no version
  for row in range(16):
    n = ro.lengths[row]
    ended_eos = ro.answers[row, n - 1] == 2
    assert (ro.finish[row] == FINISH_EOS) == ended_eos
    assert ended_eos or n == 6
    assert (ro.answers[row, n:] == 0).all() and (ro.logprobs[row, n:] == 0).all()


def _compiles(engine):
  fns = ("_prefill", "_insert", "_generate_steps", "_resize")
  return {f: getattr(engine, f)._cache_size() for f in fns}


def test_no_recompile_across_lengths_and_weight_swaps(small_model):
  """Prompt lengths (within a bucket), answer lengths and new weights reuse every compile."""
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(temperature=0.9), slots=6, cache_bucket=64,
                   steps_per_call=4, max_prefill_batch=2)  # capacity: always max_len

  def go(p, prompts, n, k):
    limits = np.random.default_rng(k).integers(1, n + 1, len(prompts))
    return rollout(engine, p, prompts, group_size=2, max_new_tokens=n, eos_id=2, pad_id=0,
                   key=jax.random.key(k), answer_limits=limits)

  ro = go(engine.load_params(params, version=0), _load_prompts(9, seed=2), 20, 0)
  first = _compiles(engine)
  assert first["_generate_steps"] == 1 and first["_resize"] == 0
  assert first["_prefill"] <= 2 * 2  # (batch bucket 1 or 2) x (length bucket 8 or 16)
  ro2 = go(engine.load_params(params, version=0), _load_prompts(9, seed=3), 11, 1)
  assert len({len(p) for p in ro.prompts + ro2.prompts}) > 5
  assert len(set(ro.lengths) | set(ro2.lengths)) > 5
  assert _compiles(engine)["_generate_steps"] == 1
  before_swap = _compiles(engine)
  other = jax.tree.map(lambda x: x * 1.1, params)
  ro3 = go(engine.load_params(other, version=1), _load_prompts(9, seed=3), 11, 1)
  assert _compiles(engine) == before_swap  # the lag sync: a new snapshot, no recompiles
  assert (ro3.versions == 1).all() and (ro2.versions == 0).all()
  assert not np.array_equal(ro2.logprobs, ro3.logprobs)


def test_cache_capacity_follows_live_lengths(small_model):
  """Resizing the cache between calls changes nothing but the cost."""
  _, _, params = small_model
  resized = _engine(small_model, SamplingParams(temperature=0.8), **SMALL)
  fixed = _engine(small_model, SamplingParams(temperature=0.8),
                  **{**SMALL, "cache_bucket": 64})
  go = lambda e: rollout(e, params, PROMPTS, group_size=4, max_new_tokens=20, eos_id=-1,
                         pad_id=0, key=jax.random.key(5))
  a, b = go(resized), go(fixed)
  assert resized._resize._cache_size() >= 2  # it did grow (8 -> 16 -> 32 -> 40)
  np.testing.assert_array_equal(a.answers, b.answers)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_jetstream_calls_match_rollout(small_model):
  """prefill / insert / generate (one step each) give what `rollout` gives."""
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(temperature=0.8, top_k=10))
  prompt = PROMPTS[1]
  ro = rollout(engine, params, [prompt], group_size=1, max_new_tokens=8, eos_id=-1, pad_id=0,
               key=jax.random.key(4))
  padded = np.zeros((16,), np.int32)
  padded[:len(prompt)] = prompt
  state = engine.init_decode_state(jax.random.key(4))
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
  state = engine.insert(prefix, state, slot=0)
  tokens, logps = [], []
  for step in range(8):
    state, result = engine.generate(params, state)
    result = result.convert_to_numpy()
    slot = result.get_result_at_slot(0)
    assert slot.valid[0, 0] == 1 and slot.lengths[0] == step + 1
    tokens.append(int(slot.tokens[0, 0]))
    logps.append(float(result.log_probs[0, 0]))
    assert result.get_result_at_slot(1).valid[0, 0] == 0  # free slots produce nothing valid
  assert tokens == list(ro.answers[0])
  np.testing.assert_allclose(logps, ro.logprobs[0], atol=1e-5)


def test_slot_utilisation_with_long_tailed_lengths(small_model):
  _, _, params = small_model
  engine = _engine(small_model, SamplingParams(), slots=8, **SMALL)
  prompts = _load_prompts(48, seed=4)
  limits = np.minimum(np.random.default_rng(5).pareto(1.5, len(prompts)) * 3 + 1, 24).astype(int)
  ro = rollout(engine, params, prompts, group_size=1, max_new_tokens=24, eos_id=-1, pad_id=0,
               key=jax.random.key(0), answer_limits=limits)
  np.testing.assert_array_equal(ro.lengths, limits)
  assert (ro.finish == FINISH_LENGTH).all()
  assert ro.stats["live_slot_steps"] == limits.sum()
  assert ro.slot_utilisation > 0.75, ro.stats


def test_narrowing_the_drain_changes_nothing_but_the_width(small_model):
  """The final drain halves the decode width as answers end (16 -> 8 -> 4 -> 2 here): the
  answers and log-probs are those of a rollout that never narrows, the log-probs still match
  the trainer's, and fewer idle slot-steps are computed."""
  _, _, params = small_model
  prompts = _load_prompts(40, seed=6)
  limits = np.minimum(np.random.default_rng(7).pareto(1.2, len(prompts)) * 3 + 1, 24).astype(int)
  limits[-1] = 24  # a long answer started last: a long drain
  sampling = SamplingParams(temperature=0.9, top_p=0.95)
  go = lambda e: rollout(e, params, prompts, group_size=2, max_new_tokens=24, eos_id=2,
                         pad_id=0, key=jax.random.key(3), answer_limits=limits)
  narrow = _engine(small_model, sampling, slots=16, min_decode_width=2, **SMALL)
  full = _engine(small_model, sampling, slots=16, min_decode_width=16, **SMALL)
  a, b = go(narrow), go(full)
  assert narrow._narrow._cache_size() >= 2 and full._narrow._cache_size() == 0
  np.testing.assert_array_equal(a.answers, b.answers)
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.finish, b.finish)
  # float32 at another decode width: XLA may tile the narrower batch's matmuls otherwise (jax
  # 0.12 moved one log-prob by 1.9e-6), so equal to 1e-5 like the trainer's below
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  assert a.stats["live_slot_steps"] == b.stats["live_slot_steps"] == a.lengths.sum()
  assert a.stats["slot_steps"] < b.stats["slot_steps"] and a.slot_utilisation > b.slot_utilisation
  assert a.queued_slot_utilisation == b.queued_slot_utilisation
  trainer, sampler, mask = _trainer_logprobs(small_model, a, sampling)
  np.testing.assert_allclose(trainer[mask], sampler[mask], atol=1e-5)


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
