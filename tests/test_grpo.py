"""The GRPO + importance-sampling baseline (oapl_jax.rl.losses.grpo) and its use in the loop."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import train, warmup
from oapl_jax.placement import seq_len
from oapl_jax.rl import losses
from oapl_jax.rl.losses import LOSSES, group_advantages, grpo, importance_weights, kwargs_from_config
from oapl_jax.rl.step import uses_reference

# Two groups of G=2 answers, T=3 positions; -inf on masked positions must not leak.
NEG_INF = float("-inf")
LOGP = [[-1.0, -0.5, NEG_INF], [-2.0, -0.1, -0.3], [-0.2, NEG_INF, NEG_INF], [-0.9, -0.4, -0.6]]
PROX = [[-1.3, -0.5, NEG_INF], [-1.0, -0.2, -0.3], [-0.6, NEG_INF, -3.0], [-0.9, -0.9, -0.1]]
SAMPLER = [[-1.0, -0.6, NEG_INF], [-1.1, -0.2, -2.0], [-0.5, NEG_INF, -1.0], [-0.9, -0.1, -0.1]]
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
REWARDS = [1.0, 0.0, 0.0, 1.0]
G = 2


def _arrays():
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return f(LOGP), f(PROX), f(SAMPLER), f(MASK), f(REWARDS)


def _hand(*, adv_norm="std", eps_low=0.2, eps_high=0.28, is_level="token", is_mode="truncate",
          cap=2.0, norm="token_mean", max_tokens=None, data=None):
  """The loss in plain Python floats, token by token, straight from docs/algorithm.md's formulas.
  Denominators count what the objective sums: tokens whose IS weight was kept, answers with a
  counted token."""
  logp_, prox_, sampler_, mask_, rewards_ = data or (LOGP, PROX, SAMPLER, MASK, REWARDS)
  adv = []
  for g in range(len(rewards_) // G):
    r = rewards_[g * G:(g + 1) * G]
    mean = sum(r) / G
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
    adv += [(x - mean) / (std + 1e-6) if adv_norm == "std" else x - mean for x in r]
  terms = []  # per counted answer: list of per-token objectives of the tokens kept
  for i in range(len(rewards_)):
    if not any(mask_[i]):
      continue  # nothing counted (cut at max_new_tokens, count_truncated=False)
    seq_log_w = sum(p - s for p, s, m in zip(prox_[i], sampler_[i], mask_[i]) if m)
    row = []
    for t in range(len(mask_[i])):
      if not mask_[i][t]:
        continue
      w = math.exp(seq_log_w if is_level == "sequence" else prox_[i][t] - sampler_[i][t])
      if is_mode == "truncate":
        w = min(w, cap)
      elif is_mode == "mask":
        if not 1 / cap <= w <= cap:
          continue  # dropped: in no denominator either
      else:
        w = 1.0
      r = math.exp(logp_[i][t] - prox_[i][t])
      clipped = min(max(r, 1 - eps_low), 1 + eps_high)
      row.append(w * min(r * adv[i], clipped * adv[i]))
    terms.append(row)
  if norm == "token_mean":
    return -sum(map(sum, terms)) / max(sum(map(len, terms)), 1)
  if norm == "seq_mean":
    return -sum(sum(row) / max(len(row), 1) for row in terms) / len(terms)
  return -sum(map(sum, terms)) / (len(terms) * max_tokens)


@pytest.mark.parametrize("kwargs", [{}, {"norm": "seq_mean"}, {"norm": "constant", "max_tokens": 5},
                                    {"is_mode": "mask"}])
def test_an_answer_with_nothing_counted_is_in_no_denominator(kwargs):
  """A third group whose second answer has no counted token (cut at max_new_tokens under
  count_truncated=False): the loss is the hand computation's, which skips that answer."""
  data = (LOGP + [[-0.7, -0.2, -0.4], [-0.3, -0.3, -0.3]], PROX + [[-0.5, -0.2, -0.1], [-0.3, -0.3, -0.3]],
          SAMPLER + [[-0.6, -0.3, -0.2], [-0.3, -0.3, -0.3]], MASK + [[1, 1, 1], [0, 0, 0]],
          REWARDS + [1.0, 0.0])
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, _ = grpo(*map(f, data), group_size=G, eps_low=0.2, eps_high=0.28, is_cap=2.0, **kwargs)
  np.testing.assert_allclose(float(loss), _hand(data=data, **kwargs), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs", [
    {},
    {"adv_norm": "none"},
    {"is_level": "sequence"},
    {"is_mode": "mask"},
    {"is_mode": "mask", "is_level": "sequence", "cap": 3.0},
    {"is_mode": "none"},
    {"norm": "seq_mean"},
    {"norm": "constant", "max_tokens": 5},
    {"eps_low": 0.1, "eps_high": 0.1},
])
def test_loss_matches_hand_computation(kwargs):
  logp, prox, sampler, mask, rewards = _arrays()
  kw = dict(kwargs)
  cap = kw.pop("cap", 2.0)
  loss, m = grpo(logp, prox, sampler, mask, rewards, group_size=G, eps_low=kw.get("eps_low", 0.2),
                 eps_high=kw.get("eps_high", 0.28), adv_norm=kw.get("adv_norm", "std"),
                 is_level=kw.get("is_level", "token"), is_mode=kw.get("is_mode", "truncate"),
                 is_cap=cap, norm=kw.get("norm", "token_mean"), max_tokens=kw.get("max_tokens"))
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), _hand(cap=cap, **kw), rtol=1e-5, atol=1e-7)
  assert all(np.isfinite(float(v)) for v in m.values())


def test_metrics_by_hand():
  logp, prox, sampler, mask, rewards = _arrays()
  _, m = grpo(logp, prox, sampler, mask, rewards, group_size=G, eps_low=0.2, eps_high=0.28,
              is_mode="mask", is_cap=2.0)
  tokens = [(i, t) for i in range(4) for t in range(3) if MASK[i][t]]
  raw = [math.exp(PROX[i][t] - SAMPLER[i][t]) for i, t in tokens]
  np.testing.assert_allclose(float(m["is_weight_mean"]), np.mean(raw), rtol=1e-5)
  np.testing.assert_allclose(float(m["is_weight_min"]), min(raw), rtol=1e-5)
  np.testing.assert_allclose(float(m["is_weight_max"]), max(raw), rtol=1e-5)
  masked = [not (0.5 <= w <= 2.0) for w in raw]
  assert any(masked) and not all(masked)  # the example exercises both sides
  np.testing.assert_allclose(float(m["is_masked_fraction"]), np.mean(masked), rtol=1e-6)
  # clipped: the min picked the clipped term (A > 0 and r > 1.28, or A < 0 and r < 0.8)
  adv = {0: 1, 1: -1, 2: -1, 3: 1}
  ratios = [math.exp(LOGP[i][t] - PROX[i][t]) for i, t in tokens]
  clipped = [(adv[i] > 0 and r > 1.28) or (adv[i] < 0 and r < 0.8) for (i, _), r in zip(tokens, ratios)]
  assert any(clipped)
  np.testing.assert_allclose(float(m["clip_fraction"]), np.mean(clipped), rtol=1e-6)


def test_lag_zero_reduces_to_plain_grpo():
  """Identical log-probs (no lag, no engine mismatch): ratios and weights are 1, and the
  gradient is plain GRPO's -A_i / N per counted token, for every IS variant."""
  logp, _, _, mask, rewards = _arrays()
  adv = np.asarray(group_advantages(rewards, group_size=G))
  n = float(np.sum(MASK))
  expected = -(adv[:, None] * np.asarray(MASK)) / n
  for level in ("token", "sequence"):
    for mode in ("truncate", "mask", "none"):
      f = lambda lp: grpo(lp, logp, logp, mask, rewards, group_size=G, is_level=level, is_mode=mode)  # noqa: E731
      (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
      np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-7)
      np.testing.assert_allclose(float(loss), -np.sum(adv[:, None] * np.asarray(MASK)) / n, atol=1e-7)
      assert float(m["clip_fraction"]) == 0.0 and float(m["is_masked_fraction"]) == 0.0
      assert float(m["is_weight_min"]) == float(m["is_weight_max"]) == 1.0


def test_gradient_stops_at_the_clip():
  """A token whose ratio is past the clip in the advantage's direction has zero gradient."""
  logp = jnp.array([[math.log(1.5)], [math.log(0.5)]])  # ratios 1.5 (A>0) and 0.5 (A<0)
  zeros, mask, rewards = jnp.zeros((2, 1)), jnp.ones((2, 1)), jnp.array([1.0, 0.0])
  grad = jax.grad(lambda lp: grpo(lp, zeros, zeros, mask, rewards, group_size=2)[0])(logp)
  np.testing.assert_array_equal(np.asarray(grad), 0.0)
  logp_in = jnp.array([[math.log(1.1)], [math.log(0.9)]])  # inside the clip: gradient flows
  grad = jax.grad(lambda lp: grpo(lp, zeros, zeros, mask, rewards, group_size=2)[0])(logp_in)
  assert np.all(np.abs(np.asarray(grad)) > 0)


def test_a_ratio_past_88_nats_gives_a_finite_loss_and_gradient():
  """log pi_theta - log pi_prox = 100 nats on one token (exp overflows float32 past ~88): with
  A > 0 the clipped branch is picked, with A < 0 the unclipped one, capped at exp(50); the loss
  and every gradient stay finite (the step is not skipped), and the other tokens' terms are the
  uncapped ones."""
  logp = jnp.array([[100.0, math.log(1.1)], [100.0, math.log(0.9)]])  # [2, 2]
  zeros, mask, rewards = jnp.zeros((2, 2)), jnp.ones((2, 2)), jnp.array([1.0, 0.0])  # A = +-0.707
  f = lambda lp: grpo(lp, zeros, zeros, mask, rewards, group_size=2, is_mode="none")[0]  # noqa: E731
  loss, grad = jax.value_and_grad(f)(logp)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  a = 1.0 / math.sqrt(2.0) / (1.0 + 1e-6 * math.sqrt(2.0))  # (R - mean) / (std + eps)
  want = -(a * 1.2 + a * 1.1 - a * math.exp(50.0) - a * 0.9) / 4  # clipped, in, capped, in
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(grad[0, 0]) == 0.0 and float(grad[1, 0]) == 0.0  # past the clip / the cap


def test_kl_penalty():
  logp, prox, sampler, mask, rewards = _arrays()
  ref = prox - 0.3
  base, _ = grpo(logp, prox, sampler, mask, rewards, group_size=G)
  loss, m = grpo(logp, prox, sampler, mask, rewards, group_size=G, ref_logprobs=ref, kl_coef=0.5)
  tokens = [(i, t) for i in range(4) for t in range(3) if MASK[i][t]]
  k3 = [math.exp(d) - d - 1 for d in (PROX[i][t] - 0.3 - LOGP[i][t] for i, t in tokens)]
  np.testing.assert_allclose(float(m["kl"]), np.mean(k3), rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(base) + 0.5 * np.mean(k3), rtol=1e-5)
  with pytest.raises(ValueError, match="ref_logprobs"):
    grpo(logp, prox, sampler, mask, rewards, group_size=G, kl_coef=0.1)


def test_the_kl_term_is_capped_where_the_policy_left_the_reference_far_behind():
  """A token 100 nats less likely than under the reference: k3 is capped (finite loss, finite
  gradient, no gradient past the cap); small log-ratios keep the exact k3."""
  logp = jnp.array([[-100.0, -0.5]])
  ref, valid = jnp.zeros((1, 2)), jnp.ones((1, 2), bool)
  k3, grad = jax.value_and_grad(lambda lp: losses.kl_k3(lp, ref, valid).sum())(logp)
  assert float(k3) == pytest.approx(losses.KL_K3_CAP + math.exp(0.5) - 0.5 - 1.0, rel=1e-6)
  assert np.all(np.isfinite(np.asarray(grad))) and float(grad[0, 0]) == 0.0
  assert float(grad[0, 1]) == pytest.approx(-math.exp(0.5) + 1.0, rel=1e-6)  # d k3 / d logp
  rewards, mask = jnp.array([1.0, 0.0]), jnp.ones((2, 2))
  lp = jnp.array([[-100.0, -0.5], [-0.5, -0.5]])
  f = lambda x: grpo(x, lp, lp, mask, rewards, group_size=2, ref_logprobs=jnp.zeros((2, 2)),  # noqa: E731
                     kl_coef=0.1)[0]
  loss, g = jax.value_and_grad(f)(lp)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))


def test_advantages_and_weights():
  r = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
  adv = np.asarray(group_advantages(r, group_size=4))
  np.testing.assert_allclose(adv[:4], np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-6)
  np.testing.assert_array_equal(adv[4:], 0.0)  # a solved group teaches nothing
  np.testing.assert_allclose(np.asarray(group_advantages(r, group_size=4, adv_norm="none"))[:4],
                             [0.75, -0.25, -0.25, -0.25])
  w, raw, kept = importance_weights(jnp.log(jnp.array([[3.0, 1.0]])), jnp.zeros((1, 2)),
                                    jnp.ones((1, 2)), level="sequence", mode="truncate", cap=2.0)
  np.testing.assert_allclose(np.asarray(raw), 3.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w), 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="is_mode"):
    importance_weights(raw, raw, raw, level="token", mode="clip", cap=2.0)


def test_registered_and_configurable():
  assert LOSSES["grpo"] is grpo
  c = config_lib.defaults("tiny_addition")
  c.rl.loss = "grpo"
  kw = kwargs_from_config(_with_task(c))
  assert kw["is_mode"] == "truncate" and kw["is_cap"] == 2.0 and kw["eps_high"] > kw["eps_low"]


def test_spec_declares_snapshot_for_its_prox_and_reference_for_kl():
  """GRPO's spec asks for the snapshot's log-probs when they are pi_prox (`rl.grpo.prox=
  "snapshot"`, the default) and the reference's when kl_coef > 0 (which is what
  `uses_reference` reads); through `LossInputs` it is `grpo`, bit for bit, pi_prox the
  snapshot's log-probs or (`"previous_step"`) the trainer's own."""
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.loss, c.rl.group_size = "grpo", G
  c.rl.grpo.prox = "previous_step"
  assert losses.needs(c) == losses.Needs(snapshot=False, reference=False)
  logp, prox, sampler, mask, rewards = _arrays()
  got = losses.from_config(c)(losses.LossInputs(
      logprobs=logp, sampler_logprobs=sampler, snapshot_logprobs=None, reference_logprobs=None,
      mask=mask, rewards=rewards, num_tokens=jnp.float32(7.0), num_answers=jnp.float32(4.0)))
  want = grpo(logp, logp, sampler, mask, rewards, group_size=G, num_tokens=jnp.float32(7.0),
              **kwargs_from_config(c))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert float(got[1]["ratio_mean"]) == 1.0  # the ratio to the step's own start
  c.rl.grpo.prox = "snapshot"
  assert losses.needs(c) == losses.Needs(snapshot=True, reference=False)
  assert not uses_reference(c)
  c.rl.grpo.kl_coef = 0.1
  assert losses.needs(c) == losses.Needs(snapshot=True, reference=True)
  assert uses_reference(c)
  logp, prox, sampler, mask, rewards = _arrays()
  ref = jnp.where(mask > 0, prox - 0.3, NEG_INF)
  n = jnp.float32(7.0)
  want = grpo(logp, prox, sampler, mask, rewards, group_size=G, num_tokens=n, ref_logprobs=ref,
              **kwargs_from_config(c))
  got = losses.from_config(c)(losses.LossInputs(
      logprobs=logp, sampler_logprobs=sampler, snapshot_logprobs=prox, reference_logprobs=ref,
      mask=mask, rewards=rewards, num_tokens=n, num_answers=jnp.float32(99.0)))
  assert "kl" in got[1]
  jax.tree.map(np.testing.assert_array_equal, got, want)


def _with_task(c):
  import ml_collections
  c.task = ml_collections.ConfigDict({"name": "addition"})
  return c


@pytest.mark.parametrize("setting,value", [
    ("is_mode", "clip"), ("is_level", "word"), ("norm", "sum"), ("adv_norm", "mad"),
    ("is_cap", 0.5), ("eps_low", 1.0), ("eps_high", -0.1), ("kl_coef", -1.0), ("prox", "old")])
def test_bad_grpo_settings_are_refused(setting, value):
  c = _with_task(config_lib.defaults("tiny_addition"))
  c.rl.loss = "grpo"
  c.rl.grpo[setting] = value
  with pytest.raises(config_lib.ConfigError, match=f"config.rl.grpo.{setting}="):
    config_lib.validate(c)


def test_grpo_in_the_loop_with_kl_and_resume(smoke_config, tmp_path):
  """GRPO runs in the same lagged loop; the reference policy is checkpointed and restored."""
  c = smoke_config
  c.rl.loss = "grpo"
  c.rl.grpo.kl_coef = 0.05
  c.rl.grpo.is_mode = "mask"
  # one-digit sums: rewards vary within groups from the start, so pi_theta leaves the reference
  # (two-digit smoke rewards can be all zero for the first steps: no gradient, KL exactly 0)
  c.task.min_digits = c.task.max_digits = 1
  summary = train.run(c, str(tmp_path))
  assert summary["trainer_steps"] == c.train.steps
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  for key in ("clip_fraction", "is_weight_mean", "is_weight_min", "is_weight_max",
              "is_masked_fraction", "entropy", "kl", "snapshot_vs_sampler_abs"):
    assert all(np.isfinite(row[key]) for row in rows), key
  # weights are pi_prox / pi_sampler on identical weights: the engine/trainer mismatch only
  assert all(abs(row["is_weight_mean"] - 1.0) < 1e-4 for row in rows)
  assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # pi_theta == reference at step 1
  assert any(row["kl"] > 0 for row in rows[1:])


def test_reference_is_checkpointed(smoke_config, tmp_path):
  c = smoke_config
  c.rl.loss = "grpo"
  c.rl.grpo.kl_coef = 0.05
  r = train.Run(c, str(tmp_path))
  r.step()
  r.reference = jax.tree.map(lambda x: x + 1.0, r.reference)  # distinguishable from params
  r.save()
  fresh = train.Run(c, str(tmp_path))
  assert fresh.restore_latest()
  for x, y in zip(jax.tree.leaves(fresh.reference), jax.tree.leaves(r.reference)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  c.rl.grpo.kl_coef = 0.0
  assert train.Run(c, str(tmp_path / "nokl")).reference is None  # kept only when used


@pytest.mark.parametrize("lag", [1, 3])
def test_previous_step_prox_equals_the_snapshot_at_lag_1_and_differs_after(smoke_config, tmp_path, lag):
  """pi_prox = the trainer's weights as the step starts (`rl.grpo.prox="previous_step"`) is the
  snapshot whenever the snapshot was refreshed at the step before (lag 1; the first step of a
  window): then both runs take the same steps. Later in a window (lag 3) the snapshot's ratio
  moves off 1 while the previous step's stays 1, its IS weight pi_prox / pi_sampler carrying
  the lag instead, and the runs part."""
  c = smoke_config
  c.rl.loss, c.rl.lag = "grpo", lag
  c.task.min_digits = c.task.max_digits = 1  # rewards vary within groups from the start
  c.train.lr = 1e-2  # a step moves the policy by more than float noise
  c.warmup.cache_dir = str(tmp_path / "base")
  runs = {}
  for prox in ("snapshot", "previous_step"):
    c.rl.grpo.prox = prox
    r = train.Run(c, str(tmp_path / prox))
    base, _ = warmup.base_model(c, r.graphdef, r.params, r.sampler.task, r.sampler.tokenizer,
                                seq_len=seq_len(c))  # the second run reads the first's
    r.start_from(base)
    runs[prox] = [r.step() for _ in range(3)]
  snap, prev = runs["snapshot"], runs["previous_step"]
  assert all(row["ratio_mean"] == 1.0 for row in prev)
  # step 1 follows a refresh under either lag: the same step
  assert snap[0]["loss"] == pytest.approx(prev[0]["loss"], rel=1e-6, abs=1e-7)
  assert snap[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
  for s, p in zip(snap[1:], prev[1:]):
    if lag == 1:
      assert s["loss"] == pytest.approx(p["loss"], rel=1e-5, abs=1e-6)
      assert s["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
      assert p["is_weight_mean"] == pytest.approx(s["is_weight_mean"], abs=1e-5)
    else:
      assert abs(s["ratio_mean"] - 1.0) > 1e-4  # the snapshot is a step or two behind
      assert abs(p["is_weight_mean"] - 1.0) > 1e-4  # the lag is in the IS weight instead
      assert abs(s["is_weight_mean"] - 1.0) < 1e-4  # the snapshot's: the mismatch only
