"""The embedded default: OAPL on multi-digit addition with a tiny Qwen3-style model, on CPU.

The run: supervised warm-up on noisy demonstrations (the base model, pass@1 ~ 0.3-0.45)
-> eval before -> OAPL training in sync mode -> eval after. A few minutes on 2 CPU cores.

  python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/oapl_tiny
  python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/oapl_tiny_s3 \
      --config.seed=3 --config.rl.lag=10
  python -m oapl_jax.main --config=configs/tiny.py:smoke --workdir=/tmp/oapl_smoke  # seconds; CI

Variants through the arg string: `smoke` (a few steps, for tests and CI).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds everything: init, data order, sampling. Same seed -> same run.

  c.task = ml_collections.ConfigDict()
  c.task.name = "addition"  # Embedded procedural task (oapl_jax/tasks/arithmetic.py).
  c.task.min_digits = 2  # Fewest digits per operand.
  c.task.max_digits = 2  # Most digits per operand.
  c.task.num_eval = 128  # Held-out problems (never drawn for training).

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 32  # Embedding rows; must be >= the tokenizer's vocabulary (18).
  c.model.hidden_size = 128  # Residual stream width.
  c.model.num_layers = 2  # Transformer blocks.
  c.model.num_heads = 4  # Query heads.
  c.model.num_kv_heads = 2  # Key/value heads (grouped-query attention).
  c.model.head_dim = 32  # Per-head width.
  c.model.mlp_dim = 384  # SwiGLU hidden width.
  c.model.rope_theta = 10000.0  # RoPE base.
  c.model.rope_scaling_type = ml_collections.config_dict.placeholder(str)  # None or "llama3" (Llama-3.x long-context frequency scaling).
  c.model.rope_scaling_factor = 1.0  # llama3 scaling: factor.
  c.model.rope_low_freq_factor = 1.0  # llama3 scaling: low_freq_factor.
  c.model.rope_high_freq_factor = 4.0  # llama3 scaling: high_freq_factor.
  c.model.rope_original_max_len = 8192  # llama3 scaling: original_max_position_embeddings.
  c.model.max_position_embeddings = ml_collections.config_dict.placeholder(int)  # Recorded for HF export only; not enforced.
  c.model.rms_norm_eps = 1e-6  # RMSNorm epsilon.
  c.model.qk_norm = True  # Qwen3 QK-norm.
  c.model.qkv_bias = False  # Qwen2-style bias on q/k/v.
  c.model.tie_embeddings = True  # LM head shares the embedding matrix.
  c.model.param_dtype = "float32"  # Weight storage dtype.
  c.model.dtype = "float32"  # Matmul dtype (logits and softmax are always float32).

  c.warmup = ml_collections.ConfigDict()
  c.warmup.steps = 800  # Supervised steps that make the base model (clean, then noisy demos).
  c.warmup.noisy_steps = 200  # The last this many steps use noisy demonstrations.
  c.warmup.batch_size = 128  # Demonstrations per step.
  c.warmup.lr = 1e-2  # AdamW peak learning rate (cosine decay, 5% linear warm-up).
  c.warmup.digit_noise = 0.3  # In noisy demos, chance each answer digit is replaced by a wrong one.

  c.sampling = ml_collections.ConfigDict()
  c.sampling.temperature = 1.0  # Logits are divided by this before sampling (> 0).
  c.sampling.top_p = 1.0  # Nucleus sampling mass in (0, 1]; 1 = off.
  c.sampling.top_k = 0  # Keep the k most likely tokens; 0 = off.
  c.sampling.max_prompt_len = 16  # Longest prompt in tokens (prefill buffer).
  c.sampling.max_new_tokens = 8  # Answer length limit in tokens (EOS included).
  c.sampling.max_slots = 128  # Engine decode slots (answers decoded concurrently).

  c.rl = ml_collections.ConfigDict()
  c.rl.loss = "oapl"  # Loss name in oapl_jax.rl.losses.LOSSES.
  c.rl.beta1 = 1.0  # Temperature of V_hat = beta1 * log mean exp(R / beta1).
  c.rl.beta2 = 0.1  # Weight on the summed log-ratio in (beta2 * ell - A)^2 (paper: 1e-3; see README).
  c.rl.group_size = 8  # G: answers sampled per prompt.
  c.rl.lag = 10  # L: trainer steps between engine refreshes (pi_old <- pi_theta).
  c.rl.old_logprobs = "sampler"  # log pi_old from: "sampler" (engine) or "snapshot" (recomputed).
  c.rl.count_truncated = True  # Answers cut at max_new_tokens still count in the loss.
  c.rl.groups_per_step = 16  # Groups (prompts) in one trainer step's batch.
  c.rl.groups_per_rollout = 32  # Groups the engine samples into the buffer per call.
  c.rl.mode = "sync"  # Only "sync" exists so far: sample into the buffer, then train.

  c.train = ml_collections.ConfigDict()
  c.train.steps = 300  # OAPL trainer (optimizer) steps.
  c.train.lr = 3e-4  # AdamW peak learning rate.
  c.train.warmup_ratio = 0.02  # Fraction of steps of linear lr warm-up.
  c.train.min_lr_ratio = 0.05  # Cosine decay floor as a fraction of lr.
  c.train.b1 = 0.9  # AdamW beta1.
  c.train.b2 = 0.95  # AdamW beta2.
  c.train.eps = 1e-10  # AdamW epsilon.
  c.train.weight_decay = 0.0  # AdamW decoupled weight decay.
  c.train.grad_clip = 1.0  # Global gradient-norm clip.
  c.train.grad_accum = 1  # Micro-batches per step (must divide rl.groups_per_step).

  c.eval = ml_collections.ConfigDict()
  c.eval.samples_per_problem = 16  # n answers per held-out problem for pass@k (k = 1, 2, 4, ... n).
  c.eval.every = 0  # Also evaluate every this many trainer steps; 0 = before and after only.

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # Save the train state every this many trainer steps (and at the end).
  c.checkpoint.keep = 2  # Most recent checkpoints kept.

  c.log = ml_collections.ConfigDict()
  c.log.every = 1  # Write metrics every this many trainer steps.
  c.log.progress = True  # Show a progress bar (step, reward, speed).

  if arg == "smoke":
    c.warmup.steps = 30
    c.warmup.noisy_steps = 10
    c.task.num_eval = 8
    c.eval.samples_per_problem = 4
    c.train.steps = 6
    c.rl.lag = 3
    c.rl.groups_per_step = 4
    c.rl.groups_per_rollout = 6
    c.sampling.max_slots = 32
    c.checkpoint.every = 2
  elif arg:
    raise ValueError(f"configs/tiny.py: unknown variant {arg!r} (known: smoke)")
  return c
