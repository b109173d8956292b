"""Train-step speed: our OAPL step vs Tunix's GRPO step and a PyTorch/transformers step (CPU).

Every side runs on identical weights (one tiny Qwen3 written as a Hugging Face checkpoint) and
identical batches, each framework in its own worker process and its own venv; the driver
alternates their repetitions so that all see the same machine load.

  python benchmarks/train_step.py --reps 5 \
      [--tunix-python tunix-venv/bin/python] [--torch-python torch-venv/bin/python] \
      [--shapes 32x32+128,8x32+128,8x32+512,8x32+2048] [--memory-only 8x32+8192] [--hf-dir DIR]

The venvs (each pins its own packages; the project's own venv runs the driver and our side):

  python3 -m venv tunix-venv && tunix-venv/bin/pip install google-tunix
  python3 -m venv torch-venv && torch-venv/bin/pip install torch==2.13.0 transformers

Model: `benchmarks/sampler.py`'s tiny Qwen3 (vocab 1024, hidden 256, 4 layers, 4 query / 2 KV
heads of 64, MLP 768, QK-norm, tied embeddings, float32), `nnx.Rngs(0)`, written with
`oapl_jax.models.to_hf` to `--hf-dir` (a temporary folder by default) and read back by every
side (ours: `from_hf`; Tunix: its safetensors loader; PyTorch: `AutoModelForCausalLM`).

Shapes `ROWSxPROMPT+ANSWER`: rows of a prompt and an answer (every answer at full length, all
of its tokens in the loss), random token ids, rewards 0/1, sampler log-probs, from one seed.

Sides (one step = scoring the batch, the loss, the backward pass and an AdamW update with
gradient-norm clipping; lr 1e-6):
* ours: `oapl_jax.rl.step.make_train_step` as the trainer builds it (OAPL, sampler mode: no
  second forward pass), its jitted step called on the placed batch (params and AdamW state
  donated), `train.remat` / `train.attn_block` / `train.logprob_tile` at the config defaults
  unless `--ours-remat` says otherwise.
* tunix: Tunix's GRPO loss (`tunix.rl.algo_core.grpo_loss_fn`, `GrpoConfig` defaults: beta
  0.04, epsilon 0.2) on its Qwen3, `nnx.value_and_grad` + an `nnx.Optimizer` (optax AdamW
  behind clipping) under one `nnx.jit` (optimizer donated), as its trainer's step
  (`tunix.sft.peft_trainer`) runs; "tunix+ref" adds the reference model's forward
  pass (`tunix.rl.common.compute_per_token_logps`, jitted) that a GRPO step with a KL penalty
  needs for every batch.
* torch: transformers' Qwen3 (`AutoModelForCausalLM`, float32, its default attention
  implementation), log-softmax of the logits, the same OAPL loss, `backward`,
  `clip_grad_norm_`, `torch.optim.AdamW`; torch with `OMP_WAIT_POLICY=PASSIVE` (on a shared
  machine spinning OpenMP threads make its time erratic) and every core.

Figures: the median step time of `--reps` alternating repetitions (after one warm-up step),
tokens/s (rows x (T-1) scored positions), cost per 1k scored positions, peak resident memory
of each worker during its steps (VmHWM after a reset), and MFU = useful FLOPs / time / peak,
where the peak is the best of a float32 2048^3 matmul in JAX and in torch measured in the
same run (before and after the steps, alternating). FLOPs = 2 x multiply-adds of the matmuls:
per position the q/k/v/o, MLP and LM-head weights, plus attention's q.k and p.v over the
causal half (position t attends to t+1 keys); a train step = 3 x the forward pass (forward,
backward w.r.t. activations and weights), Tunix's reference forward = 1 x more.
Tunix is skipped at answers above `--tunix-max-answer` (default 2048): its dense attention
materialises `[B, N, T, T]` float32 scores per layer. `--memory-only` shapes (8 x 8192-token
answers: minutes per step on 2 cores) are compiled, not run: XLA's figures for our step
(arguments + outputs - donated aliases + scratch = the step's peak device memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=64, mlp_dim=768)
GROUP = 8  # answers per group (the OAPL / GRPO group)
LR, B1, B2, EPS, WD, CLIP = 1e-6, 0.9, 0.999, 1e-8, 0.0, 1.0  # every side's AdamW and clipping
BETA1, BETA2 = 1.0, 0.1  # OAPL's betas (ours and torch)
_SETTLE = 0.3  # seconds of idleness before each repetition
PEAK_N = 2048  # the matmul peak: [N, N] x [N, N] float32


# --- shared by all workers (no framework imports at module level) ---------------------------

def parse_shape(s: str) -> tuple[int, int, int]:
  """"8x32+2048" -> (rows 8, prompt 32, answer 2048)."""
  rows, rest = s.split("x")
  prompt, answer = rest.split("+")
  return int(rows), int(prompt), int(answer)


def make_batch(rows: int, prompt: int, answer: int, seed: int = 0) -> dict:
  """Host arrays: tokens `[B, T]`, mask / sampler log-probs `[B, T-1]`, rewards `[B]`."""
  import numpy as np
  rng = np.random.default_rng(seed)
  t = prompt + answer
  mask = np.zeros((rows, t - 1), np.float32)
  mask[:, prompt - 1:] = 1.0
  old = np.where(mask > 0, -rng.uniform(5.0, 9.0, mask.shape), 0.0).astype(np.float32)
  return {"tokens": rng.integers(3, MODEL["vocab_size"], (rows, t)).astype(np.int32),
          "mask": mask, "sampler_logprobs": old,
          "rewards": rng.integers(0, 2, rows).astype(np.float32)}


def forward_macs(rows: int, t: int) -> int:
  """Multiply-adds of one forward pass scoring t positions per row (see the docstring)."""
  e, n, k, d, f, v, layers = (MODEL[x] for x in ("hidden_size", "num_heads", "num_kv_heads",
                                                 "head_dim", "mlp_dim", "vocab_size", "num_layers"))
  per_position = layers * (e * (n + 2 * k) * d + n * d * e + 3 * e * f) + e * v
  attention = layers * 2 * n * d * (t * (t + 1) // 2)  # q.k and p.v, causal half, per row
  return rows * (t * per_position + attention)


def peak_rss_reset() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def peak_rss_gib() -> float:
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 2**20


def _timed(fn) -> dict:
  """Runs fn() after a settle pause; seconds, and the peak RSS during it."""
  time.sleep(_SETTLE)
  peak_rss_reset()
  t0 = time.perf_counter()
  out = fn()
  return {"seconds": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(), **(out or {})}


# --- our side -------------------------------------------------------------------------------

class Ours:
  """The project's train step (`make_train_step`), on the weights of `hf_dir`."""

  def __init__(self, hf_dir: str, remat: str | None):
    sys.path.insert(0, REPO)
    import jax
    from flax import nnx
    from oapl_jax.models import from_hf
    self.jax = jax
    self.hf_dir, self.remat = hf_dir, remat
    self.graphdef, self.params0 = nnx.split(from_hf(hf_dir), nnx.Param)
    self.steps = {}

  def _config(self, rows, prompt, answer):
    from oapl_jax import config as config_lib
    c = config_lib.defaults("tiny_addition")
    c.model.update(MODEL, qk_norm=True, tie_embeddings=True, param_dtype="float32", dtype="float32")
    c.rl.loss, c.rl.group_size, c.rl.groups_per_step = "oapl", GROUP, rows // GROUP
    c.rl.beta1, c.rl.beta2 = BETA1, BETA2
    c.sampling.max_prompt_len, c.sampling.max_new_tokens, c.sampling.temperature = prompt, answer, 1.0
    c.train.lr, c.train.b1, c.train.b2, c.train.eps = LR, B1, B2, EPS
    c.train.weight_decay, c.train.grad_clip, c.train.warmup_ratio = WD, CLIP, 0.0
    c.train.min_lr_ratio = 1.0
    if self.remat:
      c.train.remat = self.remat
    return c

  def memory(self, shape: str) -> dict:
    """XLA's memory figures of the compiled step (GiB), without running it."""
    out = self.setup(shape, run=False)
    return {k: out[k] for k in ("compile_s", "xla_gib", "remat", "attn_block", "logprob_tile")}

  def setup(self, shape: str, run: bool = True) -> dict:
    import jax
    from oapl_jax.rl.step import Batch, make_optimizer, make_train_step
    from oapl_jax.sampling import SamplingParams
    rows, prompt, answer = parse_shape(shape)
    c = self._config(rows, prompt, answer)
    step = make_train_step(c, self.graphdef, make_optimizer(c.train, 1000),
                           SamplingParams(temperature=1.0))
    params = step.place_params(self.params0)
    opt_state = step.init_opt_state(params)
    snapshot = step.snapshot_of(params)
    batch = step.place_batch(Batch(**make_batch(rows, prompt, answer)))
    t0 = time.perf_counter()
    with jax.set_mesh(step.mesh):
      compiled = step.jitted.lower(params, opt_state, snapshot, batch, None, None).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state = {"step": step, "compiled": compiled, "params": params, "opt": opt_state,
             "snapshot": snapshot, "batch": batch}
    self.steps[shape] = state
    xla = {k: getattr(mem, f"{k}_size_in_bytes") / 2**30 for k in ("argument", "output", "alias", "temp")}
    xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    return {"compile_s": compile_s, "first": self.rep(shape) if run else None,
            "remat": c.train.remat, "attn_block": c.train.attn_block,
            "logprob_tile": c.train.logprob_tile, "xla_gib": xla}

  def rep(self, shape: str) -> dict:
    s = self.steps[shape]

    def run():
      with self.jax.set_mesh(s["step"].mesh):
        s["params"], s["opt"], m = s["compiled"](s["params"], s["opt"], s["snapshot"], s["batch"], None, None)
      return {"loss": float(self.jax.block_until_ready(m["loss"])), "grad_norm": float(m["grad_norm"])}
    return _timed(run)

  def peak(self) -> dict:
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(mm(a))
      times.append(time.perf_counter() - t0)
    return {"gflops": 2 * PEAK_N ** 3 / min(times) / 1e9}


# --- Tunix ----------------------------------------------------------------------------------

class Tunix:
  """Tunix's GRPO step (and its reference forward) on its Qwen3 from `hf_dir`'s safetensors."""

  def __init__(self, hf_dir: str, remat: str | None):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.models.qwen3 import params as qwen3_params
    self.jax, self.jnp, self.nnx = jax, jnp, nnx
    cfg = qwen3.ModelConfig(num_layers=MODEL["num_layers"], vocab_size=MODEL["vocab_size"],
                            embed_dim=MODEL["hidden_size"], hidden_dim=MODEL["mlp_dim"],
                            num_heads=MODEL["num_heads"], head_dim=MODEL["head_dim"],
                            num_kv_heads=MODEL["num_kv_heads"], rope_theta=1_000_000,
                            norm_eps=1e-6, use_tied_embedding=True, dtype=jnp.float32,
                            param_dtype=jnp.float32)
    self.cfg, self.hf_dir = cfg, hf_dir
    self.load = lambda: qwen3_params.create_model_from_safe_tensors(hf_dir, cfg)
    self.ref = self.load()
    self.tx = optax.chain(optax.clip_by_global_norm(CLIP),
                          optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD))
    self.steps = {}

  def _example(self, shape: str):
    """(TrainExample without reference log-probs, prompt ids, completion ids, mask)."""
    import numpy as np
    from tunix.rl.grpo import grpo_learner
    jnp = self.jnp
    rows, prompt, answer = parse_shape(shape)
    b = make_batch(rows, prompt, answer)
    tokens = b["tokens"]
    prompt_ids, completion_ids = jnp.asarray(tokens[:, :prompt]), jnp.asarray(tokens[:, prompt:])
    rewards = b["rewards"].reshape(-1, GROUP)
    adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
    ex = dict(prompt_ids=prompt_ids, prompt_mask=jnp.ones(prompt_ids.shape, jnp.int32),
              completion_ids=completion_ids,
              completion_mask=jnp.ones(completion_ids.shape, jnp.int32),
              advantages=jnp.asarray(adv.reshape(-1).astype(np.float32)),
              ref_per_token_logps=None, old_per_token_logps=None)
    return grpo_learner.TrainExample(**ex), prompt_ids, completion_ids

  def setup(self, shape: str) -> dict:
    import optax
    nnx = self.nnx
    from tunix.rl import algo_core, common
    from tunix.rl.grpo import grpo_learner
    model = self.load()
    optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
    example, prompt_ids, completion_ids = self._example(shape)
    algo = grpo_learner.GrpoConfig(num_generations=GROUP, beta=0.04, epsilon=0.2)
    algo.temperature = 1.0  # as GrpoLearner sets it from the rollout config

    def train_step(model, optimizer, example):  # as tunix.sft.peft_trainer's train_step
      grad_fn = nnx.value_and_grad(
          lambda m: algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=-1), has_aux=True)
      (loss, _), grads = grad_fn(model)
      grad_norm = optax.global_norm(grads)
      optimizer.update(model, grads)
      return loss, grad_norm

    # one jitted step per batch structure (with / without the reference log-probs): nnx.jit
    # retraced on every call when one function alternated between the two
    steps = {ref: nnx.jit(train_step, donate_argnames=("optimizer",)) for ref in (False, True)}

    @nnx.jit
    def ref_forward(ref, prompt_ids, completion_ids):  # GRPO's reference log-probs
      graphdef, state = nnx.split(ref)
      return common.compute_per_token_logps(graphdef, state, prompt_tokens=prompt_ids,
                                            completion_tokens=completion_ids, pad_id=0, eos_id=-1)

    self.steps[shape] = dict(model=model, opt=optimizer, example=example, steps=steps,
                             ref=ref_forward, ids=(prompt_ids, completion_ids))
    t0 = time.perf_counter()
    first = [self.rep(shape, with_ref=ref) for ref in (False, True)]
    return {"compile_s": time.perf_counter() - t0, "first": first,
            "loss_agg_mode": algo.loss_agg_mode}

  def rep(self, shape: str, with_ref: bool = False) -> dict:
    s, jax = self.steps[shape], self.jax

    def run():
      example = s["example"]
      if with_ref:
        ref = s["ref"](self.ref, *s["ids"])
        example = example.replace(ref_per_token_logps=ref)
      loss, grad_norm = s["steps"][with_ref](s["model"], s["opt"], example)
      return {"loss": float(jax.block_until_ready(loss)), "grad_norm": float(grad_norm)}
    return _timed(run)

  def peak(self) -> dict:
    return Ours.peak(self)


# --- PyTorch / transformers -----------------------------------------------------------------

class Torch:
  """transformers' Qwen3 from `hf_dir`, the OAPL loss, torch's AdamW."""

  def __init__(self, hf_dir: str, remat: str | None):
    import torch
    import transformers
    self.torch, self.hf_dir = torch, hf_dir
    self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    self.model.train()
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(B1, B2), eps=EPS,
                                 weight_decay=WD)
    self.batches = {}
    self.info = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads(),
                 "attn_implementation": self.model.config._attn_implementation,
                 "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}

  def setup(self, shape: str) -> dict:
    self.batches[shape] = {k: self.torch.from_numpy(v) for k, v in make_batch(*parse_shape(shape)).items()}
    t0 = time.perf_counter()
    first = self.rep(shape)
    return {"compile_s": time.perf_counter() - t0, "first": first, **self.info}

  def _loss(self, b):
    torch = self.torch
    tokens = b["tokens"].long()
    logits = self.model(input_ids=tokens[:, :-1]).logits.float()  # [B, T-1, V]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]
    rewards = b["rewards"].reshape(-1, GROUP)
    v_hat = BETA1 * (torch.logsumexp(rewards / BETA1, 1) - torch.log(torch.tensor(float(GROUP))))
    adv = (rewards - v_hat[:, None]).reshape(-1)
    ell = ((logp - b["sampler_logprobs"]) * b["mask"]).sum(-1)
    return ((BETA2 * ell - adv) ** 2).mean()

  def rep(self, shape: str) -> dict:
    b, torch = self.batches[shape], self.torch

    def run():
      loss = self._loss(b)
      loss.backward()
      norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
      self.opt.step()
      self.opt.zero_grad(set_to_none=True)
      return {"loss": float(loss), "grad_norm": float(norm)}
    return _timed(run)

  def peak(self) -> dict:
    torch = self.torch
    a = torch.randn(PEAK_N, PEAK_N)
    a @ a
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      a @ a
      times.append(time.perf_counter() - t0)
    return {"gflops": 2 * PEAK_N ** 3 / min(times) / 1e9}


WORKERS = {"ours": Ours, "tunix": Tunix, "torch": Torch}


def worker(name: str, hf_dir: str, remat: str | None) -> None:
  """Line protocol on stdin/stdout: `setup SHAPE`, `rep SHAPE [ref]`, `peak`; one JSON reply each."""
  side = WORKERS[name](hf_dir, remat)
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "setup":
      out = side.setup(args[0])
    elif cmd == "memory":
      out = side.memory(args[0])
    elif cmd == "rep":
      out = side.rep(args[0], with_ref=True) if args[1:] == ["ref"] else side.rep(args[0])
    else:
      out = side.peak()
    print(json.dumps(out), flush=True)


# --- the driver -----------------------------------------------------------------------------

class Worker:
  """A worker process of `python` (its own venv) for side `name`."""

  def __init__(self, name: str, python: str, hf_dir: str, remat: str | None, env: dict):
    cmd = [python, os.path.abspath(__file__), "--worker", name, "--hf-dir", hf_dir]
    cmd += ["--ours-remat", remat] if remat else []
    self.name = name
    self._p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               cwd=REPO, env={**os.environ, **env})
    self._read()

  def _read(self) -> dict:
    while True:
      line = self._p.stdout.readline()
      if not line:
        raise SystemExit(f"the {self.name} worker died (its stderr is above)")
      if line.startswith("{"):
        return json.loads(line)

  def ask(self, *words: str) -> dict:
    self._p.stdin.write(" ".join(words) + "\n")
    self._p.stdin.flush()
    return self._read()

  def close(self):
    self._p.stdin.close()
    self._p.wait(timeout=60)


def write_weights(hf_dir: str) -> None:
  sys.path.insert(0, REPO)
  from flax import nnx
  from oapl_jax.models import ModelConfig, Transformer, to_hf
  cfg = ModelConfig(**MODEL, qk_norm=True, tie_embeddings=True, param_dtype="float32", dtype="float32")
  to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), hf_dir)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--shapes", default="32x32+128,8x32+128,8x32+512,8x32+2048")
  parser.add_argument("--hf-dir", default=None, help="where the weights go (default: a temp dir)")
  parser.add_argument("--tunix-python", default=None, help="a venv's python with google-tunix")
  parser.add_argument("--torch-python", default=None, help="a venv's python with torch + transformers")
  parser.add_argument("--tunix-max-answer", type=int, default=2048)
  parser.add_argument("--ours-remat", default=None, help="train.remat for our side (default: config's)")
  parser.add_argument("--memory-only", default="",
                      help="shapes whose compiled step (ours) only reports XLA's memory figures, not run")
  parser.add_argument("--worker", default=None, choices=sorted(WORKERS), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    return worker(args.worker, args.hf_dir, args.ours_remat)

  hf_dir = args.hf_dir or tempfile.mkdtemp(prefix="train_step_hf_")
  write_weights(hf_dir)
  workers = {"ours": Worker("ours", sys.executable, hf_dir, args.ours_remat, {})}
  if args.tunix_python:
    workers["tunix"] = Worker("tunix", args.tunix_python, hf_dir, None, {})
  if args.torch_python:
    workers["torch"] = Worker("torch", args.torch_python, hf_dir, None, {"OMP_WAIT_POLICY": "PASSIVE"})
  peaks = [w.ask("peak")["gflops"] for w in workers.values() if w.name != "tunix"]
  load = os.getloadavg()
  result = {"config": {"model": MODEL, "reps": args.reps, "cpus": os.cpu_count(),
                       "loadavg_start": load}, "shapes": {}}
  for shape in args.shapes.split(","):
    rows, prompt, answer = parse_shape(shape)
    sides = {n: w for n, w in workers.items() if n != "tunix" or answer <= args.tunix_max_answer}
    setups = {n: w.ask("setup", shape) for n, w in sides.items()}
    reps = {n: [] for n in sides}
    if "tunix" in sides:
      reps["tunix+ref"] = []
    for _ in range(args.reps):
      for n, w in sides.items():
        reps[n].append(w.ask("rep", shape))
        if n == "tunix":
          reps["tunix+ref"].append(w.ask("rep", shape, "ref"))
    positions = rows * (prompt + answer - 1)
    train_flops = 6 * forward_macs(rows, prompt + answer - 1)
    figures = {}
    for n, rs in reps.items():
      sec = statistics.median(r["seconds"] for r in rs)
      flops = train_flops + (2 * forward_macs(rows, prompt + answer - 1) if n == "tunix+ref" else 0)
      figures[n] = {"seconds": sec, "seconds_all": [r["seconds"] for r in rs],
                    "tokens_per_s": positions / sec, "s_per_1k_tokens": sec / positions * 1e3,
                    "gflops_per_s": flops / sec / 1e9, "flops": flops,
                    "peak_rss_gib": max(r["peak_rss_gib"] for r in rs),
                    "loss": rs[-1].get("loss"), "setup": setups.get(n.split("+")[0])}
    result["shapes"][shape] = figures
    line = f"{shape} ({positions} positions):"
    for n, f in figures.items():
      ratio = figures[n]["seconds"] / figures["ours"]["seconds"]
      line += (f"\n  {n:10s} {f['seconds'] * 1e3:9.1f} ms  {f['s_per_1k_tokens']:.4f} s/1k tok  "
               f"{f['gflops_per_s']:6.1f} GFLOP/s  peak RSS {f['peak_rss_gib']:.2f} GiB"
               + ("" if n == "ours" else f"  -> ours is {ratio:.2f}x faster"))
    print(line, flush=True)
  peaks += [w.ask("peak")["gflops"] for w in workers.values() if w.name != "tunix"]
  for shape in filter(None, args.memory_only.split(",")):
    result.setdefault("memory_only", {})[shape] = m = workers["ours"].ask("memory", shape)
    print(f"{shape}: ours compiled ({m['compile_s']:.0f} s), XLA memory GiB: "
          + ", ".join(f"{k} {v:.2f}" for k, v in m["xla_gib"].items()), flush=True)
  peak = max(peaks)
  result["config"].update(matmul_peak_gflops=peak, matmul_peaks=peaks, loadavg_end=os.getloadavg())
  for shape, figures in result["shapes"].items():
    for f in figures.values():
      f["mfu"] = f["gflops_per_s"] / peak
  print(f"matmul peak (float32 {PEAK_N}^3, best of JAX/torch, before+after): {peak:.1f} GFLOP/s; "
        "MFU: " + "; ".join(f"{s} " + ", ".join(f"{n} {f['mfu']:.0%}" for n, f in fs.items())
                            for s, fs in result["shapes"].items()))
  for w in workers.values():
    w.close()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
