"""Supervised warm-up that makes the base policy of the embedded task.

Cross-entropy on answer tokens, in two phases: clean demonstrations first (the model learns
the task), then, for the last `warmup.noisy_steps` steps, *noisy* demonstrations (each digit
wrong with probability `warmup.digit_noise`). The second phase flattens the answer
distribution, so the base model knows the right answer but is calibrated and imperfect: its
pass@1 is about (1 - noise)^digits, and RL with the verifiable reward has errors to fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def demo_batch(task, tokenizer, rng: np.random.Generator, *, batch_size: int, seq_len: int,
               digit_noise: float) -> dict[str, np.ndarray]:
  """tokens `[B, seq_len]` (bos + prompt + answer + eos, padded), mask `[B, seq_len-1]` on answer targets."""
  tokens = np.full((batch_size, seq_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((batch_size, seq_len - 1), np.float32)
  for i, problem in enumerate(task.train_problems(rng, batch_size)):
    prompt = tokenizer.encode(problem.prompt, add_bos=True)
    answer = tokenizer.encode(task.demonstration(problem, rng, digit_noise=digit_noise)) + [tokenizer.eos_id]
    row = (prompt + answer)[:seq_len]
    tokens[i, :len(row)] = row
    mask[i, len(prompt) - 1:len(row) - 1] = 1.0
  return {"tokens": tokens, "mask": mask}


def run(graphdef, params, task, tokenizer, cfg, *, seq_len: int, seed: int):
  """Trains `params` for `cfg.steps` (>= 1) steps; returns (params, final loss)."""
  warm = max(1, cfg.steps // 20)
  sched = optax.warmup_cosine_decay_schedule(cfg.lr / (warm + 1), cfg.lr, warm, max(cfg.steps, warm + 1), cfg.lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(batch["tokens"][:, :-1])  # [B, T-1, V]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
      return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng([seed, 7])
  loss = None
  for i in range(cfg.steps):
    noise = cfg.digit_noise if i >= cfg.steps - cfg.noisy_steps else 0.0
    batch = demo_batch(task, tokenizer, rng, batch_size=cfg.batch_size, seq_len=seq_len,
                       digit_noise=noise)
    params, opt_state, loss = step(params, opt_state, batch)
  return params, float(loss)
