"""Pure JAX loss functions for off-policy RL on LLM answers.

The contract is `docs/algorithm.md`. Shapes: ``B`` answers in a batch (``num_groups *
group_size``, the answers of one question contiguous), ``T`` token positions per answer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from oapl_jax.rl.names import ADV_NORMS, IS_LEVELS, IS_MODES, LOSS_NAMES, NORMS, beta2_of


def _check_groups(batch: int, group_size: int) -> int:
  """Return the number of groups; raise ValueError unless ``group_size`` divides ``batch``."""
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  if batch % group_size != 0:
    raise ValueError(
        f"group_size={group_size} does not divide the batch of {batch} answers; "
        "each group's answers must be contiguous and complete"
    )
  return batch // group_size


def _check_positive(name: str, value: float) -> None:
  if not value > 0:
    raise ValueError(f"{name} must be > 0, got {value}")


def group_value(rewards: jax.Array, *, group_size: int, beta1: float) -> jax.Array:
  """Soft value estimate of each answer's group, broadcast back to the answers.

  ``V_hat = beta1 * (logsumexp_i(R_i / beta1) - log G)`` over the ``G = group_size`` answers
  of a group: a log-mean-exp computed with logsumexp, so large ``R / beta1`` cannot overflow.

  Args:
    rewards: ``[B]`` rewards; answers of one group are contiguous.
    group_size: ``G``; must divide ``B``.
    beta1: temperature of the soft value, > 0.

  Returns:
    ``[B]`` the group's ``V_hat`` repeated for each of its answers.
  """
  _check_positive("beta1", beta1)
  (batch,) = rewards.shape
  num_groups = _check_groups(batch, group_size)
  scaled = rewards.reshape(num_groups, group_size) / beta1  # [N, G]
  lse = jax.nn.logsumexp(scaled, axis=1)  # [N]
  v_hat = beta1 * (lse - math.log(group_size))  # [N]
  return jnp.repeat(v_hat, group_size)  # [B]


def sequence_log_ratio(
    logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array
) -> jax.Array:
  """Masked sum over tokens of ``logprobs - old_logprobs`` (no length normalisation).

  Positions with ``mask == 0`` are replaced by 0 before any arithmetic, so a ``-inf`` or
  ``NaN`` there reaches neither the value nor the gradient.

  Args:
    logprobs: ``[B, T]`` per-token log-probs under the trained policy (carries gradient).
    old_logprobs: ``[B, T]`` per-token log-probs under the sampling policy.
    mask: ``[B, T]`` 1.0 on answer tokens that count, 0.0 on prompt / padding.

  Returns:
    ``[B]`` ``ell_i = sum_t mask * (logprobs - old_logprobs)``.
  """
  valid = mask > 0  # [B, T]
  lp = jnp.where(valid, logprobs, 0.0)  # [B, T]
  old = jnp.where(valid, old_logprobs, 0.0)  # [B, T]
  return jnp.sum(jnp.where(valid, mask * (lp - old), 0.0), axis=-1)  # [B]


def oapl(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    mask: jax.Array,
    rewards: jax.Array,
    *,
    group_size: int,
    beta1: float,
    beta2: float,
    num_answers: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """OAPL squared-residual loss: ``sum_{counted i} (beta2 * ell_i - A_i)^2 / N``.

  ``ell_i = sum_t mask * (logprobs - old_logprobs)`` over answer tokens (no length
  normalisation), ``A_i = R_i - V_hat`` with ``V_hat`` from :func:`group_value` (``beta1``).

  An answer counts when its ``mask`` row has a counted token. One with none (an answer cut
  at the length limit under ``count_truncated=False``) is still in its group's ``V_hat`` but
  not in the mean: neither its constant residual ``A_i^2`` in the sum nor itself in ``N``.
  ``N`` is the number of counted answers, or ``num_answers`` if given (so that
  gradient-accumulation micro-batches can share the full batch's count: each passes
  ``N_full / k`` and the mean of their losses is the full batch's). When every answer counts
  the loss is ``jnp.mean`` over the batch, bit for bit. Gradient w.r.t. ``logprobs[i, t]`` on
  a counted token: ``2 * beta2 * (beta2*ell_i - A_i) / N``.

  Stop-gradient: ``old_logprobs``, ``rewards``, ``V_hat`` and ``A`` are constants; only
  ``logprobs`` carries gradient.

  Args:
    logprobs: ``[B, T]`` float32 per-token log-probs of the answer tokens under pi_theta.
    old_logprobs: ``[B, T]`` float32 per-token log-probs under the sampler pi_old.
    mask: ``[B, T]`` float32, 1 on answer tokens that count, 0 on prompt / padding
      (values there may be ``-inf``).
    rewards: ``[B]`` rewards; the ``group_size`` answers of one question are contiguous.
    group_size: ``G``; must divide ``B``.
    beta1: temperature of ``V_hat``, > 0.
    beta2: weight of ``ell`` in the residual, > 0.
    num_answers: scalar denominator ``N`` overriding the count of counted answers; None:
      the count in this batch.

  Returns:
    ``(loss, metrics)``: scalar loss (0 if nothing counts) and a dict of scalars, means over
    this batch's counted answers (0 if none): ``target_out_of_reach`` (the fraction whose
    target ``A_i / beta2`` exceeds ``-log pi_old(o_i)``, the most an answer's log-prob can
    rise: docs/algorithm.md "Reachable targets"), ``ell_abs_mean`` (mean |ell|),
    ``residual_abs_mean`` (mean |beta2*ell - A|), ``advantage_mean``, ``v_hat_mean``.
  """
  _check_positive("beta2", beta2)
  if not (logprobs.shape == old_logprobs.shape == mask.shape) or logprobs.ndim != 2:
    raise ValueError(
        "logprobs, old_logprobs, mask must share one [B, T] shape, got "
        f"{logprobs.shape}, {old_logprobs.shape}, {mask.shape}"
    )
  if rewards.shape != logprobs.shape[:1]:
    raise ValueError(f"rewards must be [B]={logprobs.shape[:1]}, got {rewards.shape}")

  old_logprobs = jax.lax.stop_gradient(old_logprobs)  # [B, T]
  rewards = jax.lax.stop_gradient(rewards)  # [B]
  v_hat = group_value(rewards, group_size=group_size, beta1=beta1)  # [B]
  advantages = jax.lax.stop_gradient(rewards - v_hat)  # [B]
  ell = sequence_log_ratio(logprobs, old_logprobs, mask)  # [B]
  residual = beta2 * ell - advantages  # [B]
  counted = jnp.any(mask > 0, axis=-1)  # [B]
  n_counted = jnp.sum(counted.astype(residual.dtype))  # []
  denom = n_counted if num_answers is None else num_answers
  # where, not a multiply by counted: with every answer counted this is jnp.mean's sum / B
  loss = jnp.sum(jnp.where(counted, jnp.square(residual), 0.0)) / jnp.maximum(denom, 1.0)  # []

  def counted_mean(x):  # [B] -> [], over this batch's counted answers
    return jnp.sum(jnp.where(counted, x, 0.0)) / jnp.maximum(n_counted, 1.0)

  # A target asks an answer to gain A_i / beta2 nats; its log-prob can rise at most to 0, i.e.
  # by -log pi_old(answer) = -sum_t old_logprobs: a target above that is out of reach.
  reach = -jnp.sum(jnp.where(mask > 0, mask * old_logprobs, 0.0), axis=-1)  # [B] -log pi_old
  out_of_reach = (advantages / beta2 > reach).astype(residual.dtype)  # [B]
  metrics = {
      "target_out_of_reach": counted_mean(out_of_reach),
      "ell_abs_mean": counted_mean(jnp.abs(ell)),
      "residual_abs_mean": counted_mean(jnp.abs(residual)),
      "advantage_mean": counted_mean(advantages),
      "v_hat_mean": counted_mean(v_hat),
  }
  return loss, metrics


# --- the baseline: GRPO with importance sampling ------------------------------------------------



def group_advantages(rewards: jax.Array, *, group_size: int, adv_norm: str = "std",
                     eps: float = 1e-6) -> jax.Array:
  """GRPO advantages ``R_i - mean_group(R)``, divided by ``std_group(R) + eps`` if ``adv_norm="std"``.

  The std is the unbiased sample std (``ddof=1``), as in the GRPO reference implementations;
  ``adv_norm="none"`` is Dr.GRPO. Returns ``[B]``, no gradient.
  """
  if adv_norm not in ADV_NORMS:
    raise ValueError(f"adv_norm must be one of {ADV_NORMS}, got {adv_norm!r}")
  (batch,) = rewards.shape
  num_groups = _check_groups(batch, group_size)
  r = jax.lax.stop_gradient(rewards).reshape(num_groups, group_size)  # [N, G]
  adv = r - r.mean(axis=1, keepdims=True)  # [N, G]
  if adv_norm == "std":
    adv = adv / (jnp.std(r, axis=1, keepdims=True, ddof=1 if group_size > 1 else 0) + eps)
  return adv.reshape(batch)  # [B]


IS_METRIC_LOG_BOUND = 50.0  # raw IS weights (metrics only) are exp(clip(log w, -50, 50))
RATIO_LOG_BOUND = 50.0  # PPO's log-ratio log pi_theta - log pi_prox is capped here before exp


def importance_weights(prox_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array, *,
                       level: str, mode: str, cap: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """IS correction from the sampler (engine) to pi_prox (trainer on the same weights).

  ``log w = log pi_prox - log pi_sampler`` per token (``level="token"``) or per answer, summed
  over its tokens and broadcast back (``"sequence"``); then ``"truncate"``: ``min(w, C)``,
  ``"mask"``: 0 where ``w`` is outside ``[1/C, C]``, ``"none"``: 1. Everything is decided in
  log space against ``±log C`` and only clipped log-weights are exponentiated, so a summed
  log-ratio of hundreds of nats (a long answer, a stale sampler) gives finite weights and no
  ``inf * 0 = NaN``.

  Returns ``(weights [B, T], raw weights [B, T], kept [B, T])``, all stop-gradient; ``kept``
  is 0 on counted tokens that ``"mask"`` dropped. Entries outside ``mask`` are 1 and unused.
  The raw weights are for metrics: ``exp(clip(log w, -L, L))`` with ``L =
  IS_METRIC_LOG_BOUND`` (50 nats, ``e^50 ~ 5e21``), so they saturate instead of overflowing
  and a mean over even 1e12 tokens stays finite in float32.
  """
  if level not in IS_LEVELS:
    raise ValueError(f"is_level must be one of {IS_LEVELS}, got {level!r}")
  if mode not in IS_MODES:
    raise ValueError(f"is_mode must be one of {IS_MODES}, got {mode!r}")
  _check_positive("is_cap", cap)
  valid = mask > 0
  log_w = jnp.where(valid, jax.lax.stop_gradient(prox_logprobs) - sampler_logprobs, 0.0)  # [B, T]
  if level == "sequence":
    log_w = jnp.broadcast_to(log_w.sum(axis=1, keepdims=True), log_w.shape)
  log_cap = math.log(cap)
  bound = IS_METRIC_LOG_BOUND
  raw = jnp.exp(jnp.clip(log_w, -bound, bound))  # [B, T]
  ones = jnp.ones_like(raw)
  if mode == "truncate":
    w = jnp.where(log_w < log_cap, jnp.exp(jnp.minimum(log_w, log_cap)), cap)  # C exactly
    kept = ones
  elif mode == "mask":
    keep = (log_w >= -log_cap) & (log_w <= log_cap)  # [B, T]
    kept = keep.astype(raw.dtype)
    w = jnp.where(keep, jnp.exp(jnp.clip(log_w, -log_cap, log_cap)), 0.0)
  else:
    w, kept = ones, ones
  w = jnp.where(valid, w, 1.0)
  return jax.lax.stop_gradient(w), jax.lax.stop_gradient(raw), jnp.where(valid, kept, 1.0)


def _check_grpo_args(logprobs, prox_logprobs, sampler_logprobs, mask, rewards, *, eps_low,
                     eps_high, norm, max_tokens, needs_ref) -> None:
  """Raises ValueError for shapes or settings `grpo` cannot use."""
  if not (logprobs.shape == prox_logprobs.shape == sampler_logprobs.shape == mask.shape) \
          or logprobs.ndim != 2:
    raise ValueError(
        "logprobs, prox_logprobs, sampler_logprobs, mask must share one [B, T] shape, got "
        f"{logprobs.shape}, {prox_logprobs.shape}, {sampler_logprobs.shape}, {mask.shape}")
  if rewards.shape != logprobs.shape[:1]:
    raise ValueError(f"rewards must be [B]={logprobs.shape[:1]}, got {rewards.shape}")
  if not (0 <= eps_low < 1 and eps_high >= 0):
    raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  if norm == "constant" and not max_tokens:
    raise ValueError("norm='constant' (Dr.GRPO) needs max_tokens")
  if needs_ref:
    raise ValueError("kl_coef > 0 needs ref_logprobs")


def _normalise(obj: jax.Array, m: jax.Array, kept: jax.Array, norm: str, *, num_tokens,
               num_answers, max_tokens) -> jax.Array:
  """The batch objective from per-token terms `obj` `[B, T]` (zero where `m` is 0), by `norm`.

  Only what the objective sums counts in a denominator: the tokens `m` counts and the IS
  weights kept (`kept`: 0 where `is_mode="mask"` dropped one), the answers with a counted token
  (an answer cut at max_new_tokens under `count_truncated=False` has none). `num_tokens` /
  `num_answers` (gradient accumulation: the full batch's counts / accum) replace this
  micro-batch's; masked-out tokens are then taken off at this micro-batch's kept fraction."""
  counted = m * kept
  if norm == "token_mean":
    denom = counted.sum() if num_tokens is None else num_tokens * counted.sum() / jnp.maximum(m.sum(), 1.0)
    return obj.sum() / jnp.maximum(denom, 1.0)
  answers = (m.sum(axis=1) > 0).sum() if num_answers is None else num_answers
  if norm == "seq_mean":
    return jnp.sum(obj.sum(axis=1) / jnp.maximum(counted.sum(axis=1), 1.0)) / jnp.maximum(answers, 1.0)
  return obj.sum() / (jnp.maximum(answers, 1.0) * max_tokens)


def grpo(
    logprobs: jax.Array,
    prox_logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    mask: jax.Array,
    rewards: jax.Array,
    *,
    group_size: int,
    adv_norm: str = "std",
    adv_eps: float = 1e-6,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_level: str = "token",
    is_mode: str = "truncate",
    is_cap: float = 2.0,
    norm: str = "token_mean",
    max_tokens: int | None = None,
    num_tokens: jax.Array | None = None,
    num_answers: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GRPO's clipped surrogate with an importance-sampling correction (docs/algorithm.md, the baseline).

  Per counted token ``t`` of answer ``i``::

      r_t   = exp(log pi_theta_t - log pi_prox_t)          # PPO ratio vs the sampling snapshot
      w_t   = IS weight pi_prox / pi_sampler (see importance_weights), no gradient
      obj_t = w_t * min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
              - kl_coef * k3(pi_theta, pi_ref)_t
      loss  = -normalise(obj)

  ``norm``: ``"token_mean"`` (sum over counted tokens / their count; ``num_tokens`` overrides
  the count, so gradient-accumulation micro-batches can share the full batch's), ``"seq_mean"``
  (each answer's token mean, then the mean over answers), ``"constant"`` (Dr.GRPO: sum / (N *
  ``max_tokens``)), N the answers with a counted token (``num_answers`` overrides it). Tokens
  that ``is_mode="mask"`` drops count in no denominator (:func:`_normalise`). ``k3 = exp(ref - logp) - (ref - logp) - 1`` is the usual non-negative
  estimator of KL(pi_theta || pi_ref).

  With ``logprobs == prox_logprobs == sampler_logprobs`` (lag 0, no engine mismatch) every
  ratio and weight is 1 and the gradient is plain GRPO's, ``-A_i * grad log pi_theta_t / N``.

  Args:
    logprobs: ``[B, T]`` log pi_theta (carries gradient).
    prox_logprobs: ``[B, T]`` the trainer's log-probs under the snapshot that sampled.
    sampler_logprobs: ``[B, T]`` the engine's log-probs.
    mask: ``[B, T]`` 1 on counted answer tokens, 0 elsewhere (log-probs there may be -inf).
    rewards: ``[B]``, groups of ``group_size`` contiguous answers.
    ref_logprobs: ``[B, T]`` reference log-probs, needed when ``kl_coef > 0``.

  Returns:
    ``(loss, metrics)``; metrics: ``clip_fraction`` (tokens whose clipped term is the min),
    ``is_weight_mean/min/max`` (raw weights over counted tokens, each saturating at
    ``exp(±IS_METRIC_LOG_BOUND)``: see :func:`importance_weights`), ``is_masked_fraction``,
    ``ratio_mean``, ``advantage_abs_mean``, and ``kl`` when ``kl_coef > 0``.
  """
  _check_grpo_args(logprobs, prox_logprobs, sampler_logprobs, mask, rewards, eps_low=eps_low,
                   eps_high=eps_high, norm=norm, max_tokens=max_tokens,
                   needs_ref=bool(kl_coef) and ref_logprobs is None)
  valid, m, logp, prox, sampler = _masked(logprobs, prox_logprobs, sampler_logprobs, mask)
  adv = group_advantages(rewards, group_size=group_size, adv_norm=adv_norm, eps=adv_eps)[:, None]
  w, raw_w, kept = importance_weights(prox, sampler, mask, level=is_level, mode=is_mode, cap=is_cap)
  obj, ratio, unclipped, clipped = clipped_surrogate(logp, prox, adv, w, eps_low=eps_low,
                                                     eps_high=eps_high)  # [B, T]
  metrics = {}
  if kl_coef:
    k3 = kl_k3(logp, ref_logprobs, valid)  # [B, T]
    obj = obj - kl_coef * k3
    metrics["kl"] = jnp.sum(k3 * m) / jnp.maximum(m.sum(), 1.0)
  obj = obj * m
  loss = -_normalise(obj, m, kept, norm, num_tokens=num_tokens, num_answers=num_answers,
                     max_tokens=max_tokens)
  metrics.update(_grpo_metrics(m, valid, unclipped=unclipped, clipped=clipped, raw_w=raw_w,
                               kept=kept, ratio=ratio, adv=adv))
  return loss, metrics


def _masked(logprobs, prox_logprobs, sampler_logprobs, mask):
  """``(valid, m, logp, prox, sampler)``: the counted tokens (bool, float) and the three
  ``[B, T]`` log-probs with 0 outside them (so a -inf there reaches no value or gradient);
  ``prox`` and ``sampler`` stop-gradient."""
  valid = mask > 0  # [B, T]
  m = jnp.where(valid, mask, 0.0)  # [B, T]
  prox = jax.lax.stop_gradient(jnp.where(valid, prox_logprobs, 0.0))  # [B, T]
  sampler = jax.lax.stop_gradient(jnp.where(valid, sampler_logprobs, 0.0))  # [B, T]
  logp = jnp.where(valid, logprobs, 0.0)  # [B, T]
  return valid, m, logp, prox, sampler


def clipped_surrogate(logp, prox, adv, w, *, eps_low: float, eps_high: float):
  """PPO's clipped surrogate with IS weights, per token: ``(obj, ratio, unclipped, clipped)``.

  ``ratio = exp(logp - prox)``, ``obj = w * min(ratio * A, clip(ratio, 1 - eps_low, 1 +
  eps_high) * A)``; logp, prox, w ``[B, T]`` (only logp carries gradient), adv ``[B, 1]``.
  The log-ratio is capped at ``RATIO_LOG_BOUND`` (50 nats) before the exp: past 88 nats it
  would overflow to inf (an inf loss, or ``inf * 0 = NaN`` in the gradient of the branch the
  min did not pick, and the step skipped); below the cap nothing changes, bit for bit.
  """
  ratio = jnp.exp(jnp.minimum(logp - prox, RATIO_LOG_BOUND))  # [B, T]
  unclipped = ratio * adv  # [B, T]
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # [B, T]
  return w * jnp.minimum(unclipped, clipped), ratio, unclipped, clipped


KL_K3_CAP = 10.0  # per token: k3 above it is cut (no gradient there), as verl's low_var_kl


def kl_k3(logp, ref_logprobs, valid):
  """``k3 = exp(ref - logp) - (ref - logp) - 1`` per token ``[B, T]``: the non-negative
  estimator of KL(pi_theta || pi_ref); ``ref`` is stop-gradient and 0 outside ``valid``.

  Capped at `KL_K3_CAP` per token: a token the policy has made far less likely than the
  reference (ref - logp of tens of nats) would otherwise give an inf term and an inf or NaN
  gradient. The log-ratio is clipped to +-20 before the exp so that neither side overflows."""
  ref = jax.lax.stop_gradient(jnp.where(valid, ref_logprobs, 0.0))  # [B, T]
  d = jnp.clip(ref - logp, -20.0, 20.0)
  return jnp.minimum(jnp.exp(d) - d - 1.0, KL_K3_CAP)


def _grpo_metrics(m, valid, *, unclipped, clipped, raw_w, kept, ratio, adv) -> dict[str, jax.Array]:
  """Token means over counted tokens (`m` `[B, T]`) of what `grpo` reports."""
  n = jnp.maximum(m.sum(), 1.0)
  tmean = lambda x: jnp.sum(x * m) / n  # noqa: E731
  is_clipped = (clipped < unclipped).astype(jnp.float32)  # the min picked the clipped term
  big = jnp.finfo(jnp.float32).max
  return {
      "clip_fraction": tmean(is_clipped),
      "is_weight_mean": tmean(raw_w),
      "is_weight_min": jnp.min(jnp.where(valid, raw_w, big)),
      "is_weight_max": jnp.max(jnp.where(valid, raw_w, 0.0)),
      "is_masked_fraction": tmean(1.0 - kept),
      "ratio_mean": tmean(jax.lax.stop_gradient(ratio)),
      "advantage_abs_mean": jnp.mean(jnp.abs(adv)),
  }


# --- how a metric combines over gradient-accumulation micro-batches ---------------------------

# Each metric above is a mean over one micro-batch's counted answers ("answers"), its counted
# tokens ("tokens") or its rows ("rows", equal in every micro-batch), or an extreme ("min",
# "max"). The step weights each micro-batch's mean by that count, so a step's metric is the
# full batch's whatever `train.grad_accum` is (`rl.step`). A metric missing here is a KeyError
# when the step is traced.
METRIC_REDUCTION: dict[str, str] = {
    "ell_abs_mean": "answers", "residual_abs_mean": "answers", "advantage_mean": "answers",
    "v_hat_mean": "answers", "target_out_of_reach": "answers",  # oapl
    "clip_fraction": "tokens", "is_weight_mean": "tokens", "is_masked_fraction": "tokens",
    "ratio_mean": "tokens", "kl": "tokens", "advantage_abs_mean": "rows",
    "is_weight_min": "min", "is_weight_max": "max",  # grpo
}


# --- the registry: each loss, the settings it reads and the log-probs it needs -----------------

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class LossInputs:
  """What the train step hands every registered loss: one micro-batch of ``b`` answers.

  Only ``logprobs`` carries gradient; the step scores the snapshot and the reference (with
  the trainer's kernel, stop-gradient) exactly when the loss's `LossSpec.needs` asks, else
  they are None.
  """

  logprobs: jax.Array  # [b, T] log pi_theta of the answer tokens
  sampler_logprobs: jax.Array  # [b, T] the engine's log-probs of the same tokens
  snapshot_logprobs: jax.Array | None  # [b, T] the trainer's on the snapshot (pi_old) or None
  reference_logprobs: jax.Array | None  # [b, T] the trainer's on the frozen reference or None
  mask: jax.Array  # [b, T] 1 on counted answer tokens
  rewards: jax.Array  # [b], whole groups of group_size contiguous answers
  num_tokens: jax.Array  # [] the full batch's counted tokens / grad_accum
  num_answers: jax.Array  # [] the full batch's counted answers / grad_accum


@dataclasses.dataclass(frozen=True)
class Needs:
  """The optional log-probs a loss needs under a config (`LossSpec.needs`)."""

  snapshot: bool  # the trainer's log-probs on the snapshot pi_old
  reference: bool  # the trainer's log-probs on the frozen reference policy


def _oapl_inputs(x: LossInputs, **kwargs):
  """`oapl` on `LossInputs`: pi_old is the snapshot's log-probs when the step scored them (its
  spec asks exactly when `rl.old_logprobs="snapshot"`), else the engine's."""
  old = x.sampler_logprobs if x.snapshot_logprobs is None else x.snapshot_logprobs
  return oapl(x.logprobs, old, x.mask, x.rewards, num_answers=x.num_answers, **kwargs)


def _grpo_inputs(x: LossInputs, *, prox: str, **kwargs):
  """`grpo` on `LossInputs`: pi_prox is the snapshot's log-probs (`prox="snapshot"`) or the
  trainer's own as the step starts (`"previous_step"`: `logprobs`, which `grpo` stops the
  gradient of where it uses them as pi_prox)."""
  prox_logprobs = x.snapshot_logprobs if prox == "snapshot" else x.logprobs
  return grpo(x.logprobs, prox_logprobs, x.sampler_logprobs, x.mask, x.rewards,
              ref_logprobs=x.reference_logprobs, num_tokens=x.num_tokens,
              num_answers=x.num_answers, **kwargs)


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss.

  fn: the pure loss function (its own keyword signature). settings: for each keyword argument
  the config sets, the dotted setting it comes from (`group_size` is `rl.group_size`), or a
  function of the config where a rule computes it (OAPL's beta2: `names.beta2_of`).
  apply: `(LossInputs, *, group_size, **settings, **routing) -> (loss, metrics)`, the one
  signature the train step calls. routing: settings `apply` itself reads (which log-probs go
  where), not arguments of `fn`. needs: config -> `Needs`, the optional log-probs `apply` reads.
  """

  fn: LossFn
  settings: dict[str, str | Callable]  # keyword argument -> setting, e.g. {"beta1": "rl.beta1"}
  apply: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
  needs: Callable[..., Needs]
  routing: dict[str, str] = dataclasses.field(default_factory=dict)  # apply's keyword -> setting


LOSS_SPECS: dict[str, LossSpec] = {
    "oapl": LossSpec(
        oapl, {"beta1": "rl.beta1", "beta2": beta2_of}, _oapl_inputs,
        lambda config: Needs(snapshot=config.rl.old_logprobs == "snapshot", reference=False)),
    "grpo": LossSpec(grpo, {
        "adv_norm": "rl.grpo.adv_norm", "adv_eps": "rl.grpo.adv_eps",
        "eps_low": "rl.grpo.eps_low", "eps_high": "rl.grpo.eps_high",
        "is_level": "rl.grpo.is_level", "is_mode": "rl.grpo.is_mode",
        "is_cap": "rl.grpo.is_cap", "norm": "rl.grpo.norm", "kl_coef": "rl.grpo.kl_coef",
        "max_tokens": "sampling.max_new_tokens"}, _grpo_inputs,
        # the snapshot's log-probs when they are pi_prox; the reference only for the KL penalty
        lambda config: Needs(snapshot=config.rl.grpo.prox == "snapshot",
                             reference=config.rl.grpo.kl_coef > 0),
        routing={"prox": "rl.grpo.prox"}),
}
# Name -> loss function: the names `config.rl.loss` is checked against.
LOSSES: dict[str, LossFn] = {name: spec.fn for name, spec in LOSS_SPECS.items()}
assert tuple(LOSSES) == LOSS_NAMES, (tuple(LOSSES), LOSS_NAMES)  # config validates against LOSS_NAMES


def _setting(config, name):
  """"rl.grpo.is_cap" -> config.rl.grpo.is_cap; a function: its value on the config."""
  if callable(name):
    return name(config)
  return functools.reduce(lambda section, part: section[part], name.split("."), config)


def kwargs_from_config(config) -> dict:
  """The keyword arguments of the configured loss (`config.rl.loss`), each read from the
  setting its `LOSS_SPECS` entry names: `{"beta1": config.rl.beta1, "beta2": ...}` for OAPL
  (beta2 by `rl.beta2_rule`)."""
  return {arg: _setting(config, name) for arg, name in LOSS_SPECS[config.rl.loss].settings.items()}


def needs(config) -> Needs:
  """The optional log-probs the configured loss (`config.rl.loss`) needs."""
  return LOSS_SPECS[config.rl.loss].needs(config)


def from_config(config) -> Callable[[LossInputs], tuple[jax.Array, dict[str, jax.Array]]]:
  """The configured loss as `LossInputs -> (loss, metrics)`, its settings bound."""
  spec = LOSS_SPECS[config.rl.loss]
  routing = {arg: _setting(config, name) for arg, name in spec.routing.items()}
  return functools.partial(spec.apply, group_size=config.rl.group_size,
                           **kwargs_from_config(config), **routing)
