"""The train step: AdamW and one jitted optimizer step on the configured loss (`rl.loss`).

The step scores a batch with the trainer's log-prob kernel (`logprobs.token_logprobs`, under
the engine's sampling settings), computes the loss (`losses.LOSSES`), accumulates gradients
over micro-batches of whole groups, and applies the update unless it is not finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from oapl_jax.rl import losses
from oapl_jax.rl.buffer import Rows
from oapl_jax.rl.logprobs import token_logprobs
from oapl_jax.sampling.processing import SamplingParams


@struct.dataclass
class Batch:
  """One trainer step's device batch: B answers, whole groups of G contiguous rows."""

  tokens: jax.Array  # [B, T] int32: prompt + answer + padding
  mask: jax.Array  # [B, T-1] float32: 1 on answer targets that count in the loss
  sampler_logprobs: jax.Array  # [B, T-1] float32: the engine's log-probs of the targets
  rewards: jax.Array  # [B] float32

  @classmethod
  def from_rows(cls, rows: Rows) -> "Batch":
    return cls(tokens=rows.tokens, mask=rows.mask, sampler_logprobs=rows.sampler_logprobs,
               rewards=rows.rewards)


def make_optimizer(train, total_steps: int) -> optax.GradientTransformation:
  """AdamW with grad-norm clipping and a cosine schedule with linear warm-up (`train`: config.train)."""
  warm = int(round(train.warmup_ratio * total_steps))
  if warm == 0:
    schedule = optax.cosine_decay_schedule(train.lr, total_steps, alpha=train.min_lr_ratio)
  else:  # linear from lr/(warm+1) (the first step is never a zero-lr step), then cosine
    schedule = optax.warmup_cosine_decay_schedule(
        train.lr / (warm + 1), train.lr, warm, max(total_steps, warm + 1), train.lr * train.min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip),
      optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay))


def uses_reference(config) -> bool:
  """Whether the run keeps a frozen reference policy (GRPO's KL penalty)."""
  return config.rl.loss == "grpo" and config.rl.grpo.kl_coef > 0


def _token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of `[B, T]` x over tokens where mask > 0 (masked entries may be inf)."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(mask.sum(), 1.0)


def make_train_step(config, graphdef, optimizer, sampling: SamplingParams):
  """Jitted (params, opt_state, snapshot, batch, reference) -> (params, opt_state, metrics).

  batch: a `Batch` of whole groups. sampling: the engine's settings (the log-prob contract:
  the trainer scores tokens under the distribution the engine sampled from).
  `reference` is the frozen reference policy (GRPO with a KL penalty) or None.
  Gradient accumulation splits B into `train.grad_accum` micro-batches of whole groups; the
  loss is the full-batch one: every micro-batch divides by the full batch's count / accum
  (OAPL: of counted answers, so truncated answers left out by `rl.count_truncated=False` are
  out of the mean; GRPO token-mean: of tokens).
  A step whose loss or gradient norm is not finite leaves params and optimizer state unchanged
  (metric `step_skipped`). With finite gradients AdamW's update is finite too (lr, eps and the
  other settings are validated finite), so the update needs no check of its own.
  """
  rl = config.rl
  loss_impl = functools.partial(losses.LOSSES[rl.loss], group_size=rl.group_size,
                                **losses.kwargs_from_config(config))
  accum = config.train.grad_accum
  # GRPO's pi_prox is always the trainer's log-probs on the snapshot; OAPL's pi_old only if asked.
  needs_snapshot = rl.loss == "grpo" or rl.old_logprobs == "snapshot"

  def frozen_logprobs(params, tokens):
    return jax.lax.stop_gradient(token_logprobs(nnx.merge(graphdef, params), tokens, sampling,
                                                tile=config.train.logprob_tile)[0])

  def micro_loss(params, snapshot, reference, mb, num_tokens, num_answers):
    logp, ent = token_logprobs(nnx.merge(graphdef, params), mb.tokens, sampling,
                               tile=config.train.logprob_tile)  # [b, T-1]
    mask, sampler = mb.mask, mb.sampler_logprobs
    m = {}
    snap = None
    if needs_snapshot:
      snap = frozen_logprobs(snapshot, mb.tokens)
      m["snapshot_vs_sampler_abs"] = _token_mean(jnp.abs(snap - sampler), mask)
    if rl.loss == "oapl":
      old = snap if rl.old_logprobs == "snapshot" else sampler
      loss, loss_metrics = loss_impl(logp, old, mask, mb.rewards, num_answers=num_answers)
    else:
      ref = None if reference is None else frozen_logprobs(reference, mb.tokens)
      loss, loss_metrics = loss_impl(logp, snap, sampler, mask, mb.rewards, ref_logprobs=ref,
                                     num_tokens=num_tokens)
    m.update(loss_metrics, entropy=_token_mean(ent, mask),
             trainer_vs_sampler_abs=_token_mean(jnp.abs(logp - sampler), mask))
    return loss, m

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, snapshot, batch, reference=None):
    num_tokens = batch.mask.sum() / accum  # per micro-batch share of the full batch's tokens
    num_answers = (batch.mask.sum(axis=1) > 0).sum() / accum  # ... and of its counted answers
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(grads, mb):
      (loss, m), g = grad_fn(params, snapshot, reference, mb, num_tokens, num_answers)
      return jax.tree.map(jnp.add, grads, g), (loss, m)

    grads, (loss, m) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    grads = jax.tree.map(lambda g: g / accum, grads)
    new_updates, new_opt_state = optimizer.update(grads, opt_state, params)
    grad_norm = optax.global_norm(grads)
    # A step whose loss or gradient is not finite is skipped: params and optimizer state stay
    # as they were (the run counts these and stops after train.max_nonfinite_steps).
    finite = jnp.isfinite(loss).all() & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, optax.apply_updates(params, new_updates), params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    reduce = {"is_weight_min": jnp.min, "is_weight_max": jnp.max}
    metrics = {"loss": loss.mean(), "grad_norm": grad_norm, "step_skipped": 1.0 - finite,
               **{k: reduce.get(k, jnp.mean)(v) for k, v in m.items()}}
    return params, opt_state, metrics

  return train_step
