"""Pure JAX loss functions for off-policy RL on LLM answers.

The contract is `shared/docs/oapl.md`. Shapes: ``B`` answers in a batch (``num_groups *
group_size``, the answers of one question contiguous), ``T`` token positions per answer.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """OAPL squared-residual loss: ``mean_i (beta2 * ell_i - A_i)^2``.

    ``ell_i = sum_t mask * (logprobs - old_logprobs)`` over answer tokens (no length
    normalisation), ``A_i = R_i - V_hat`` with ``V_hat`` from :func:`group_value` (``beta1``).
    Gradient w.r.t. ``logprobs[i, t]`` on a counted token: ``2 * beta2 * (beta2*ell_i - A_i) / B``.

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

    Returns:
      ``(loss, metrics)``: scalar loss and a dict of scalars ``ell_abs_mean`` (mean |ell|),
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
    loss = jnp.mean(jnp.square(residual))  # []
    metrics = {
        "ell_abs_mean": jnp.mean(jnp.abs(ell)),
        "residual_abs_mean": jnp.mean(jnp.abs(residual)),
        "advantage_mean": jnp.mean(advantages),
        "v_hat_mean": jnp.mean(v_hat),
    }
    return loss, metrics


LOSSES: dict[str, Callable[..., tuple[jax.Array, dict[str, jax.Array]]]] = {"oapl": oapl}
