"""Config defaults shared by every config file, and validation of a finished config.

`defaults(preset)` holds every setting with a comment and the paper's values where the paper
gives them (docs/algorithm.md); `configs/*.py` start from it and override what their run needs, reading
their arg string with `parse_arg` and starting their task section with `task_section`.
`validate(c)` refuses bad settings, naming them, before any work starts.
"""

from __future__ import annotations

import math
import numbers
import os

import ml_collections
from ml_collections.config_dict import placeholder

from oapl_jax.envs.registry import ENVS  # environment names -> builders: no JAX
from oapl_jax.errors import ConfigError
from oapl_jax.models.names import BASE_QUANTS, LOGICAL_AXES, LORA_TARGETS, ROPE_SCALING_TYPES, dtype_name
from oapl_jax.models.pallas_names import ATTENTION_KERNELS  # names only: no JAX
from oapl_jax.models.presets import PRESETS  # names and numbers only: no JAX, no Flax
from oapl_jax.rl.names import ADV_NORMS, BETA2_RULES, GRPO_PROX, IS_LEVELS, IS_MODES, LOSS_NAMES, NORMS
from oapl_jax.tasks.hf_tokenizer import folder_problem as tokenizer_folder_problem  # os, json only
from oapl_jax.tasks.registry import TASKS  # task names -> builders: no JAX either
from oapl_jax.topology import LOCAL, MESH_AXES, TOPOLOGIES  # names and numbers: no JAX either

# Config files import this module and must not import JAX or Flax (a launcher, a notebook cell
# or a test may read a config without them): every name a setting is checked against comes
# from a JAX-free leaf (errors, topology, models.names / presets, rl.names, tasks.registry).


def defaults(model_preset: str) -> ml_collections.ConfigDict:
  """All settings but `task` (each config file defines its own task section)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds everything: init, data order, sampling. Same seed -> same run.

  c.model = ml_collections.ConfigDict()
  c.model.path = placeholder(str)  # Local HF checkpoint folder; None = random init from the fields below.
  c.model.preset = model_preset  # Name in oapl_jax.models.presets the architecture fields came from.
  # Architecture fields (meanings: oapl_jax.models.ModelConfig). With model.path they must match
  # the checkpoint's config.json, so a checkpoint of another model is refused.
  c.model.update(PRESETS[model_preset])
  for name, kind in (("rope_scaling_type", str), ("max_position_embeddings", int)):
    if c.model.get(name) is None:
      c.model[name] = placeholder(kind)
  # Mixed precision: the trainer keeps master weights and AdamW's state in param_dtype and
  # computes in dtype; the engines' snapshot pi_old is a dtype copy. Real runs: float32 / bfloat16
  # (bfloat16 master weights lose updates at lr 1e-6: most steps round back to the same value).
  c.model.param_dtype = "float32"  # Master weight dtype: "float32", "bfloat16" or "float16".
  c.model.dtype = "float32"  # Compute dtype of matmuls and of the engines' weights (log-softmax always float32).
  # Attention code (oapl_jax/models/pallas_names.py): "auto" = the Pallas TPU kernels (splash
  # attention in the trainer, a Pallas decode kernel in the engine) when the model runs on TPUs,
  # else the blockwise XLA code; "xla"; "pallas" (set it to compile for TPU ahead of time on a
  # CPU host, whose devices "auto" would read as CPU); "pallas_interpret" (CPU tests, slow).
  c.model.attention_kernel = "auto"
  # Low-rank adapters (oapl_jax/models/lora.py, Flax NNX's nnx.LoRA): rank > 0 trains only an
  # adapter beside each targeted projection (x W + alpha/rank x A B; B starts at zero); the base
  # is frozen and held in model.dtype, the adapters and their AdamW state in model.param_dtype;
  # pi_old is a copy of the adapters, which the engines see merged into the base. Checkpoints
  # hold the adapters and the base's model.path and sha256 (another base is refused); in remote
  # mode the published snapshots are the adapters too, merged by each sampler job into its base.
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # Adapter rank r; 0 = full fine-tuning (every weight trained).
  c.model.lora.alpha = 32.0  # Scale alpha: the adapter's output is multiplied by alpha / rank.
  c.model.lora.targets = LORA_TARGETS  # Adapted projections: any of q/k/v/o_proj, gate/up/down_proj.
  # A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, as peft's
  # save_pretrained or oapl_jax.export write it) trained on the same base: the run's adapters
  # start from it instead of A random, B zero. Its r, lora_alpha and target_modules must equal
  # rank, alpha and targets, its tensors this base's shapes; a mismatch stops the run in one line.
  # Read at the start only (a resume reads its checkpoint). None = the usual init.
  c.model.lora.init_from = placeholder(str)
  # Also refuse init_from when its base_model_name_or_path and model.path end in different names
  # (a Hub id "Qwen/Qwen3-0.6B" and "/data/Qwen3-0.6B" agree); False for the same base renamed.
  c.model.lora.init_from_check_name = True
  # Where the engines' weights (the base merged with pi_old's adapters) are made at a refresh:
  # "kept": merged into a base-sized model.dtype copy on the trainer's devices, kept until the
  # next refresh, then laid out for the engines from it; "in_refresh": merged layer by layer
  # inside the engines' re-layout (one layer's merge in transit), no standing merged copy: one
  # base-sized copy less per trainer device (Qwen3-4B: 7.5 GiB), the same weights bit for bit.
  # The engines' own copy is there in both (docs/real_model.md "Low-rank adapters").
  c.model.lora.merge = "kept"
  # How a LoRA run holds its frozen base (oapl_jax/models/quant.py): "none" = in model.dtype;
  # "int8" = the block projections as int8 with a float32 scale per output channel (QLoRA-style;
  # the embedding, head and norms stay in model.dtype): about half a bf16 base's bytes on the
  # trainer. Both the trainer and the engines use the same dequantised base (the engines sample
  # from it merged with the adapters, in model.dtype). Needs model.lora.rank > 0.
  c.model.base_quant = "none"
  c.model.exact_rounding = True  # Round to model.dtype wherever the program says, in the train step and the engines (XLA may otherwise keep float32 there, by shape: bfloat16 log-probs then depend on the batch; docs/design.md "Engine/trainer parity in bfloat16"). False: XLA's default (faster on CPU/GPU).

  # The device mesh of the trainer: axes ("data", "fsdp", "tensor"); their product is the number
  # of devices the trainer uses (all of them: at most one axis is -1 = all remaining devices).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Pure data parallelism: weights replicated, batch rows split.
  c.mesh.fsdp = -1  # ZeRO-3: weights, gradients and AdamW state split over "embed"; batch rows split.
  c.mesh.tensor = 1  # Megatron tensor parallelism: heads, MLP width and vocabulary split.
  # Named device topology for the memory planner and --dry_run (oapl_jax/topology.py TOPOLOGIES,
  # e.g. "v5p-64", "v5e-64", "v4-32", "h100x8", "v5e-1", "l4x1"); None or "auto" = the devices
  # this process finds: their kind, count and memory (memory_stats; none on CPU: not checked).
  c.mesh.topology = placeholder(str)

  c.sharding = ml_collections.ConfigDict()  # How weights lie on a device mesh (oapl_jax/sharding.py).
  # (logical axis, mesh axes) pairs: each weight dimension's logical axis (models.names.
  # LOGICAL_AXES, each needs a rule) -> a mesh axis of ("data", "fsdp", "tensor"), a tuple of
  # them (split over their product) or None (replicated). A sharded dimension must divide over
  # its mesh axes. Reference: MaxText's configs/base.yml logical_axis_rules.
  c.sharding.rules = (
      # Vocabulary V of the embedding and LM head, split over every model-parallel device and
      # their hidden size E ("vocab_embed") kept whole: the head's [tile, V] logits and its
      # gradient stay vocab-parallel, and no device gathers the [V, E] table in float32, which
      # on Qwen3-0.6B (V = 151,936) was half of a train step's scratch (docs/memory.md).
      # MaxText splits V over tensor and E over fsdp; that layout is ("vocab", "tensor"),
      # ("vocab_embed", "fsdp"). V must divide over tensor x fsdp.
      ("vocab", ("tensor", "fsdp")),
      ("vocab_embed", None),
      ("embed", "fsdp"),  # Hidden size E of every matrix: ZeRO-3, gathered per layer (MaxText: fsdp).
      ("mlp", "tensor"),  # MLP width F: gate/up columns, down rows (Megatron; MaxText: tensor).
      ("q_heads", "tensor"),  # Query heads N of q_proj, o_proj, q_bias (MaxText: tensor).
      ("kv_heads", "tensor"),  # Key/value heads K of k/v_proj, k/v_bias; K must divide (MaxText: tensor).
      ("head_dim", None),  # Head width D, and the QK-norm weights [D]: replicated (MaxText: kv -> none).
      ("norm", None),  # Hidden-size RMSNorm weights [E]: replicated, E floats (MaxText: tensor).
      ("batch", ("data", "fsdp")),  # Batch rows of a train step's activations (MaxText: data x fsdp).
  )

  c.warmup = ml_collections.ConfigDict()  # Supervised warm-up (the embedded tasks: addition, chain_addition).
  c.warmup.steps = 0  # Supervised steps that make the base model (clean, then noisy demos); 0 = none.
  c.warmup.noisy_steps = 0  # The last this many warm-up steps use noisy demonstrations.
  c.warmup.batch_size = 128  # Demonstrations per step.
  c.warmup.lr = 1e-2  # AdamW peak learning rate (cosine decay, 5% linear warm-up).
  c.warmup.digit_noise = 0.3  # In noisy demos, chance each answer digit is replaced by a wrong one (chain_addition: each carry is dropped).
  # Folder caching warmed-up base models, keyed by seed + model + task + warm-up settings, so
  # runs that differ only in RL settings (a study's methods and lags) share one base, and its
  # "eval before" (cached beside it, keyed by the eval and sampling settings too); runs that need
  # the same uncached base at once build it once (the others wait on its lock); None = off.
  c.warmup.cache_dir = placeholder(str)
  # True: the base must already be in warmup.cache_dir (e.g. committed bases a study goes on
  # from: a base depends on the CPU it was built on); it is read, never built, and a missing one
  # is an error naming the folder looked in. Not part of the base's key.
  c.warmup.cached_only = False

  c.sampling = ml_collections.ConfigDict()
  c.sampling.temperature = 1.0  # Logits are divided by this before sampling (> 0).
  c.sampling.top_p = 1.0  # Nucleus sampling mass in (0, 1]; 1 = off.
  c.sampling.top_k = 0  # Keep the k most likely tokens; 0 = off.
  c.sampling.max_prompt_len = 4096  # Longest prompt in tokens (prefill buffer); longer prompts are an error.
  c.sampling.max_new_tokens = 8192  # Answer length limit in tokens (EOS included).
  c.sampling.max_slots = 64  # Decode slots in total (answers decoded concurrently), split evenly over the engines.
  c.sampling.engines = 1  # Engine replicas over all processes (the engines' data axis; each process runs engines / processes of them: oapl_jax/placement.py), each on its own sampling.tensor devices; prompts split over them (on CPU: a host device each; docs/design.md "Sampling engine").
  c.sampling.tensor = 1  # Devices per engine replica: a "tensor" sub-mesh (weights over heads/MLP/vocab, KV cache over KV heads).
  c.sampling.steps_per_call = 32  # Decode steps per jitted engine call (fewer host round trips).
  c.sampling.attn_chunk = 1024  # Decode attention reads the KV cache in chunks of this many positions.
  c.sampling.cache_bucket = 64  # KV cache grows in power-of-two multiples of this (one compile each); on TPU a multiple of 128 (configs/math.py: docs/memory.md).
  c.sampling.max_prefill_batch = 8  # Prompts prefilled together in one call.
  c.sampling.min_decode_width = 8  # Once no prompt waits, decoding narrows (halving) down to this many slots; >= max_slots: off.
  # Sync mode: the engines let go of their weights (pi_old laid out for them; under model.lora the
  # merged copy too) after each rollout and lay them out again for the next, so no engine copy is
  # held while the trainer steps: one model-sized copy less at a shared device's peak, for one
  # re-layout per rollout instead of per pi_old version. The same weights bit for bit.
  c.sampling.release_weights = False

  c.rl = ml_collections.ConfigDict()
  c.rl.loss = "oapl"  # Loss name: oapl_jax.rl.names.LOSS_NAMES (registered in rl/losses.py).
  c.rl.beta1 = 1.0  # Temperature of V_hat = beta1 * log mean exp(R / beta1) (paper: 1).
  c.rl.beta2 = 1e-3  # Weight on the summed log-ratio in (beta2 * ell - A)^2 (paper: 1e-3), under rl.beta2_rule="fixed".
  # How beta2 is set (docs/algorithm.md "Reachable targets"): an answer's target is
  # (R - V_hat) / beta2 nats of summed log-ratio, and a correct answer can gain at most
  # -log pi_old(answer) (metric target_out_of_reach counts those asked for more). "fixed":
  # rl.beta2. "tied": beta2 = rl.beta1, the targets are the KL-optimal policy's log-ratios,
  # reachable by construction. "per_token": beta2 = rl.beta2_per_token / sampling.max_new_tokens,
  # the paper's targets per token at this run's answer cap.
  c.rl.beta2_rule = "fixed"
  c.rl.beta2_per_token = 16.384  # The "per_token" rule's numerator: the paper's 1e-3 x its 16,384-token cap.
  c.rl.group_size = 8  # G: answers sampled per prompt (paper: 8).
  c.rl.lag = 50  # L: trainer steps between engine refreshes, pi_old <- pi_theta (paper, math: 50).
  c.rl.old_logprobs = "sampler"  # log pi_old from: "sampler" (engine) or "snapshot" (recomputed).
  c.rl.count_truncated = True  # Answers cut at max_new_tokens still count in the loss.
  c.rl.groups_per_step = 32  # Groups (prompts) in one trainer step's batch.
  c.rl.groups_per_rollout = 32  # Groups the engine samples into the buffer per call.
  # Window rollouts (sync mode): sample this many steps' rollouts in one continuous batch, slots
  # refilled as answers end across all of them, the rest held in the host buffer for the next
  # steps. Same answers, counts and losses as 1 (each rollout's problems and keys are its own);
  # fewer idle slots when answer lengths spread (docs/performance.md "Window rollouts"). Must
  # divide rl.lag; needs groups_per_rollout == groups_per_step. Host bytes: the plan's "host".
  c.rl.window_rollouts = 1
  # Groups whose realised lag (trainer step - snapshot step) would exceed this are dropped when a
  # step takes its batch, and counted (groups_dropped_stale); >= rl.lag, so it only bites in async
  # mode, where left-overs and rollouts in flight outlive a refresh. None = never drop (docs/design.md "Asynchronous mode":
  # stale samples are used).
  c.rl.max_lag = placeholder(int)
  c.rl.mode = "sync"  # "sync": sample when the buffer runs short, then train. "async": the next rollout samples (engines on devices 1..N) while the trainer trains on device 0; OAPL with old_logprobs="sampler" only (docs/design.md "Asynchronous mode"). "offline": rounds of stored answers (rl.offline), then sync. "remote": rollouts from sampler jobs beside the trainer (rl.remote, python -m oapl_jax.sample).
  # Offline mode (rl.mode="offline"; docs/offline.md, oapl_jax/rl/offline.py): a round is
  # one file of G answers per problem sampled by pi_old at the round's start, trained on for
  # rl.offline.epochs passes (pi_old fixed: the round's length is its lag); after the rounds
  # the rest of train.steps trains online in sync mode (a refresh every rl.lag steps).
  c.rl.offline = ml_collections.ConfigDict()
  c.rl.offline.path = placeholder(str)  # Round 1's file, from `python -m oapl_jax.generate` with this run's config (its base); None = the run samples round 1 itself.
  c.rl.offline.problems = 256  # Training problems (groups) a round answers when round 1 is sampled here or by generate; later rounds answer round 1's problems.
  c.rl.offline.rounds = 2  # Rounds; round r > 1 is sampled by the run from the policy round r - 1 ended with (paper, code: 2).
  c.rl.offline.epochs = 4  # Passes over a round's file (paper, code: 4); a round is epochs x (its groups // rl.groups_per_step) steps.
  c.rl.offline.check_rows = 16  # Answers of each file rescored with pi_old by the trainer's kernel before training on it.
  c.rl.offline.logprob_tol = 0.05  # Refuse a file whose stored log-probs differ from the rescored ones by more than this (mean nats per token over the rescored answers; float32 ~1e-6; bfloat16 measured <= 8e-3 on a 4-layer width-512 model with 200-token answers: docs/design.md "Engine/trainer parity in bfloat16").
  # Remote mode (rl.mode="remote"; docs/remote.md, oapl_jax/rl/remote.py): sampler jobs
  # (`python -m oapl_jax.sample`, same config and --workdir, on devices of their own) sample
  # rollouts into <workdir>/remote/ with the pi_old this trainer publishes at each refresh.
  c.rl.remote = ml_collections.ConfigDict()
  c.rl.remote.reproducible = False  # True: rollout i is sampled by pi_old version i // rl.lag (what sync mode uses), so the run is the sync run bit for bit; needs groups_per_rollout == groups_per_step. False: by the newest snapshot (stale rollouts used with their stamps, or dropped past rl.max_lag).
  c.rl.remote.ahead = 4  # Rollouts a sampler job may sample beyond the trainer's next one (the samplers' queue).
  # A sampler job renews its claim on the rollout it samples every claim_timeout_s / 5 seconds; a
  # claim not renewed for this long is a dead sampler's (killed, preempted, cut off) and another
  # sampler takes it over (on the claim's own host at once, once its process is gone). So this
  # bounds the trainer's wait for a dead sampler's rollout, not how long a rollout may take to
  # sample. 300: a dead sampler on another host costs at most 5 minutes; a live one paused (GC,
  # a slow bucket) for that long at worst has its rollout sampled twice (the trainer reads one).
  c.rl.remote.claim_timeout_s = 300.0
  c.rl.remote.keep_snapshots = 2  # Published pi_old versions kept (newest first); older ones are removed.
  c.rl.remote.max_rejections = 3  # A rollout whose file is refused this many times (damaged, another run's, log-probs not pi_old's: rl.offline.check_rows of each sampler's first file of a version are rescored) stops the run in one line.
  c.rl.remote.poll_s = 0.5  # Seconds between looks for a file (trainer and samplers).
  c.rl.remote.say_every_s = 30.0  # Longest gap between the trainer's "waiting for rollout" lines (the first is at once).
  # The baseline, selected with rl.loss = "grpo" (docs/algorithm.md; losses.grpo). Same loop, buffer and
  # lag; IS corrects from the engine's log-probs to pi_prox. rl.beta1/beta2/old_logprobs are OAPL-only.
  c.rl.grpo = ml_collections.ConfigDict()
  # pi_prox, what PPO's ratio pi_theta / pi_prox is taken against: "snapshot" (the trainer's
  # log-probs on the engine's weights: PPO-clip anchored on the sampler, the IS weight only the
  # engine/trainer mismatch) or "previous_step" (the trainer's weights as the step starts, the
  # asynchronous GRPO + truncated IS that the paper's "100x more off-policy" compares with: the
  # ratio is 1 at every step's start and the IS weight pi_prox / pi_sampler carries the lag).
  c.rl.grpo.prox = "snapshot"
  c.rl.grpo.adv_norm = "std"  # "std": (R - mean) / (std + eps) (GRPO); "none": R - mean (Dr.GRPO).
  c.rl.grpo.adv_eps = 1e-6  # eps added to the group's std.
  c.rl.grpo.eps_low = 0.2  # PPO clip: ratio >= 1 - eps_low.
  c.rl.grpo.eps_high = 0.28  # PPO clip: ratio <= 1 + eps_high; > eps_low is "clip-higher" (DAPO).
  c.rl.grpo.is_level = "token"  # IS weight pi_prox / pi_sampler per "token" or per "sequence".
  c.rl.grpo.is_mode = "truncate"  # "truncate": min(w, C) (TIS); "mask": drop if w outside [1/C, C]; "none".
  c.rl.grpo.is_cap = 2.0  # C, the IS cap.
  c.rl.grpo.norm = "token_mean"  # "token_mean", "seq_mean", or "constant" (Dr.GRPO: / (B * max_new_tokens)).
  c.rl.grpo.kl_coef = 0.0  # Weight of a k3 KL penalty to the reference (the base weights RL starts from); 0 = off.

  c.train = ml_collections.ConfigDict()
  c.train.steps = 500  # OAPL trainer (optimizer) steps.
  c.train.lr = 1e-6  # AdamW peak learning rate (paper: 1e-6).
  c.train.warmup_ratio = 0.02  # Fraction of steps of linear lr warm-up (paper: 2%).
  c.train.min_lr_ratio = 0.05  # Cosine decay floor as a fraction of lr (paper: 0.05).
  c.train.b1 = 0.9  # AdamW beta1 (paper: 0.9).
  c.train.b2 = 0.95  # AdamW beta2 (paper: 0.95).
  c.train.eps = 1e-10  # AdamW epsilon (paper: 1e-10).
  c.train.weight_decay = 0.0  # AdamW decoupled weight decay (paper: ~0).
  c.train.grad_clip = 1.0  # Global gradient-norm clip (paper: 1.0).
  c.train.grad_accum = 1  # Micro-batches per step (must divide rl.groups_per_step).
  # Activation memory of the train step (oapl_jax/plan.py estimates it for each choice):
  c.train.remat = "none"  # Per transformer block: "none" (keep activations), "dots" (keep matmul outputs only), "full" (recompute the block).
  c.train.attn_block = 512  # Blockwise attention: query/key block length (online softmax; causal blocks above the diagonal skipped). CPU, 2k-token answers: 256 ran 12% faster (docs/performance.md, "Train-step speed").
  c.train.logprob_tile = 512  # Log-prob kernel: tokens per tile of [tile, V] logits (LM head inside the tile; no [B, T, V] tensor).
  # Packed rows (oapl_jax/rl/packing.py, docs/performance.md "Packed rows"): the step's answers, each with its prompt,
  # back to back in rows of pack_budget tokens (first-fit decreasing), attention within each; a step runs as many
  # micro-batches of pack_rows rows as its answers fill (the worst case compiled, the rest skipped); multi-host:
  # each process packs its own answers into its pack_rows / processes rows of each micro-batch.
  c.train.packing = False  # True: train on packed rows; False: one answer per row, padded to seq_len.
  c.train.pack_rows = 0  # Packed rows per micro-batch; 0 = a padded micro-batch's rows (rl.groups_per_step x rl.group_size / train.grad_accum).
  c.train.pack_budget = 0  # Tokens per packed row (>= max_prompt_len + max_new_tokens); 0 = exactly that.
  # A step whose loss or grad norm is not finite is skipped (params and optimizer unchanged);
  # this many in a row stop the run with an error.
  c.train.max_nonfinite_steps = 3

  c.eval = ml_collections.ConfigDict()
  c.eval.samples_per_problem = 16  # n answers per held-out problem for pass@k (k = 1, 2, 4, ... n).
  c.eval.every = 0  # Also evaluate every this many trainer steps; 0 = before and after only.

  # Multi-turn environment (oapl_jax/envs/, docs/agents.md): tools the model may call between
  # its turns. Built: the interface, the calculator, the sandboxed Python tool ("python"), stored
  # traces (python -m oapl_jax.import_traces); not yet: the engine pausing a slot on a tool call,
  # so runs still sample single answers.
  c.env = ml_collections.ConfigDict()
  c.env.name = placeholder(str)  # Environment in oapl_jax.envs.ENVS (e.g. "calculator", "python"); None = single-turn answers.
  c.env.max_turns = 4  # Model turns per episode; the episode ends at the last whatever it holds.
  c.env.tool_timeout_s = 5.0  # Wall-clock seconds per tool call; a tool still running is killed and the model told so.
  c.env.tool_output_chars = 2000  # Characters of a tool's output the model sees; the rest is cut and the model told so.
  # Tokens of one environment turn (tool results and the chat template's markup around them); a
  # longer turn ends its trajectory at the length limit (counted: env_turns_cut). It sizes the
  # engines' buffer of tokens waiting to enter a paused slot's KV cache ([slots, this] int32).
  c.env.max_env_tokens = 1024
  c.env.workers = 8  # Environment turns (tool calls) run at once per engine replica, in threads beside decoding.
  c.env.sandbox_memory_mb = 512  # Address-space limit (MiB) of a program a sandboxed tool runs (env "python").
  # Env "python" where bubblewrap is missing: True runs the model's programs with rlimits only (NOT
  # safe: they can use the network and the caller's files); False: each call is refused, the model told so.
  c.env.allow_unsandboxed = False

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # Save the train state every this many trainer steps (and at the end).
  c.checkpoint.keep = 2  # Most recent checkpoints kept.
  c.checkpoint.directory = placeholder(str)  # Where checkpoints go; None = <workdir>/checkpoints (a gs:// workdir: in the bucket, through orbax). Not a gcsfuse mount: it cannot take orbax's directory renames.
  c.checkpoint.lock_lease_s = 300.0  # The workdir lock (run.lock) is a lease renewed every lease/10 s; one not renewed for this long is taken over from any host (a preempted slice's run resumes).
  c.checkpoint.lock_wait_s = 0.0  # A lock that looks alive is waited for this long (its lease may run out) before the run is refused; a scheduler that restarts a preempted job at once (GKE/xpk) sets it above lock_lease_s.

  # Multi-host runs (oapl_jax/distributed.py; docs/scaling.md "Multi-host runs"): the same command on every
  # process. All three of coordinator_address / num_processes / process_id, or none (then the
  # environment's JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else JAX's own
  # detection of a TPU pod or SLURM job, else one process).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = placeholder(str)  # "host:port" of process 0's coordinator.
  c.distributed.num_processes = placeholder(int)  # Processes in the run (hosts of a pod).
  c.distributed.process_id = placeholder(int)  # This process's index, 0 .. num_processes - 1.
  c.distributed.initialization_timeout = 300  # Seconds to wait for every process to join.

  c.log = ml_collections.ConfigDict()
  c.log.every = 1  # Write metrics every this many trainer steps.
  c.log.progress = True  # Show a progress bar (step, reward, speed).
  c.log.dead_model_steps = 20  # Warn (one line) once the gradient norm has been 0, or the entropy ln(model.vocab_size) (a uniform policy), this many steps in a row: weights that stopped learning (e.g. too high a train.lr); 0 = never.
  c.log.peak_flops = placeholder(float)  # One device's peak FLOP/s for the logged MFU (oapl_jax/timing.py); None: the published dense bf16 figure of a known TPU / GPU (topology.CHIPS); a CPU or another chip logs no MFU, only flops_per_s_per_device.
  c.log.profile_steps = placeholder(str)  # "a:b": write a jax.profiler trace of trainer steps a..b (1-based, inclusive) into <workdir>/profile (TensorBoard's profile plugin, XProf, Perfetto); None: no trace.
  c.log.tensorboard = True  # Also write TensorBoard scalars (events.out.* in the workdir; a gs:// workdir through tf.io.gfile).
  return c

def from_file(spec: str) -> ml_collections.ConfigDict:
  """The config of `path/to/config.py[:arg]`, as `--config=` would read it (unlocked).

  For notebooks and scripts: `c = from_file("configs/tiny.py:smoke"); c.rl.lag = 20`.
  """
  import importlib.util
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location(
      "_oapl_config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def from_flag(holder) -> ml_collections.ConfigDict:
  """The config of a `config_flags.DEFINE_config_file` flag (after absl parsed the flags); a
  config file that does not exist is a ConfigError (ml_collections would defer it)."""
  from absl import flags  # noqa: PLC0415 (absl only for the commands)
  from ml_collections import config_flags  # noqa: PLC0415
  spec = config_flags.get_config_filename(flags.FLAGS[holder.name])
  if not os.path.isfile(spec.partition(":")[0]):
    raise ConfigError(f"--{holder.name}={spec}: no such file")
  config = holder.value
  _nones(config)
  return config


def command_config(holder, *, dry_run: bool = False) -> ml_collections.ConfigDict:
  """A command's validated config (`from_flag`, then `validate`, before JAX starts or a workdir
  is touched), absl's logging kept to warnings unless --verbosity was given (orbax logs every
  save at INFO)."""
  from absl import flags, logging  # noqa: PLC0415 (absl only for the commands)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = from_flag(holder)
  validate(config, dry_run=dry_run)
  return config


def _nones(c: ml_collections.ConfigDict) -> None:
  """`--config.x=None` reaches a string setting as the string 'None': no setting means that
  string, so it becomes None (the setting's default-off value, or a clear refusal from
  `validate` where None is not allowed)."""
  for key, value in c.items():
    if isinstance(value, ml_collections.ConfigDict):
      _nones(value)
    elif isinstance(value, str) and value == "None":
      c[key] = None


def repo_config(name: str) -> ml_collections.ConfigDict:
  """A config of this repository's `configs/` folder by name, e.g. `repo_config("tiny.py:smoke")`."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return from_file(os.path.join(root, "configs", name))


OLD_LOGPROB_SOURCES = ("sampler", "snapshot")
MODES = ("sync", "async", "offline", "remote")
REMAT_POLICIES = ("none", "dots", "full")  # train.remat


def _check(ok: bool, setting: str, value, why: str):
  if not ok:
    raise ConfigError(f"config.{setting}={value!r}: {why}")


def _get(c, setting: str):
  """The value of dotted `setting` ("rl.grpo.is_cap") in config `c`."""
  for part in setting.split("."):
    c = c[part]
  return c


def _bound(c, bound) -> tuple:
  """(value, text) of a range end: a number, or another setting's name ("warmup.steps")."""
  if isinstance(bound, str):
    value = _get(c, bound)
    return value, f"{bound}={value}"
  return bound, str(bound)


def _range_ok(value, c, lo, hi, lo_open: bool, hi_open: bool) -> bool:
  """Whether `value` lies between `lo` and `hi` (None = unbounded; open or closed ends)."""
  lo_v, hi_v = (None if b is None else _bound(c, b)[0] for b in (lo, hi))
  return ((lo_v is None or (value > lo_v if lo_open else value >= lo_v)) and
          (hi_v is None or (value < hi_v if hi_open else value <= hi_v)))


def _range_text(c, lo, hi, lo_open: bool, hi_open: bool) -> str:
  """">= 1", "> 0", "in [0, 1)", "in [0, warmup.steps=30]"."""
  lo_t, hi_t = (None if b is None else _bound(c, b)[1] for b in (lo, hi))
  if hi is None:
    return f"{'>' if lo_open else '>='} {lo_t}"
  if lo is None:
    return f"{'<' if hi_open else '<='} {hi_t}"
  return f"in {'(' if lo_open else '['}{lo_t}, {hi_t}{')' if hi_open else ']'}"


def _note(note: str) -> str:
  return f" ({note})" if note else ""


def profile_range(text) -> tuple[int, int] | None:
  """`log.profile_steps` "a:b" as (a, b) with 1 <= a <= b, or None if it is not one."""
  try:
    a, b = (int(x) for x in str(text).split(":"))
  except ValueError:
    return None
  return (a, b) if 1 <= a <= b else None


def _number(c, setting: str, lo=None, hi=None, *, lo_open=False, hi_open=False, note=""):
  """Refuses a non-number (a bool too), nan, +-inf, or a value outside lo..hi (a bound is a
  number or another setting's name; open ends with lo_open / hi_open)."""
  v = _get(c, setting)
  ok = (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        and _range_ok(v, c, lo, hi, lo_open, hi_open))
  _check(ok, setting, v, f"must be finite and {_range_text(c, lo, hi, lo_open, hi_open)}{_note(note)}")


def _int(c, setting: str, lo=None, hi=None, *, optional=False, note=""):
  """Refuses a non-int (a bool or a float too) or one outside [lo, hi]; None too unless optional."""
  v = _get(c, setting)
  if optional and v is None:
    return
  ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and _range_ok(v, c, lo, hi, False, False)
  what = "None or an int" if optional else "an int"
  _check(ok, setting, v, f"must be {what} {_range_text(c, lo, hi, False, False)}{_note(note)}")


def _dtype(c, setting: str):
  """Refuses a dtype the model does not support (names and NumPy/JAX dtypes are accepted)."""
  try:
    dtype_name(_get(c, setting), f"config.{setting}")
  except ValueError as e:
    raise ConfigError(str(e)) from None


_ARG_VALUE_NAMES = {int: "N", str: "NAME"}  # how parse_arg's error message writes a value


def parse_arg(arg: str | None, **known: type) -> dict:
  """The variants a config file's arg string names (`--config=configs/math.py:tiny,lag=100`).

  `known` gives each variant's kind: `bool` for a flag ("tiny"), `int` or `str` for a value
  ("lag=100", "dataset=leg_counting"). `parse_arg("tiny,lag=100", tiny=bool, lag=int)` ->
  `{"tiny": True, "lag": 100}`; a variant not given is False (a flag) or None (a value).
  Anything else is a ValueError naming it and listing the known variants.
  """
  out = {name: False if kind is bool else None for name, kind in known.items()}
  for part in filter(None, (arg or "").split(",")):
    name, equals, value = part.partition("=")
    kind = known.get(name)
    if kind is None or (kind is bool) == bool(equals):
      text = ", ".join(n if k is bool else f"{n}={_ARG_VALUE_NAMES[k]}" for n, k in known.items())
      raise ValueError(f"unknown config arg {part!r} (unknown variant; known: {text})")
    try:
      out[name] = True if kind is bool else kind(value)
    except ValueError:
      raise ValueError(f"config arg {part!r}: {name} must be {kind.__name__}") from None
  return out


LORA_MERGES = ("kept", "in_refresh")  # model.lora.merge: a standing merged copy, or none.
FILE_TASKS = ("math", "code")  # Tasks that read their problems from files (train/eval_path).
WARMUP_TASKS = ("addition", "chain_addition", "chain_mix", "tool_mix")  # Embedded tasks (character tokenizer, demonstrations: warmup.*).


def task_section(name: str) -> ml_collections.ConfigDict:
  """A config file's `task` section, holding the settings tasks of its kind share: `name`; for
  every task with a Hugging Face tokenizer (all but the embedded WARMUP_TASKS) `tokenizer_path`; for FILE_TASKS
  their sources, `question_field` and `num_eval`. The config file adds the task's own settings.
  """
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known: {tuple(TASKS)}")
  t = ml_collections.ConfigDict()
  t.name = name  # Task in oapl_jax.tasks: how prompts are made and answers scored.
  if name not in WARMUP_TASKS:
    t.tokenizer_path = placeholder(str)  # Tokenizer + chat template folder; None = model.path.
  if name in FILE_TASKS:
    # Sources: a .jsonl/.json/.parquet file or tfds:NAME[/CONFIG] (docs/datasets.md converts the
    # paper's Hugging Face files: launch/convert_hf_datasets.py).
    t.train_path = placeholder(str)  # Training problems (held-out questions are removed).
    t.eval_path = placeholder(str)  # Held-out problems.
    t.train_split = "train"  # TFDS split of a tfds: train source (ignored for files).
    t.eval_split = "test"  # TFDS split of a tfds: eval source (ignored for files).
    t.data_dir = placeholder(str)  # TFDS data folder for tfds: sources; None = TFDS's default.
    t.skip_bad_rows = False  # Skip (count, log) malformed rows instead of stopping at the first.
    t.question_field = "problem"  # Field holding the problem statement.
    t.num_eval = placeholder(int)  # Use only the first N eval problems; None = all.
  return t


def shrink_for_cpu(c: ml_collections.ConfigDict, model_path: str) -> None:
  """Turns a real-model config into its `:tiny` variant: a few RL steps on CPU, same code path."""
  c.model.path = model_path
  c.model.param_dtype = c.model.dtype = "float32"
  c.sampling.max_new_tokens = 16
  c.sampling.max_slots = 32
  c.sampling.engines = c.sampling.tensor = 1
  c.rl.lag = 2
  c.rl.groups_per_step = 2
  c.rl.groups_per_rollout = 2
  c.train.steps = 4
  c.train.grad_accum = 1
  c.train.lr = 1e-4
  c.eval.samples_per_problem = 2
  c.checkpoint.every = 2


def validate(c, *, dry_run: bool = False) -> None:
  """Raises `ConfigError` naming the first invalid setting of `c`: every numeric setting is
  checked for type, finiteness and range before any work starts. dry_run: skip the checks
  that files exist (task sources, model.path): a memory plan reads no file."""
  _int(c, "seed", 0)
  _check(c.task.name in TASKS, "task.name", c.task.name, f"must be one of {tuple(TASKS)}")
  for field in ("train_path", "eval_path"):
    if field in c.task and not dry_run:
      source = c.task[field] or ""
      _check(source.startswith("tfds:") or os.path.isfile(source), f"task.{field}", c.task[field],
             "no such file (give a .jsonl/.json/.parquet file or tfds:NAME[/CONFIG])")
  _validate_task(c)
  _validate_env(c)
  if c.model.path is not None and not dry_run:
    _check(os.path.isfile(os.path.join(c.model.path, "config.json")), "model.path", c.model.path,
           "not a Hugging Face checkpoint folder (no config.json); for the :tiny configs make one "
           "with `python launch/make_tiny_hf.py`")
  if "tokenizer_path" in c.task and not dry_run:
    _validate_tokenizer(c)
  _validate_model(c)
  _validate_sharding(c)
  _check(c.warmup.steps == 0 or c.task.name in WARMUP_TASKS, "warmup.steps", c.warmup.steps,
         f"the supervised warm-up exists only for the embedded tasks {WARMUP_TASKS}")
  _check(not c.warmup.cached_only or (c.warmup.cache_dir and c.warmup.steps), "warmup.cached_only",
         c.warmup.cached_only, "needs warmup.cache_dir (where the bases are) and warmup.steps > 0")

  rl = c.rl
  _check(rl.loss in LOSS_NAMES, "rl.loss", rl.loss, f"unknown loss; known: {sorted(LOSS_NAMES)}")
  _number(c, "rl.beta1", 0, lo_open=True)
  _number(c, "rl.beta2", 0, lo_open=True)
  _check(rl.beta2_rule in BETA2_RULES, "rl.beta2_rule", rl.beta2_rule, f"must be one of {BETA2_RULES}")
  _number(c, "rl.beta2_per_token", 0, lo_open=True)
  _int(c, "rl.group_size", 2, note="V_hat needs a group")
  _int(c, "rl.lag", 1)
  _int(c, "rl.max_lag", "rl.lag", optional=True,
       note="None = never drop stale groups; below rl.lag a fresh rollout could be dropped at once")
  _check(rl.old_logprobs in OLD_LOGPROB_SOURCES, "rl.old_logprobs", rl.old_logprobs,
         f"must be one of {OLD_LOGPROB_SOURCES}")
  g = rl.grpo
  _check(g.prox in GRPO_PROX, "rl.grpo.prox", g.prox, f"must be one of {GRPO_PROX}")
  _check(g.adv_norm in ADV_NORMS, "rl.grpo.adv_norm", g.adv_norm, f"must be one of {ADV_NORMS}")
  _number(c, "rl.grpo.adv_eps", 0)
  _number(c, "rl.grpo.eps_low", 0, 1, hi_open=True)
  _number(c, "rl.grpo.eps_high", 0)
  _check(g.is_level in IS_LEVELS, "rl.grpo.is_level", g.is_level, f"must be one of {IS_LEVELS}")
  _check(g.is_mode in IS_MODES, "rl.grpo.is_mode", g.is_mode, f"must be one of {IS_MODES}")
  _number(c, "rl.grpo.is_cap", 1)
  _check(g.norm in NORMS, "rl.grpo.norm", g.norm, f"must be one of {NORMS}")
  _number(c, "rl.grpo.kl_coef", 0, note="0 = off")
  _check(rl.mode in MODES, "rl.mode", rl.mode, f"must be one of {MODES}")
  stale = rl.mode == "async" or (rl.mode == "remote" and not rl.remote.reproducible)
  _check(not stale or (rl.loss == "oapl" and rl.old_logprobs == "sampler"), "rl.mode",
         rl.mode, f"{rl.mode} needs rl.loss='oapl' with rl.old_logprobs='sampler' (or, remote, "
         "rl.remote.reproducible=True): a rollout sampled before a refresh lands after it, and "
         "only the engine's own log-probs anchor it (the trainer's snapshot is already the next one)")
  _int(c, "rl.groups_per_step", 1)
  _int(c, "rl.groups_per_rollout", 1)
  _int(c, "rl.window_rollouts", 1, note="1 = one rollout per step")
  if rl.window_rollouts > 1:
    _check(rl.mode == "sync", "rl.window_rollouts", rl.window_rollouts,
           f"sync mode only (rl.mode={rl.mode!r}): async overlaps sampling with training instead, "
           "offline reads rounds, remote's sampler jobs sample a rollout at a time; set it to 1")
    _check(rl.lag % rl.window_rollouts == 0, "rl.window_rollouts", rl.window_rollouts,
           f"must divide rl.lag={rl.lag}: a window of rollouts is sampled by one pi_old")
    _check(rl.groups_per_rollout == rl.groups_per_step, "rl.window_rollouts", rl.window_rollouts,
           f"needs rl.groups_per_rollout == rl.groups_per_step (now {rl.groups_per_rollout} and "
           f"{rl.groups_per_step}): a window holds whole steps")
  if rl.mode == "offline":
    _validate_offline(c, dry_run)
  if rl.mode == "remote":
    _int(c, "rl.remote.ahead", 1)
    _int(c, "rl.remote.keep_snapshots", 1)
    _int(c, "rl.remote.max_rejections", 1)
    _number(c, "rl.remote.claim_timeout_s", 0, lo_open=True)
    _number(c, "rl.remote.poll_s", 0, lo_open=True)
    _number(c, "rl.remote.say_every_s", 0, lo_open=True)
    _check(not rl.remote.reproducible or rl.groups_per_rollout == rl.groups_per_step,
           "rl.remote.reproducible", True, f"needs rl.groups_per_rollout == rl.groups_per_step (now "
           f"{rl.groups_per_rollout} and {rl.groups_per_step}): rollout i is step i's, of version i // rl.lag")

  _int(c, "eval.samples_per_problem", 1)
  _int(c, "eval.every", 0, note="0 = before/after only")
  _number(c, "sampling.temperature", 0, lo_open=True)
  _number(c, "sampling.top_p", 0, 1, lo_open=True, note="1 = off")
  _int(c, "sampling.top_k", 0, note="0 = off")
  _int(c, "sampling.engines", 1)
  _int(c, "sampling.tensor", 1)
  _int(c, "sampling.min_decode_width", 1)
  _int(c, "sampling.max_prompt_len", 1)
  _int(c, "sampling.max_new_tokens", 1)
  _int(c, "sampling.max_slots", "rl.group_size")
  _int(c, "sampling.max_slots", "eval.samples_per_problem")
  s = c.sampling
  _check(s.max_slots % s.engines == 0, "sampling.max_slots", s.max_slots,
         f"a total over the engines: must be a multiple of sampling.engines={s.engines}")
  per_engine = s.max_slots // s.engines
  for setting in ("rl.group_size", "eval.samples_per_problem"):
    _check(per_engine >= _get(c, setting), "sampling.max_slots", s.max_slots,
           f"{per_engine} slots per engine (over sampling.engines={s.engines}) must be >= "
           f"{setting}={_get(c, setting)}: a group is decoded on one engine")
  _int(c, "sampling.steps_per_call", 1)
  release = s.get("release_weights", False)
  _check(isinstance(release, bool), "sampling.release_weights", release, "must be True or False")
  _check(not release or c.rl.mode == "sync", "sampling.release_weights", release,
         f"needs rl.mode 'sync' (in rl.mode {c.rl.mode!r} the engines sample while the trainer steps)")
  _int(c, "sampling.attn_chunk", 1)
  _int(c, "sampling.cache_bucket", 1)
  _int(c, "sampling.max_prefill_batch", 1)

  _int(c, "train.steps", 1)
  _number(c, "train.lr", 0, lo_open=True)
  _number(c, "train.warmup_ratio", 0, 1, hi_open=True)
  _number(c, "train.min_lr_ratio", 0, 1)
  _number(c, "train.b1", 0, 1, hi_open=True)
  _number(c, "train.b2", 0, 1, hi_open=True)
  _number(c, "train.eps", 0, lo_open=True, note="0 divides by zero where a gradient is 0")
  _number(c, "train.weight_decay", 0)
  _number(c, "train.grad_clip", 0, lo_open=True)
  _int(c, "train.grad_accum", 1)
  _check(rl.groups_per_step % c.train.grad_accum == 0, "train.grad_accum", c.train.grad_accum,
         f"must divide rl.groups_per_step={rl.groups_per_step}")
  _int(c, "train.max_nonfinite_steps", 1)
  _check(c.train.remat in REMAT_POLICIES, "train.remat", c.train.remat, f"must be one of {REMAT_POLICIES}")
  _int(c, "train.attn_block", 1)
  _int(c, "train.logprob_tile", 1)
  _check(isinstance(c.train.packing, bool), "train.packing", c.train.packing, "must be True or False")
  _int(c, "train.pack_rows", 0)
  _int(c, "train.pack_budget", 0)
  seq = c.sampling.max_prompt_len + c.sampling.max_new_tokens
  _check(c.train.pack_budget in (0,) or c.train.pack_budget >= seq, "train.pack_budget", c.train.pack_budget,
         f"must be 0 or >= max_prompt_len + max_new_tokens = {seq} (the longest answer fits one row)")
  _validate_mesh(c)

  _int(c, "warmup.steps", 0)
  _int(c, "warmup.noisy_steps", 0, "warmup.steps")
  _int(c, "warmup.batch_size", 1)
  _number(c, "warmup.lr", 0, lo_open=True)
  _number(c, "warmup.digit_noise", 0, 1, hi_open=True)
  _int(c, "checkpoint.every", 1)
  _int(c, "checkpoint.keep", 1)
  _number(c, "checkpoint.lock_lease_s", 1, note="the lock's holder renews it every lease / 10 s")
  _number(c, "checkpoint.lock_wait_s", 0)
  _int(c, "log.dead_model_steps", 0)
  _int(c, "log.every", 1)
  if c.log.peak_flops is not None:
    _number(c, "log.peak_flops", 0, lo_open=True)
  if c.log.profile_steps is not None:
    _check(profile_range(c.log.profile_steps) is not None, "log.profile_steps", c.log.profile_steps,
           "must be 'a:b' with 1 <= a <= b (trainer steps, inclusive), or None")
  _validate_distributed(c)


def _validate_distributed(c) -> None:
  """`c.distributed`: a "host:port" address, a process id below the process count."""
  d = c.distributed
  if d.coordinator_address is not None:
    host, _, port = d.coordinator_address.rpartition(":")
    _check(bool(host) and port.isdigit() and 0 < int(port) < 65536, "distributed.coordinator_address",
           d.coordinator_address, "must be host:port (e.g. 10.0.0.2:8476)")
  _int(c, "distributed.num_processes", 1, optional=True)
  _int(c, "distributed.process_id", 0, optional=True)
  if d.num_processes is not None and d.process_id is not None:
    _check(d.process_id < d.num_processes, "distributed.process_id", d.process_id,
           f"must be below distributed.num_processes={d.num_processes}")
  _int(c, "distributed.initialization_timeout", 1)


def _validate_env(c) -> None:
  """`c.env` (a config from before it existed has none)."""
  if "env" not in c:
    return
  _check(c.env.name is None or c.env.name in ENVS, "env.name", c.env.name, f"must be None or one of {tuple(ENVS)}")
  _int(c, "env.max_turns", 1)
  _number(c, "env.tool_timeout_s", 0, lo_open=True)
  _int(c, "env.tool_output_chars", 1)
  _int(c, "env.max_env_tokens", 1)
  _int(c, "env.workers", 1)
  if "sandbox_memory_mb" in c.env:  # a config from before these settings has neither
    _int(c, "env.sandbox_memory_mb", 64, note="the interpreter alone takes ~32")
    _check(isinstance(c.env.allow_unsandboxed, bool), "env.allow_unsandboxed", c.env.allow_unsandboxed,
           "must be True or False")


def _validate_offline(c, dry_run: bool) -> None:
  """`c.rl.offline` (checked in offline mode only; the file itself is checked by the run)."""
  path = c.rl.offline.path
  _check(path is None or dry_run or os.path.isfile(path), "rl.offline.path", path,
         "no such file (write one with python -m oapl_jax.generate, or None: the run samples round 1)")
  _int(c, "rl.offline.problems", "rl.groups_per_step", note="a round's batches are whole steps")
  _int(c, "rl.offline.rounds", 1)
  _int(c, "rl.offline.epochs", 1)
  _int(c, "rl.offline.check_rows", 1)
  _number(c, "rl.offline.logprob_tol", 0, lo_open=True)


def _validate_model(c) -> None:
  """The architecture fields and dtypes of `c.model` (meanings: ModelConfig)."""
  for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim"):
    _int(c, f"model.{field}", 1)
  _check(c.model.num_heads % c.model.num_kv_heads == 0, "model.num_kv_heads", c.model.num_kv_heads,
         f"must divide model.num_heads={c.model.num_heads}")
  _number(c, "model.rope_theta", 0, lo_open=True)
  _number(c, "model.rms_norm_eps", 0, lo_open=True)
  _int(c, "model.max_position_embeddings", 1, optional=True, note="None = unknown")
  _check(c.model.rope_scaling_type in ROPE_SCALING_TYPES, "model.rope_scaling_type",
         c.model.rope_scaling_type, f"must be one of {ROPE_SCALING_TYPES}")
  for field in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
    if field in c.model:
      _number(c, f"model.{field}", 0, lo_open=True)
  if "rope_original_max_len" in c.model:
    _int(c, "model.rope_original_max_len", 1)
  _dtype(c, "model.param_dtype")
  _dtype(c, "model.dtype")
  _check(c.model.get("attention_kernel", "auto") in ATTENTION_KERNELS, "model.attention_kernel",
         c.model.get("attention_kernel"), f"must be one of {ATTENTION_KERNELS}")
  if "lora" in c.model:
    _int(c, "model.lora.rank", 0, note="0 = full fine-tuning")
    _number(c, "model.lora.alpha", 0, lo_open=True)
    targets = c.model.lora.targets
    _check(isinstance(targets, (tuple, list)) and bool(targets) and set(targets) <= set(LORA_TARGETS),
           "model.lora.targets", targets, f"must be a non-empty tuple of {LORA_TARGETS}")
    init_from = c.model.lora.get("init_from")
    _check(init_from is None or (isinstance(init_from, str) and bool(init_from)), "model.lora.init_from",
           init_from, "must be None or a PEFT adapter folder")
    _check(init_from is None or c.model.lora.rank > 0, "model.lora.init_from", init_from,
           "needs model.lora.rank > 0 (the adapter's r)")
    _check(isinstance(c.model.lora.get("init_from_check_name", True), bool),
           "model.lora.init_from_check_name", c.model.lora.get("init_from_check_name"), "must be True or False")
    _check(c.model.lora.get("merge", "kept") in LORA_MERGES, "model.lora.merge",
           c.model.lora.get("merge"), f"must be one of {LORA_MERGES}")
  quant = c.model.get("base_quant", "none")
  _check(quant in BASE_QUANTS, "model.base_quant", quant, f"must be one of {BASE_QUANTS}")
  _check(quant == "none" or ("lora" in c.model and c.model.lora.rank > 0), "model.base_quant", quant,
         "quantises a frozen base: it needs model.lora.rank > 0 (full fine-tuning trains every weight)")


def _validate_sharding(c) -> None:
  """`c.sharding.rules`: (logical axis, mesh axes) pairs naming known mesh axes, one rule per
  logical axis, and a rule (None = replicated) for every logical axis a weight carries."""
  rules = c.sharding.rules
  _check(isinstance(rules, (tuple, list)), "sharding.rules", rules,
         "must be a tuple of (logical axis, mesh axes) pairs")
  seen = set()
  for i, rule in enumerate(rules):
    setting = f"sharding.rules[{i}]"
    _check(isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str),
           setting, rule, "must be a pair (logical axis name, mesh axes)")
    logical, mesh_axes = rule
    _check(logical not in seen, setting, rule, f"logical axis {logical!r} already has a rule")
    seen.add(logical)
    names = (mesh_axes,) if mesh_axes is None or isinstance(mesh_axes, str) else mesh_axes
    ok = isinstance(names, (tuple, list)) and len(set(names)) == len(names)
    ok = ok and all(n is None and len(names) == 1 or n in MESH_AXES for n in names)
    _check(ok, setting, rule, f"mesh axes {mesh_axes!r}: give one of {MESH_AXES}, a tuple of "
           "distinct ones, or None (replicated)")
  missing = [a for a in LOGICAL_AXES if a not in seen]
  _check(not missing, "sharding.rules", rules,
         f"no rule for logical axes {missing}, which weights carry; give (axis, None) to replicate")


def _validate_mesh(c) -> None:
  """`c.mesh`: each axis a size >= 1 or -1 (all remaining devices; at most one), a known topology."""
  for axis in ("data", "fsdp", "tensor"):
    v = c.mesh[axis]
    _check(isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1), f"mesh.{axis}",
           v, "must be an int >= 1, or -1 (all remaining devices)")
  minus = [a for a in ("data", "fsdp", "tensor") if c.mesh[a] == -1]
  _check(len(minus) <= 1, f"mesh.{minus[-1] if minus else 'fsdp'}", -1,
         f"only one mesh axis may be -1 (got {minus})")
  if c.mesh.topology not in (None, LOCAL):
    _check(c.mesh.topology in TOPOLOGIES, "mesh.topology", c.mesh.topology,
           f"unknown topology; known: {sorted(TOPOLOGIES)}")


def _validate_tokenizer(c) -> None:
  """The folder a task with a Hugging Face tokenizer reads it (and its chat template) from:
  task.tokenizer_path, else model.path; with neither (a randomly initialised model) the run
  would have no tokenizer."""
  setting, path = "task.tokenizer_path", c.task.tokenizer_path
  if path is None:
    _check(c.model.path is not None, setting, path,
           f"task {c.task.name!r} reads its tokenizer and chat template from task.tokenizer_path, "
           "else from model.path, and both are None (a randomly initialised model has no "
           "tokenizer): set task.tokenizer_path to a tokenizer folder (e.g. the checkpoint's)")
    setting, path = "model.path", c.model.path
  problem = tokenizer_folder_problem(path)
  _check(problem is None, setting, path,
         f"{problem} (the task's tokenizer: task.tokenizer_path, else model.path)")


def _validate_task(c) -> None:
  """The numeric settings of the task sections of configs/*.py (those a task has)."""
  task = c.task
  if "min_digits" in task:  # addition (oapl_jax/tasks/arithmetic.py: at most 9 digits)
    _int(c, "task.min_digits", 1, 9)
    _int(c, "task.max_digits", "task.min_digits", 9)
  if "operations" in task:  # chain_mix: a non-empty set of "+", "-", "*", "x"
    ops = task.operations
    _check(isinstance(ops, str) and ops and set(ops) <= set("+-*x") and len(set(ops)) == len(ops),
           "task.operations", ops, "distinct characters of '+-*x', at least one")
    noisy = task.get("noisy_operations")
    _check(noisy is None or (isinstance(noisy, str) and set(noisy) <= set(ops)), "task.noisy_operations",
           noisy, f"None (all) or operations among task.operations={ops!r}")
  if "num_eval" in task:  # None (math, code: all eval problems) where the config allows it
    _int(c, "task.num_eval", 1, optional=task.name in FILE_TASKS)
  if "reward_workers" in task:
    _int(c, "task.reward_workers", 1, note="1 = in the trainer process")
  if "timeout_s" in task:
    _number(c, "task.timeout_s", 0, lo_open=True)
  if "memory_mb" in task:
    _int(c, "task.memory_mb", 1)
  if "size" in task:
    _int(c, "task.size", 1)
