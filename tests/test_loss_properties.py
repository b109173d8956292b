"""Properties of the losses the loop relies on (issue #11): GRPO's IS weights never overflow,
OAPL leaves answers with no counted token out of its mean, and gradient accumulation gives
the full batch's loss and gradient."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import tiny
from oapl_jax.models.build import init_model
from oapl_jax.rl import losses
from oapl_jax.rl.logprobs import token_logprobs
from oapl_jax.rl.step import Batch, make_train_step
from oapl_jax.sampling import SamplingParams
from oapl_jax.placement import seq_len

NEG_INF = float("-inf")

# --- GRPO: importance weights from log-ratios of hundreds of nats -----------------------------

# log pi_prox - log pi_sampler per token, two groups of G=2: row 0 sums to +200 nats, row 1 to
# -450 (exp of either overflows / underflows float32, per token too); rows 2-3 are moderate
# (row 3's tokens are within log C = log 2 one by one but its sum, 1.2, is not).
IS_LOG_W = np.array([[100.0, 100.0, 0.0], [-150.0, -150.0, -150.0], [0.1, 0.2, 0.0],
                     [0.5, 0.3, 0.4]])  # [B, T]
IS_MASK = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], np.float32)  # [B, T]
IS_REWARDS = np.array([1.0, 0.0, 0.0, 1.0], np.float32)  # [B]
IS_CAP = 2.0


def _expected_is_weights(level: str, mode: str) -> np.ndarray:
  """[B, T] float64 weight of each token, decided in log space (docs/algorithm.md, the baseline)."""
  log_w = IS_LOG_W * IS_MASK  # [B, T]
  if level == "sequence":
    log_w = np.broadcast_to(log_w.sum(axis=1, keepdims=True), log_w.shape)
  log_cap = math.log(IS_CAP)
  if mode == "truncate":
    return np.exp(np.minimum(log_w, log_cap))
  if mode == "mask":
    return np.where(np.abs(log_w) <= log_cap, np.exp(np.clip(log_w, -log_cap, log_cap)), 0.0)
  return np.ones_like(log_w)


@pytest.mark.parametrize("level", losses.IS_LEVELS)
@pytest.mark.parametrize("mode", losses.IS_MODES)
def test_is_weights_from_huge_log_ratios_stay_finite_and_exact(level, mode):
  """Masked answers/tokens contribute nothing, truncated ones count C times, no inf or NaN."""
  valid = IS_MASK > 0
  # valid log-probs (<= -1) with prox - sampler = IS_LOG_W; -inf where nothing counts
  prox = np.where(valid, -1.0 + np.minimum(IS_LOG_W, 0.0), NEG_INF).astype(np.float32)  # [B, T]
  sampler = np.where(valid, -1.0 - np.maximum(IS_LOG_W, 0.0), NEG_INF).astype(np.float32)
  np.testing.assert_allclose(prox[valid] - sampler[valid], IS_LOG_W[valid], rtol=1e-6)

  def loss_fn(logp):
    return losses.grpo(logp, jnp.asarray(prox), jnp.asarray(sampler), jnp.asarray(IS_MASK),
                       jnp.asarray(IS_REWARDS), group_size=2, is_level=level, is_mode=mode,
                       is_cap=IS_CAP)

  # logp = prox: every PPO ratio is 1, so obj_t = w_t * A_i and d loss / d logp_t = -w_t A_i / n
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(prox))
  w = _expected_is_weights(level, mode)  # [B, T]
  adv = np.asarray(losses.group_advantages(jnp.asarray(IS_REWARDS), group_size=2))[:, None]
  # the tokens in the objective: mask mode's dropped ones count in no denominator
  n = (IS_MASK * ((w != 0) if mode == "mask" else 1)).sum()
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(float(loss), -np.sum(w * adv * IS_MASK) / n, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), -w * adv * IS_MASK / n, rtol=1e-5, atol=1e-8)
  if mode == "mask":  # the dropped ones have exactly zero gradient
    assert np.all(np.asarray(grad)[(w == 0) & valid] == 0.0) and np.any((w == 0) & valid)
  for name, value in metrics.items():
    assert np.isfinite(float(value)), name
  bound = math.exp(losses.IS_METRIC_LOG_BOUND)
  assert float(metrics["is_weight_max"]) == pytest.approx(bound, rel=1e-5)  # saturated, finite
  assert 0.0 < float(metrics["is_weight_min"]) == pytest.approx(1.0 / bound, rel=1e-5)
  dropped = (w == 0) & valid if mode == "mask" else np.zeros_like(valid)
  np.testing.assert_allclose(float(metrics["is_masked_fraction"]), dropped.sum() / IS_MASK.sum(), rtol=1e-6)


def test_importance_weights_returns_clipped_raw_weights():
  log_w = jnp.array([[300.0, -300.0, 0.5]])  # [1, 3]
  w, raw, kept = losses.importance_weights(log_w, jnp.zeros_like(log_w), jnp.ones_like(log_w),
                                           level="token", mode="mask", cap=2.0)
  bound = losses.IS_METRIC_LOG_BOUND
  np.testing.assert_allclose(np.asarray(raw), np.exp([[bound, -bound, 0.5]]), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(kept), [[0.0, 0.0, 1.0]])
  np.testing.assert_allclose(np.asarray(w), [[0.0, 0.0, math.exp(0.5)]], rtol=1e-6)


# --- OAPL: answers with no counted token are out of the mean -----------------------------------


def _random_oapl_inputs(seed: int, batch: int = 8, length: int = 5):
  """(logprobs, old_logprobs, mask, rewards); every answer has >= 1 counted token."""
  k_lp, k_old, k_mask, k_r = jax.random.split(jax.random.key(seed), 4)
  logp = -jax.random.uniform(k_lp, (batch, length), maxval=3.0)  # [B, T]
  old = -jax.random.uniform(k_old, (batch, length), maxval=3.0)  # [B, T]
  mask = (jax.random.uniform(k_mask, (batch, length)) < 0.7).astype(jnp.float32)  # [B, T]
  mask = mask.at[:, 0].set(1.0)
  rewards = jax.random.bernoulli(k_r, 0.5, (batch,)).astype(jnp.float32)  # [B]
  return logp, old, mask, rewards


@pytest.mark.parametrize("seed", range(4))
def test_oapl_all_counted_is_bit_identical_to_the_plain_mean(seed):
  logp, old, mask, rewards = _random_oapl_inputs(seed)
  beta1, beta2 = [(1.0, 1e-3), (0.5, 0.3), (5.0, 1e-2), (0.1, 1.0)][seed]

  def new(*args):
    return losses.oapl(*args, group_size=4, beta1=beta1, beta2=beta2)[0]

  def old_formula(logp, old, mask, rewards):  # the loss before truncated answers left the mean
    v_hat = losses.group_value(rewards, group_size=4, beta1=beta1)  # [B]
    residual = beta2 * losses.sequence_log_ratio(logp, old, mask) - (rewards - v_hat)  # [B]
    return jnp.mean(jnp.square(residual))

  args = (logp, old, mask, rewards)
  np.testing.assert_array_equal(np.asarray(new(*args)), np.asarray(old_formula(*args)))
  np.testing.assert_array_equal(np.asarray(jax.jit(new)(*args)), np.asarray(jax.jit(old_formula)(*args)))


# Two groups of G=3; answers 1 and 2 were truncated (count_truncated=False): mask rows all 0,
# their -inf log-probs unused, their rewards still in their group's V_hat. One answer of the
# first group counts, all three of the second.
TR_LOGP = np.array([[-1.0, -0.5, NEG_INF], [NEG_INF] * 3, [NEG_INF] * 3,
                    [-0.2, -2.0, NEG_INF], [-0.3, -0.7, -1.2], [-1.5, -0.25, -0.1]], np.float32)
TR_OLD = np.array([[-1.2, -0.4, NEG_INF], [NEG_INF] * 3, [NEG_INF] * 3,
                   [-0.6, -0.1, NEG_INF], [-5.0, -0.5, -1.0], [-1.0, -0.75, -0.3]], np.float32)
TR_MASK = np.array([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], np.float32)
TR_REWARDS = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.5], np.float32)
TR_G, TR_BETA1, TR_BETA2 = 3, 0.5, 0.3


def _truncated_reference():
  """float64 (residual [B], counted [B], v_hat [B], adv [B], ell [B]) straight from docs/algorithm.md."""
  valid = TR_MASK > 0
  ell = (np.where(valid, TR_LOGP, 0.0) - np.where(valid, TR_OLD, 0.0)).astype(np.float64).sum(axis=1)  # [B]
  groups = TR_REWARDS.astype(np.float64).reshape(-1, TR_G) / TR_BETA1  # [N, G]
  v_hat = np.repeat(TR_BETA1 * np.log(np.exp(groups).mean(axis=1)), TR_G)  # [B], whole groups
  adv = TR_REWARDS - v_hat
  return TR_BETA2 * ell - adv, valid.any(axis=1), v_hat, adv, ell


@pytest.mark.parametrize("num_answers", [None, 10.0])
def test_oapl_leaves_uncounted_answers_out_of_the_mean(num_answers):
  """count_truncated=False: a truncated answer is neither in the numerator (its constant A^2)
  nor in the denominator (which would shrink the gradient); num_answers overrides the count."""
  res, counted, v_hat, adv, ell = _truncated_reference()
  denom = counted.sum() if num_answers is None else num_answers
  assert counted.sum() == 4
  kw = {} if num_answers is None else {"num_answers": jnp.float32(num_answers)}

  def loss_fn(logp):
    return losses.oapl(logp, jnp.asarray(TR_OLD), jnp.asarray(TR_MASK), jnp.asarray(TR_REWARDS),
                       group_size=TR_G, beta1=TR_BETA1, beta2=TR_BETA2, **kw)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(TR_LOGP))
  np.testing.assert_allclose(float(loss), np.sum(res[counted] ** 2) / denom, rtol=1e-6)
  expected = TR_MASK * (2 * TR_BETA2 * res / denom)[:, None]  # zero on the truncated rows
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-8)
  for name, values in [("ell_abs_mean", np.abs(ell)), ("residual_abs_mean", np.abs(res)),
                       ("advantage_mean", adv), ("v_hat_mean", v_hat)]:
    np.testing.assert_allclose(float(metrics[name]), values[counted].mean(), rtol=1e-5, err_msg=name)


def test_oapl_micro_batches_sum_to_the_full_batch():
  """Split into whole groups, each micro-batch divided by the full batch's count / k."""
  logp, old, mask, rewards = (jnp.asarray(x) for x in (TR_LOGP, TR_OLD, TR_MASK, TR_REWARDS))
  kw = dict(group_size=TR_G, beta1=TR_BETA1, beta2=TR_BETA2)
  full_fn = lambda lp: losses.oapl(lp, old, mask, rewards, **kw)[0]  # noqa: E731
  full, full_grad = jax.value_and_grad(full_fn)(logp)
  share = jnp.float32(4 / 2)  # counted answers / micro-batches: 1 in the first, 3 in the second
  parts = [jax.value_and_grad(lambda lp, s=s: losses.oapl(lp, old[s], mask[s], rewards[s],
                                                          num_answers=share, **kw)[0])(logp[s])
           for s in (slice(0, 3), slice(3, 6))]
  np.testing.assert_allclose(float(sum(p[0] for p in parts) / 2), float(full), rtol=1e-6)
  np.testing.assert_allclose(np.concatenate([p[1] for p in parts]) / 2, full_grad, rtol=1e-6)


# --- the train step: gradient accumulation == the full batch ------------------------------------

GROUPS, GROUP_SIZE, PROMPT_LEN = 4, 4, 5


def _gradient_out() -> optax.GradientTransformation:
  """An 'optimizer' that leaves params alone and returns the gradient as its new state."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@functools.cache
def _setup(loss: str, accum: int, norm: str = "token_mean"):
  """(config, graphdef, params, the real jitted train step), built once per setting."""
  c = tiny.get_config("smoke")
  c.rl.loss = loss
  c.rl.group_size = GROUP_SIZE
  c.rl.groups_per_step = GROUPS
  c.rl.grpo.norm = norm
  c.train.grad_accum = accum
  _, graphdef, params = init_model(c)
  sampling = SamplingParams.from_config(c.sampling)
  return c, graphdef, params, make_train_step(c, graphdef, _gradient_out(), sampling)


def _batch(config, *, truncated_rows=(), seed=0) -> dict:
  """A hand-made batch of GROUPS whole groups: random tokens, answers of random lengths."""
  rng = np.random.default_rng(seed)
  b, t = GROUPS * GROUP_SIZE, seq_len(config)
  tokens = rng.integers(0, config.model.vocab_size, (b, t)).astype(np.int32)  # [B, T]
  mask = np.zeros((b, t - 1), np.float32)  # [B, T-1]
  for row, length in enumerate(rng.integers(1, t - PROMPT_LEN + 1, b)):
    mask[row, PROMPT_LEN - 1:PROMPT_LEN - 1 + length] = 1.0
  sampler = np.where(mask > 0, -rng.uniform(0.1, 3.0, mask.shape), 0.0).astype(np.float32)
  mask[list(truncated_rows)] = 0.0  # cut at the length limit, count_truncated=False
  rewards = rng.integers(0, 2, b).astype(np.float32)  # [B]
  return {"tokens": tokens, "mask": mask, "sampler_logprobs": sampler, "rewards": rewards}


def _step(setup, snapshot, batch, with_metrics=False):
  """(loss, grads) of a train step with config.train.grad_accum micro-batches (and its
  metrics, as floats, if `with_metrics`)."""
  _, _, params, step = setup
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (the step donates its inputs)
  _, grads, metrics = step(copy(params), _gradient_out().init(params), snapshot,
                           Batch(**{k: jnp.asarray(v) for k, v in batch.items()}))
  out = float(metrics["loss"]), grads
  return (*out, {k: float(v) for k, v in metrics.items()}) if with_metrics else out


def _assert_same_metrics(metrics, ref, accum):
  """Every metric of the accumulated step equals the one-micro-batch step's (the full batch's)."""
  assert metrics.keys() == ref.keys()
  for name, want in ref.items():
    if name != "grad_norm":  # the gradient is compared leaf by leaf
      np.testing.assert_allclose(metrics[name], want, rtol=1e-5, atol=1e-7,
                                 err_msg=f"{name}, grad_accum={accum}")


def _assert_same(loss, grads, ref_loss, ref_grads):
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    r = np.asarray(r)
    np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


# CI runs the truncated case (it covers the all-counted one's code path and more); the other
# cases of this test and the next are slow (2 min each on 2 cores): `pytest -m slow`.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("truncated_rows", [pytest.param((), marks=SLOW), (0, 1, 2, 9)],
                         ids=["all_counted", "truncated"])
def test_oapl_grad_accum_equals_the_full_batch_formula(truncated_rows):
  """The step's loss and gradient, for 1, 2 and 4 micro-batches, equal the full batch's
  mean over counted answers, computed here from the model's log-probs without losses.oapl."""
  config, graphdef, params, _ = _setup("oapl", 1)
  batch = _batch(config, truncated_rows=truncated_rows)
  sampling = SamplingParams.from_config(config.sampling)
  beta1, beta2 = config.rl.beta1, config.rl.beta2

  @jax.jit
  def reference(params, batch):
    logp, _ = token_logprobs(nnx.merge(graphdef, params), batch["tokens"], sampling)  # [B, T-1]
    valid = batch["mask"] > 0
    ell = jnp.sum(jnp.where(valid, logp - batch["sampler_logprobs"], 0.0), axis=1)  # [B]
    scaled = batch["rewards"].reshape(GROUPS, GROUP_SIZE) / beta1  # [N, G]
    v_hat = jnp.repeat(beta1 * (jax.nn.logsumexp(scaled, axis=1) - math.log(GROUP_SIZE)), GROUP_SIZE)
    residual = beta2 * ell - (batch["rewards"] - v_hat)  # [B]
    counted = valid.any(axis=1)  # [B]
    return jnp.sum(jnp.where(counted, residual ** 2, 0.0)) / counted.sum()

  ref_loss, ref_grads = jax.value_and_grad(reference)(params, batch)
  ref_metrics = None
  for accum in (1, 2, 4):
    loss, grads, metrics = _step(_setup("oapl", accum), params, batch, with_metrics=True)
    _assert_same(loss, grads, float(ref_loss), ref_grads)
    # the metrics (means over counted answers / tokens) are the full batch's too, though the
    # micro-batches hold different numbers of them (the truncated rows are in the first two)
    ref_metrics = ref_metrics or metrics
    _assert_same_metrics(metrics, ref_metrics, accum)


@pytest.mark.parametrize("norm", [n if n == "token_mean" else pytest.param(n, marks=SLOW)
                                  for n in losses.NORMS])
def test_grpo_grad_accum_equals_the_full_batch(norm):
  """GRPO+IS with each normalisation: 2 and 4 micro-batches give the 1-micro-batch step."""
  _check_grpo_accum(norm, (2, 4))


@pytest.mark.parametrize("norm", [n for n in losses.NORMS if n != "token_mean"])
def test_grpo_grad_accum_in_4_micro_batches_equals_the_full_batch(norm):
  """The reduced form of the slow cases above (CI): the other normalisations with 4
  micro-batches only (~20 s each). Each micro-batch's own answer count in place of the full
  batch's (num_answers ignored, by hand) fails both."""
  _check_grpo_accum(norm, (4,))


def _check_grpo_accum(norm: str, accums: tuple[int, ...]) -> None:
  config, _, params, _ = _setup("grpo", 1, norm)
  noise = jax.random.key(1)
  snapshot = jax.tree.map(  # pi_prox != pi_theta: PPO ratios off 1
      lambda x: x + 0.05 * jax.random.normal(noise, x.shape, x.dtype), params)
  batch = _batch(config, truncated_rows=(3, 6), seed=1)
  ref_loss, ref_grads, ref_metrics = _step(_setup("grpo", 1, norm), snapshot, batch, True)
  assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(ref_grads))
  for accum in accums:
    loss, grads, metrics = _step(_setup("grpo", accum, norm), snapshot, batch, True)
    _assert_same(loss, grads, ref_loss, ref_grads)
    _assert_same_metrics(metrics, ref_metrics, accum)
