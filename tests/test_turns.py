"""Multi-turn rollouts: a slot pauses when its turn ends, the environment's turn runs off the
decode loop, its tokens enter the slot's KV cache after the tokens already there, and decoding
goes on (sampling/rollout.py `turns`, `Engine.resume`; docs/agents.md)."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from oapl_jax import config as config_lib
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.sampling import FINISH_LENGTH, Engine, SamplingParams, rollout
from oapl_jax.models.transformer import ModelConfig, Transformer
from oapl_jax.sampling.engine import engine_settings

SAMPLING = SamplingParams(temperature=0.8, top_p=0.9)
EOS = 2
STOPS = [[3], [11], [14], [27]]  # with EOS, 5 of 40 tokens end a model turn (~8 tokens a turn)
ENDS = {EOS} | {q[0] for q in STOPS}
ENV_TOKENS = [[20, 21, 22], [30, 31], [33, 34, 35, 36, 37]]  # an environment's replies, turn by turn
DEFAULTS = engine_settings(config_lib.defaults("tiny_addition").sampling)


@pytest.fixture(scope="module")
def small_model():
  """(cfg, graphdef, params) of a random model whose next-token distributions are broad (the
  conftest's is sharpened for top-p, and ends few turns), so turns end often."""
  cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, qk_norm=True)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [[1] + list(rng.integers(3, 40, rng.integers(1, 10))) for _ in range(n)]


def _engine(small_model, **kw):
  cfg, graphdef, _ = small_model
  settings = {**DEFAULTS, "attn_chunk": 8, "cache_bucket": 8, "steps_per_call": 6, **kw}
  return Engine(graphdef, cfg, SAMPLING, max_slots=8, max_prefill_length=16, max_len=64, **settings)


class Scripted:
  """An environment answering each model turn of an answer with the next of `replies` (then
  None: the episode is over); records the turns it was shown."""

  def __init__(self, replies, insert_width=8, workers=4):
    self.replies, self.insert_width, self.workers = replies, insert_width, workers
    self.seen: dict = {}  # (prompt, sample) -> turns shown
    self.lock = threading.Lock()

  def respond(self, prompt, sample, turn):
    with self.lock:
      shown = self.seen.setdefault((prompt, sample), [])
      shown.append(list(turn))
      k = len(shown) - 1
    return self.replies[k] if k < len(self.replies) else None


def _roll(engine, params, prompts, turns=None, max_new_tokens=40):
  return rollout(engine, params, prompts, group_size=4, max_new_tokens=max_new_tokens, eos_id=EOS,
                 pad_id=0, key=jax.random.key(7), stop_sequences=STOPS, turns=turns)


def test_a_trajectory_without_a_tool_call_is_the_single_turn_answer_bit_for_bit(small_model):
  """An environment that ends every episode at the first turn: the same tokens, log-probs,
  lengths and finish codes as a rollout without one (same keys), every token the model's."""
  _, _, params = small_model
  engine, prompts = _engine(small_model), _prompts(6)
  plain = _roll(engine, params, prompts)
  turns = Scripted([])
  multi = _roll(engine, params, prompts, turns)
  for name in ("answers", "logprobs", "lengths", "finish"):
    np.testing.assert_array_equal(getattr(multi, name), getattr(plain, name), err_msg=name)
  inside = np.arange(multi.model.shape[1])[None] < multi.lengths[:, None]
  assert (multi.model[inside] == 1).all() and (multi.model[~inside] == 0).all()
  assert len(turns.seen) == (plain.finish != FINISH_LENGTH).sum() > 0  # each ended turn was shown
  assert multi.stats["env_turns"] == 0


def _spans(ro, row):
  """[(is_model, tokens)] of row `row` of a multi-turn rollout, runs of equal flags."""
  n = int(ro.lengths[row])
  flags, tokens, spans = ro.model[row, :n], ro.answers[row, :n], []
  for i in range(n):
    if not spans or spans[-1][0] != bool(flags[i]):
      spans.append((bool(flags[i]), []))
    spans[-1][1].append(int(tokens[i]))
  return spans


def test_environment_turns_go_into_the_cache_and_the_logprob_contract_holds(small_model):
  """Replies of 3, 2 and 5 tokens after the first three turns: each trajectory is model turn,
  reply, model turn, ... in that order, the replies flagged the environment's; the trainer's
  log-probs of every model token (those after a reply too: the reply's keys are in the cache)
  equal the engine's, and the replies are not targets. Narrowing to one slot in the drain
  renumbers paused slots (min_decode_width 1)."""
  _, graphdef, params = small_model
  engine, prompts = _engine(small_model, min_decode_width=1), _prompts(10, seed=1)
  turns = Scripted(ENV_TOKENS)
  ro = _roll(engine, params, prompts, turns)
  multi = 0
  for row in range(ro.num_samples):
    spans = _spans(ro, row)
    shown = turns.seen.get((row // 4, row % 4), [])
    model_turns = [t for is_model, t in spans if is_model]
    env_turns = [t for is_model, t in spans if not is_model]
    assert [is_model for is_model, _ in spans] == [True, False] * len(env_turns) + [True] * (len(model_turns) > len(env_turns))
    assert env_turns == ENV_TOKENS[:len(env_turns)]
    assert model_turns[:len(shown)] == shown  # the environment saw each turn as sampled
    for t in shown:
      assert t[-1] in ENDS
    multi += len(env_turns) >= 2
  assert multi >= 5, "too few trajectories with two environment turns to check anything"
  assert ro.stats["env_turns"] == sum(len(v) for v in turns.seen.values()) - (
      sum(1 for v in turns.seen.values() if len(v) > len(ENV_TOKENS))) - ro.stats["env_turns_cut"]
  batch = make_batch(ro, np.zeros(ro.num_samples), seq_len=80, pad_id=0)
  logp = np.asarray(jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t, SAMPLING)[0])(params, batch.tokens))
  mask = batch.mask > 0
  assert np.abs(logp - batch.sampler_logprobs)[mask].max() <= 1e-5
  assert batch.answer_lengths.sum() == mask.sum() == ro.model.sum()
  # the replies' tokens are in the rows, not in the targets
  env = (ro.model == 0) & (np.arange(ro.model.shape[1])[None] < ro.lengths[:, None])
  assert env.sum() > 0 and batch.mask.sum() + env.sum() == ro.lengths.sum()


def test_a_slow_environment_turn_does_not_stop_the_other_slots(small_model):
  """The first ended turn's environment waits until the decode loop has made three more calls
  (it would wait forever if the loop waited for it; 60 s here): the other slots decode, and
  the slow one's trajectory then goes on as the others'."""
  _, _, params = small_model
  engine = _engine(small_model)
  calls = {"n": 0}
  real = engine.generate_steps

  def counted(*args):
    calls["n"] += 1
    return real(*args)
  engine.generate_steps = counted

  class Slow(Scripted):
    def __init__(self):
      super().__init__(ENV_TOKENS[:1])
      self.first, self.calls_while_waiting = None, None

    def respond(self, prompt, sample, turn):
      with self.lock:
        first = self.first is None
        if first:
          self.first = (prompt, sample)
      if first:
        start = calls["n"]
        for _ in range(6000):
          if calls["n"] >= start + 3:
            break
          threading.Event().wait(0.01)
        self.calls_while_waiting = calls["n"] - start
      return super().respond(prompt, sample, turn)

  turns = Slow()
  ro = _roll(engine, params, _prompts(12, seed=2), turns)
  assert turns.calls_while_waiting >= 3
  row = turns.first[0] * 4 + turns.first[1]
  assert [t for m, t in _spans(ro, row) if not m][:1] == ENV_TOKENS[:1]


def test_a_reply_that_leaves_no_room_ends_the_trajectory_at_the_length_limit(small_model):
  """A reply longer than the budget left (or than the insert width) is not put in: the
  trajectory ends after the model's turn, finish FINISH_LENGTH, counted in env_turns_cut."""
  _, _, params = small_model
  engine = _engine(small_model)
  turns = Scripted([[25] * 7], insert_width=6)  # 7 tokens > the width 6: never fits
  ro = _roll(engine, params, _prompts(4, seed=3), turns)
  shown = {k for k, v in turns.seen.items() if v}
  assert shown and ro.stats["env_turns_cut"] == len(shown) and ro.stats["env_turns"] == 0
  for p, g in shown:
    row = p * 4 + g
    assert ro.finish[row] == FINISH_LENGTH and ro.model[row, :ro.lengths[row]].all()
    assert ro.answers[row, ro.lengths[row] - 1] in ENDS
  others = [r for r in range(ro.num_samples) if (r // 4, r % 4) not in shown]
  assert all(ro.finish[r] == FINISH_LENGTH for r in others)  # never ended a turn: the budget
