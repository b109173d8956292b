"""Tests for oapl_jax.rl.losses (CPU, fast)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from oapl_jax import config as config_lib
from oapl_jax.rl import losses
from oapl_jax.rl.losses import LOSSES, group_value, oapl, sequence_log_ratio

NEG_INF = float("-inf")

# Two groups of G=3 answers, T=3 positions. Masked positions hold -inf log-probs.
LOGPROBS = [
  [-1.0, -0.5, NEG_INF],
  [-2.0, -0.1, -0.3],
  [NEG_INF, -0.7, -1.2],
  [-0.2, NEG_INF, NEG_INF],
  [-0.9, -0.4, -0.6],
  [-1.5, -0.25, NEG_INF],
]
OLD_LOGPROBS = [
  [-1.2, -0.4, NEG_INF],
  [-1.0, -0.3, -0.3],
  [-5.0, -0.5, -1.0],
  [-0.6, NEG_INF, -3.0],
  [-0.9, -0.9, -0.1],
  [-1.0, -0.75, NEG_INF],
]
MASK = [
  [1, 1, 0],
  [1, 1, 1],
  [0, 1, 1],
  [1, 0, 0],
  [1, 1, 1],
  [1, 1, 0],
]
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
G, BETA1, BETA2 = 3, 0.5, 0.3


def _hand_oapl():
  """The loss and per-answer terms in plain Python floats."""
  ell = [
    sum(lp - olp for lp, olp, m in zip(lps, olps, ms) if m)
    for lps, olps, ms in zip(LOGPROBS, OLD_LOGPROBS, MASK)
  ]
  v_hat = []
  for g in range(len(REWARDS) // G):
    group = REWARDS[g * G : (g + 1) * G]
    v = BETA1 * math.log(sum(math.exp(r / BETA1) for r in group) / G)
    v_hat += [v] * G
  adv = [r - v for r, v in zip(REWARDS, v_hat)]
  res = [BETA2 * e - a for e, a in zip(ell, adv)]
  loss = sum(x * x for x in res) / len(res)
  return loss, ell, v_hat, adv, res


def _arrays():
  f = lambda x: jnp.asarray(x, dtype=jnp.float32)
  return f(LOGPROBS), f(OLD_LOGPROBS), f(MASK), f(REWARDS)


def test_hand_computed_example():
  loss_ref, ell, v_hat, adv, res = _hand_oapl()
  # spot-check the hand numbers themselves: answer 0 has ell = 0.2 - 0.1 = 0.1
  assert ell[0] == pytest.approx(0.1)
  assert ell[3] == pytest.approx(0.4)
  lp, olp, mask, rewards = _arrays()
  loss, metrics = oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=BETA2)
  assert np.isfinite(float(loss))
  assert float(loss) == pytest.approx(loss_ref, rel=1e-5)
  assert float(metrics["ell_abs_mean"]) == pytest.approx(np.mean(np.abs(ell)), rel=1e-5)
  assert float(metrics["residual_abs_mean"]) == pytest.approx(np.mean(np.abs(res)), rel=1e-5)
  assert float(metrics["advantage_mean"]) == pytest.approx(np.mean(adv), rel=1e-5, abs=1e-6)
  assert float(metrics["v_hat_mean"]) == pytest.approx(np.mean(v_hat), rel=1e-5)
  np.testing.assert_allclose(
    group_value(rewards, group_size=G, beta1=BETA1), v_hat, rtol=1e-6
  )
  np.testing.assert_allclose(sequence_log_ratio(lp, olp, mask), ell, rtol=1e-5, atol=1e-6)


def test_group_value_no_overflow_and_limits():
  rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
  # tiny beta1: log-mean-exp -> max + beta1*log(1/G); naive exp(1/1e-3) would overflow
  v = group_value(rewards, group_size=4, beta1=1e-3)
  np.testing.assert_allclose(v, 1.0 + 1e-3 * math.log(0.25), rtol=1e-6)
  # large beta1: -> the group mean (from above: mean + var / (2 beta1) + ...)
  v = group_value(rewards, group_size=4, beta1=100.0)
  np.testing.assert_allclose(v, 0.25 + 0.1875 / 200, atol=1e-4)
  assert np.all(np.asarray(v) > 0.25)


def test_gradient_matches_closed_form():
  lp, olp, mask, rewards = _arrays()
  _, ell, _, adv, _ = _hand_oapl()
  batch = len(REWARDS)

  def loss_fn(lp, olp, rewards):
    return oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=BETA2)[0]

  g_lp, g_olp, g_r = jax.grad(loss_fn, argnums=(0, 1, 2))(lp, olp, rewards)
  per_answer = [2 * BETA2 * (BETA2 * e - a) / batch for e, a in zip(ell, adv)]
  expected = np.array(MASK, dtype=np.float64) * np.array(per_answer)[:, None]
  assert np.all(np.isfinite(g_lp))
  np.testing.assert_allclose(g_lp, expected, rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(g_lp)[np.array(MASK) == 0] == 0.0)
  # old log-probs, rewards (and so V_hat, A) are constants
  np.testing.assert_array_equal(g_olp, np.zeros_like(g_olp))
  np.testing.assert_array_equal(g_r, np.zeros_like(g_r))


def test_closed_form_optimum_minimises_oapl_on_off_policy_answers():
  """Finding (a) through oapl() and group_value(): with V_hat = V* exactly, pi* zeroes every
  residual of answers drawn from q != pi_old, so the loss is 0 there, its gradient vanishes,
  and any other policy scores higher.

  A bandit with 0/1 rewards (arms 0-1 right): V_hat sees only a group's rewards, so a group
  of 8 with 3 right answers has V_hat = V* exactly when pi_old puts 3/8 of its mass on the
  right arms, whichever right / wrong arms the group holds. Those are drawn from q.
  """
  num_arms, beta, group, num_groups, num_right = 6, 0.25, 8, 16, 3
  k_right, k_wrong, k_q, k_r, k_w = jax.random.split(jax.random.PRNGKey(1), 5)
  right = jnp.arange(num_arms) < 2  # [K]
  reward = right.astype(jnp.float32)  # [K]
  p_right = num_right / group
  log_old = jnp.where(  # [K] pi_old: 3/8 on the right arms, split at random within each class
    right,
    math.log(p_right) + jax.nn.log_softmax(jnp.where(right, jax.random.normal(k_right, (num_arms,)), NEG_INF)),
    math.log(1 - p_right) + jax.nn.log_softmax(jnp.where(right, NEG_INF, jax.random.normal(k_wrong, (num_arms,)))),
  )
  v_star = beta * jax.nn.logsumexp(log_old + reward / beta)  # [] = beta log E_old exp(R/beta)
  log_star = log_old + (reward - v_star) / beta  # [K]
  np.testing.assert_allclose(jax.nn.logsumexp(log_star), 0.0, atol=1e-5)  # normalised
  # every arm's residual, not only the sampled ones'
  np.testing.assert_allclose(beta * (log_star - log_old) - (reward - v_star), 0.0, atol=1e-5)

  # answers from q (sharp, unrelated to pi_old within each class); one token each plus padding
  q_logits = 3.0 * jax.random.normal(k_q, (num_arms,))  # [K]
  arms = jnp.concatenate([  # [B], groups of 8 contiguous: 3 right then 5 wrong answers
    jax.random.categorical(k_r, jnp.where(right, q_logits, NEG_INF), shape=(num_groups, num_right)),
    jax.random.categorical(k_w, jnp.where(right, NEG_INF, q_logits), shape=(num_groups, group - num_right)),
  ], axis=1).reshape(-1)
  counts = np.bincount(np.asarray(arms), minlength=num_arms) / arms.size
  assert 0.5 * np.abs(counts - np.exp(np.asarray(log_old))).sum() > 0.3  # far from pi_old
  rewards = reward[arms]  # [B]
  np.testing.assert_allclose(group_value(rewards, group_size=group, beta1=beta), v_star, rtol=1e-6)
  pad = jnp.full((arms.size, 1), NEG_INF)  # [B, 1]
  mask = jnp.concatenate([jnp.ones((arms.size, 1)), jnp.zeros((arms.size, 1))], axis=1)  # [B, 2]
  old_lp = jnp.concatenate([log_old[arms][:, None], pad], axis=1)  # [B, 2]

  def loss_fn(theta):  # policy logits [K] -> the OAPL loss on the batch
    lp = jnp.concatenate([jax.nn.log_softmax(theta)[arms][:, None], pad], axis=1)  # [B, 2]
    return oapl(lp, old_lp, mask, rewards, group_size=group, beta1=beta, beta2=beta)

  (loss_star, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(log_star)
  assert float(loss_star) < 1e-10
  assert float(metrics["residual_abs_mean"]) < 1e-5
  np.testing.assert_allclose(grad, 0.0, atol=1e-6)
  assert float(loss_fn(log_old)[0]) > 1e-2  # pi_old itself is not optimal
  for k in jax.random.split(jax.random.PRNGKey(2), 8):
    perturbed = log_star + 0.1 * jax.random.normal(k, (num_arms,))
    assert float(loss_fn(perturbed)[0]) > float(loss_star) + 1e-5


def test_group_value_of_many_pi_old_samples_approaches_v_star():
  """V_hat is a (consistent) estimate of V* = beta log E_{pi_old} exp(R / beta)."""
  num_arms, beta = 5, 0.25
  k_old, k_r, k_s = jax.random.split(jax.random.PRNGKey(4), 3)
  old_logits = 2.0 * jax.random.normal(k_old, (num_arms,))  # [K]
  reward = jax.random.uniform(k_r, (num_arms,))  # [K] in [0, 1]
  v_star = float(beta * jax.nn.logsumexp(jax.nn.log_softmax(old_logits) + reward / beta))
  rewards = reward[jax.random.categorical(k_s, old_logits, shape=(8, 50_000))]  # [8 groups, G]
  v_hat = np.asarray(group_value(rewards.reshape(-1), group_size=50_000, beta1=beta))
  np.testing.assert_allclose(v_hat, v_star, atol=0.01)


def test_converges_to_optimum_from_off_policy_samples():
  num_arms, beta, group, num_groups = 6, 0.2, 64, 64
  k_old, k_r, k_s = jax.random.split(jax.random.PRNGKey(0), 3)
  old_logits = jax.random.normal(k_old, (num_arms,))  # [K]
  log_old = jax.nn.log_softmax(old_logits)  # [K]
  reward = jax.random.uniform(k_r, (num_arms,))  # [K] in [0, 1]
  v_star = beta * jax.nn.logsumexp(log_old + reward / beta)
  pi_star = jnp.exp(log_old + (reward - v_star) / beta)  # [K]

  arms = jax.random.categorical(k_s, old_logits, shape=(num_groups * group,))  # [B]
  rewards = reward[arms]  # [B]
  old_lp = log_old[arms][:, None]  # [B, 1]
  mask = jnp.ones_like(old_lp)  # [B, 1]

  def loss_fn(theta):
    lp = jax.nn.log_softmax(theta)[arms][:, None]  # [B, 1]
    return oapl(lp, old_lp, mask, rewards, group_size=group, beta1=beta, beta2=beta)[0]

  opt = optax.adam(0.05)

  @jax.jit
  def step(theta, state):
    grads = jax.grad(loss_fn)(theta)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(theta, updates), state

  def tv(p):
    return 0.5 * float(jnp.sum(jnp.abs(p - pi_star)))

  theta = jnp.zeros(num_arms)  # start uniform, neither pi_old nor pi*
  state = opt.init(theta)
  assert tv(jax.nn.softmax(theta)) > 0.2
  assert tv(jnp.exp(log_old)) > 0.2  # pi* is far from the sampler
  for _ in range(300):
    theta, state = step(theta, state)
  assert tv(jax.nn.softmax(theta)) < 0.02


@pytest.mark.parametrize("group_size", [4, 0])
def test_bad_group_size_raises(group_size):
  lp, olp, mask, rewards = _arrays()
  with pytest.raises(ValueError, match="group_size"):
    oapl(lp, olp, mask, rewards, group_size=group_size, beta1=1.0, beta2=1e-3)
  with pytest.raises(ValueError, match="group_size"):
    group_value(rewards, group_size=group_size, beta1=1.0)


def test_registry():
  assert LOSSES["oapl"] is oapl


def test_spec_declares_the_snapshot_only_for_snapshot_old_logprobs():
  """OAPL's spec asks for the snapshot's log-probs exactly when `rl.old_logprobs="snapshot"`,
  never for the reference; through `LossInputs` it is `oapl` on the snapshot's log-probs when
  they are there, else on the sampler's, bit for bit."""
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.loss, c.rl.group_size, c.rl.beta1, c.rl.beta2 = "oapl", G, BETA1, BETA2
  c.rl.old_logprobs = "sampler"
  assert losses.needs(c) == losses.Needs(snapshot=False, reference=False)
  c.rl.old_logprobs = "snapshot"
  assert losses.needs(c) == losses.Needs(snapshot=True, reference=False)
  lp, olp, mask, rewards = _arrays()
  n = jnp.float32(4.0)
  want = oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=BETA2, num_answers=n)
  inputs = dict(logprobs=lp, mask=mask, rewards=rewards, reference_logprobs=None,
                num_tokens=jnp.float32(99.0), num_answers=n)
  for sampler, snapshot in ((olp, None), (lp - 7.0, olp)):
    got = losses.from_config(c)(losses.LossInputs(
        sampler_logprobs=sampler, snapshot_logprobs=snapshot, **inputs))
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_target_out_of_reach_by_hand():
  """An answer's target A_i / beta2 is out of reach when it exceeds -log pi_old(o_i) (its
  log-prob can rise at most to 0): counted by hand from the fixture's sums."""
  _, _, _, adv, _ = _hand_oapl()
  lp, olp, mask, rewards = _arrays()
  for beta2 in (BETA2, 0.05, 5.0):
    reach = [-sum(o for o, m in zip(olps, ms) if m) for olps, ms in zip(OLD_LOGPROBS, MASK)]
    want = np.mean([a / beta2 > r for a, r in zip(adv, reach)])
    _, metrics = oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=beta2)
    assert float(metrics["target_out_of_reach"]) == pytest.approx(want)
  # the fixture spans both sides: some targets in reach at beta2 = 0.3, none at 5, all
  # positive ones out of reach at 0.05
  _, m = oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=0.05)
  assert float(m["target_out_of_reach"]) == pytest.approx(np.mean([a > 0 for a in adv]))
  _, m = oapl(lp, olp, mask, rewards, group_size=G, beta1=BETA1, beta2=5.0)
  assert float(m["target_out_of_reach"]) == 0.0


def test_tied_betas_put_targets_at_the_optimal_policy_log_ratios():
  """With beta2 = beta1 (rule "tied") a target is (R - V_hat) / beta1: over a group whose
  answers are all distinct, log mean exp of the targets is 0, i.e. the targets are the
  log-ratios of a distribution over the group (the KL-optimal reweighting)."""
  rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5], jnp.float32)
  for beta1 in (0.1, 1.0, 5.0):
    targets = (rewards - group_value(rewards, group_size=8, beta1=beta1)) / beta1
    assert float(jax.nn.logsumexp(targets) - math.log(8)) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("rule,want", [("fixed", BETA2), ("tied", BETA1), ("per_token", 16.384 / 6)])
def test_beta2_rule_sets_the_loss_beta2(rule, want):
  """`rl.beta2_rule` picks OAPL's beta2 (fixed: rl.beta2; tied: rl.beta1; per_token:
  rl.beta2_per_token / sampling.max_new_tokens, 6 in the smoke config) for the loss."""
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.loss, c.rl.beta1, c.rl.beta2, c.rl.beta2_rule = "oapl", BETA1, BETA2, rule
  assert c.sampling.max_new_tokens == 6
  config_lib.validate(c)
  assert losses.kwargs_from_config(c) == {"beta1": BETA1, "beta2": pytest.approx(want)}


def test_bad_beta2_rule_is_refused():
  c = config_lib.repo_config("tiny.py:smoke")
  c.rl.beta2_rule = "auto"
  with pytest.raises(config_lib.ConfigError, match="config.rl.beta2_rule="):
    config_lib.validate(c)
  c.rl.beta2_rule, c.rl.beta2_per_token = "per_token", 0.0
  with pytest.raises(config_lib.ConfigError, match="config.rl.beta2_per_token="):
    config_lib.validate(c)
