"""Config validation: refuse bad settings, naming them, before any work starts."""

from __future__ import annotations

from oapl_jax.rl import losses

OLD_LOGPROB_SOURCES = ("sampler", "snapshot")
MODES = ("sync",)
TASKS = ("addition",)


class ConfigError(ValueError):
  """A setting has a value the run cannot use."""


def _check(ok: bool, setting: str, value, why: str):
  if not ok:
    raise ConfigError(f"config.{setting}={value!r}: {why}")


def validate(c) -> None:
  """Raises `ConfigError` naming the first invalid setting of `c`."""
  _check(isinstance(c.seed, int) and c.seed >= 0, "seed", c.seed, "must be an int >= 0")
  _check(c.task.name in TASKS, "task.name", c.task.name, f"must be one of {TASKS}")

  rl = c.rl
  _check(rl.loss in losses.LOSSES, "rl.loss", rl.loss, f"unknown loss; known: {sorted(losses.LOSSES)}")
  _check(rl.beta1 > 0, "rl.beta1", rl.beta1, "must be > 0")
  _check(rl.beta2 > 0, "rl.beta2", rl.beta2, "must be > 0")
  _check(rl.group_size >= 2, "rl.group_size", rl.group_size, "must be >= 2 (V_hat needs a group)")
  _check(rl.lag >= 1, "rl.lag", rl.lag, "must be >= 1")
  _check(rl.old_logprobs in OLD_LOGPROB_SOURCES, "rl.old_logprobs", rl.old_logprobs,
         f"must be one of {OLD_LOGPROB_SOURCES}")
  _check(rl.mode in MODES, "rl.mode", rl.mode, f"must be one of {MODES}")
  _check(rl.groups_per_step >= 1, "rl.groups_per_step", rl.groups_per_step, "must be >= 1")
  _check(rl.groups_per_rollout >= 1, "rl.groups_per_rollout", rl.groups_per_rollout, "must be >= 1")

  s = c.sampling
  _check(s.temperature > 0, "sampling.temperature", s.temperature, "must be > 0")
  _check(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "must be in (0, 1]")
  _check(s.top_k >= 0, "sampling.top_k", s.top_k, "must be >= 0 (0 = off)")
  _check(s.max_new_tokens >= 1, "sampling.max_new_tokens", s.max_new_tokens, "must be >= 1")
  _check(s.max_slots >= rl.group_size, "sampling.max_slots", s.max_slots,
         f"must be >= rl.group_size={rl.group_size}")
  _check(s.max_slots >= c.eval.samples_per_problem, "sampling.max_slots", s.max_slots,
         f"must be >= eval.samples_per_problem={c.eval.samples_per_problem}")

  t = c.train
  _check(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
  _check(t.lr > 0, "train.lr", t.lr, "must be > 0")
  _check(0 <= t.warmup_ratio < 1, "train.warmup_ratio", t.warmup_ratio, "must be in [0, 1)")
  _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
  _check(t.grad_clip > 0, "train.grad_clip", t.grad_clip, "must be > 0")
  _check(t.grad_accum >= 1 and rl.groups_per_step % t.grad_accum == 0, "train.grad_accum",
         t.grad_accum, f"must be >= 1 and divide rl.groups_per_step={rl.groups_per_step}")

  _check(c.warmup.steps >= 0, "warmup.steps", c.warmup.steps, "must be >= 0")
  _check(0 <= c.warmup.noisy_steps <= c.warmup.steps, "warmup.noisy_steps", c.warmup.noisy_steps,
         f"must be in [0, warmup.steps={c.warmup.steps}]")
  _check(0 <= c.warmup.digit_noise < 1, "warmup.digit_noise", c.warmup.digit_noise, "must be in [0, 1)")
  _check(c.eval.samples_per_problem >= 1, "eval.samples_per_problem", c.eval.samples_per_problem,
         "must be >= 1")
  _check(c.eval.every >= 0, "eval.every", c.eval.every, "must be >= 0 (0 = before/after only)")
  _check(c.checkpoint.every >= 1, "checkpoint.every", c.checkpoint.every, "must be >= 1")
  _check(c.checkpoint.keep >= 1, "checkpoint.keep", c.checkpoint.keep, "must be >= 1")
  _check(c.log.every >= 1, "log.every", c.log.every, "must be >= 1")
  _check(c.model.num_heads % c.model.num_kv_heads == 0, "model.num_kv_heads", c.model.num_kv_heads,
         f"must divide model.num_heads={c.model.num_heads}")
