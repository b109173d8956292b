"""A prepared accelerator check: one command, one GPU, under 8 minutes, one JSON object printed.

  PYTHONPATH=. python benchmarks/gpu_check.py            # one GPU (or TPU) chip
  PYTHONPATH=. python benchmarks/gpu_check.py --dry      # CPU, tiny shapes, < 60 s (CI)

Needs only jax, flax, optax, numpy, transformers, safetensors and torch (the project on
PYTHONPATH, not installed): it imports the model, the train step and the engine, which import
none of TensorFlow, JetStream, seqio, orbax, ml_collections or clu. The train step reads its
settings from a config (`oapl_jax.config.defaults`); where ml_collections is missing, a
stand-in for its ConfigDict (a dict with attribute access, below) serves, and the JSON says so.

What it measures (random weights of the Qwen3-0.6B architecture, `qwen3_0_6b`; `--dry`: the
tiny Qwen3 `tiny_qwen3` and small shapes, the same keys):

* `matmul_peak_tflops`: the best rate of a bfloat16 [n, n] x [n, n] matmul (n = 8192), chained
  in one jitted loop: the peak the MFU is measured against, from this run, on this chip.
* `train_step`: the project's OAPL train step (`oapl_jax.rl.step.make_train_step`, bfloat16
  compute, float32 master weights and AdamW state) on 16 rows x 1024 tokens (2 groups of 8;
  256-token prompts, 768-token answers, every answer token in the loss); the median of the
  timed steps after a compile; MFU = model FLOPs per step / step time / matmul peak, where
  model FLOPs = 3 x the forward pass's 2 x multiply-adds (q/k/v/o, MLP and LM-head matmuls
  per position, plus attention's q.k and p.v over the causal half); recomputation (remat) is
  not counted as useful.
* `decode`: the engine (`oapl_jax.sampling.Engine` through `rollout`, as the trainer samples)
  with 64 slots: 64 prompts of 128 tokens, 512 new tokens each (no EOS: every answer at full
  length), temperature 1, tokens/s of a warm call; `transformers` `generate` on the same
  weights (exported with `to_hf`) on the same GPU with torch, bfloat16, the same prompts and
  lengths (min_new_tokens = max_new_tokens), in a child process (its own memory); and the
  bytes-over-bandwidth limit: each decode step reads every weight once (bfloat16) and each
  slot's KV cache up to its position; the bandwidth is that of a jitted copy of a 2 GiB array
  measured in this run (read + write bytes / time).
* `peak_memory_gib`: JAX's `peak_bytes_in_use` on the device over the whole run, and torch's
  `max_memory_allocated` in the child (`--dry` on CPU: resident memory, VmHWM, instead).

The GPU figures have not been measured yet (docs/real_model.md); `--dry`'s CPU numbers only
show that the code runs and the keys are filled.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GiB = 2**30
FULL = dict(preset="qwen3_0_6b", rows=16, group=8, prompt=256, answer=768, matmul_n=8192,
            matmul_chain=16, copy_gib=2.0, slots=64, decode_prompt=128, decode_new=512,
            train_reps=5, remat="dots", logprob_tile=128)
DRY = dict(preset="tiny_qwen3", rows=4, group=2, prompt=16, answer=48, matmul_n=256,
           matmul_chain=4, copy_gib=1 / 64, slots=8, decode_prompt=8, decode_new=16,
           train_reps=2, remat="none", logprob_tile=32)


# --- settings -------------------------------------------------------------------------------

class _Section(dict):
  """Stand-in for ml_collections.ConfigDict where it is not installed: a dict whose items are
  also attributes (what `oapl_jax.config.defaults` and the train step use of it)."""

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None

  def __setattr__(self, name, value):
    self[name] = value


def _config_module():
  """(`oapl_jax.config`, where its ConfigDict came from): with ml_collections if installed,
  else with `_Section` standing in for it (only `ConfigDict` and `placeholder` are used)."""
  try:
    import ml_collections  # noqa: F401
    source = "ml_collections"
  except ImportError:
    stand_in = types.ModuleType("ml_collections")
    stand_in.ConfigDict = _Section
    config_dict = types.ModuleType("ml_collections.config_dict")
    config_dict.placeholder = lambda kind: None  # an unset setting is None
    stand_in.config_dict = config_dict
    sys.modules["ml_collections"] = stand_in
    sys.modules["ml_collections.config_dict"] = config_dict
    source = "stand-in (ml_collections not installed)"
  from oapl_jax import config as config_lib
  return config_lib, source


def train_config(config_lib, s: dict):
  """The run's config: the preset, bfloat16 compute over float32 master weights, OAPL."""
  c = config_lib.defaults(s["preset"])
  c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
  c.rl.loss, c.rl.group_size, c.rl.groups_per_step = "oapl", s["group"], s["rows"] // s["group"]
  c.sampling.max_prompt_len, c.sampling.max_new_tokens = s["prompt"], s["answer"]
  c.train.remat, c.train.logprob_tile, c.train.grad_accum = s["remat"], s["logprob_tile"], 1
  return c


# --- FLOPs and bytes ------------------------------------------------------------------------

def forward_flops(m, rows: int, positions: int) -> float:
  """2 x multiply-adds of one forward pass over `rows` x `positions` (causal attention: position
  t attends to t + 1 keys)."""
  e, n, k, d, f, v = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
  per_token = m.num_layers * (2 * e * n * d + 2 * e * k * d + 3 * e * f) + e * v
  attn_pairs = positions * (positions + 1) / 2  # (query, key) pairs of a row
  return 2 * rows * (positions * per_token + m.num_layers * n * d * 2 * attn_pairs)


def weight_bytes(m, itemsize: int = 2) -> int:
  """Bytes of the weights a decode step reads (every matrix once; a tied embedding once)."""
  e, n, k, d, f, v = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
  layer = 2 * e * n * d + 2 * e * k * d + 3 * e * f + 2 * e + 2 * d
  return itemsize * (m.num_layers * layer + v * e * (1 if m.tie_embeddings else 2) + e)


def kv_bytes_per_position(m, itemsize: int = 2) -> int:
  return 2 * m.num_layers * m.num_kv_heads * m.head_dim * itemsize


# --- measurements ---------------------------------------------------------------------------

def _best(fn, reps: int) -> float:
  """Fastest of `reps` timed calls of `fn` (blocking), after one untimed call."""
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return min(times)


def matmul_peak(s: dict) -> float:
  """bfloat16 matmul rate (TFLOP/s): `chain` dependent [n, n] products in one jitted loop."""
  import jax
  import jax.numpy as jnp
  n, chain = s["matmul_n"], s["matmul_chain"]
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16) / math.sqrt(n)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)

  @jax.jit
  def chained(a, b):
    return jax.lax.fori_loop(0, chain, lambda _, x: (x @ a).astype(jnp.bfloat16), b)

  return 2 * n**3 * chain / _best(lambda: chained(a, b), 5) / 1e12


def copy_bandwidth(s: dict) -> float:
  """Device memory bandwidth (GB/s): a jitted `x + 1` of a bfloat16 array (read + write)."""
  import jax
  import jax.numpy as jnp
  size = int(s["copy_gib"] * GiB) // 2
  x = jnp.zeros((size,), jnp.bfloat16)
  bump = jax.jit(lambda x: x + 1)
  seconds = _best(lambda: bump(x), 5)
  return 2 * size * 2 / seconds / 1e9


def train_step(config_lib, s: dict, peak_tflops: float) -> dict:
  """The project's train step on rows x (prompt + answer) random tokens."""
  import jax
  import numpy as np
  from flax import nnx
  from oapl_jax.models import build
  from oapl_jax.models.transformer import ModelConfig
  from oapl_jax.rl.step import Batch, make_optimizer, make_train_step
  from oapl_jax.sampling.processing import SamplingParams

  c = train_config(config_lib, s)
  model_cfg = ModelConfig.from_config(c.model)
  graphdef, params = build.init_params(model_cfg, c.seed)
  step = make_train_step(c, graphdef, make_optimizer(c.train, 1000), SamplingParams(temperature=1.0))
  params = step.place_params(params)
  opt_state = step.init_opt_state(params)
  snapshot = step.snapshot_of(params)
  rows, t = s["rows"], s["prompt"] + s["answer"]
  rng = np.random.default_rng(0)
  mask = np.zeros((rows, t - 1), np.float32)
  mask[:, s["prompt"] - 1:] = 1.0  # every answer token is a target in the loss
  batch = step.place_batch(Batch(
      tokens=rng.integers(0, model_cfg.vocab_size, (rows, t)).astype(np.int32), mask=mask,
      sampler_logprobs=(-rng.exponential(2.0, (rows, t - 1)) * mask).astype(np.float32),
      rewards=rng.integers(0, 2, rows).astype(np.float32)))
  t0 = time.perf_counter()
  with jax.set_mesh(step.mesh):
    compiled = step.jitted.lower(params, opt_state, snapshot, batch, None, None).compile()
  compile_s = time.perf_counter() - t0
  times, loss = [], None
  for _ in range(s["train_reps"] + 1):  # the first call is not timed
    t0 = time.perf_counter()
    with jax.set_mesh(step.mesh):
      params, opt_state, metrics = compiled(params, opt_state, snapshot, batch, None, None)
    loss = float(jax.block_until_ready(metrics["loss"]))
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times[1:])
  flops = 3 * forward_flops(model_cfg, rows, t - 1)
  del params, opt_state, snapshot, batch, compiled
  return {"rows": rows, "tokens_per_row": t, "params": build.param_count(model_cfg),
          "compute_dtype": c.model.dtype, "param_dtype": c.model.param_dtype,
          "remat": c.train.remat, "logprob_tile": c.train.logprob_tile,
          "compile_seconds": compile_s, "step_seconds": seconds,
          "tokens_per_s": rows * t / seconds, "model_tflops_per_step": flops / 1e12,
          "achieved_tflops": flops / seconds / 1e12, "mfu": flops / seconds / 1e12 / peak_tflops,
          "loss_finite": math.isfinite(loss)}


def _prompts(s: dict, vocab: int):
  import numpy as np
  rng = np.random.default_rng(1)
  return rng.integers(3, vocab, (s["slots"], s["decode_prompt"])).astype(np.int64)


def engine_decode(s: dict, graphdef, params, model_cfg) -> dict:
  """Tokens/s of the engine's rollout: slots prompts, every answer decode_new tokens long."""
  import jax
  from oapl_jax.sampling.engine import Engine
  from oapl_jax.sampling.processing import SamplingParams
  from oapl_jax.sampling.rollout import rollout

  max_len = s["decode_prompt"] + s["decode_new"]
  engine = Engine(graphdef, model_cfg, SamplingParams(temperature=1.0), max_slots=s["slots"],
                  max_prefill_length=s["decode_prompt"], max_len=max_len, steps_per_call=32,
                  attn_chunk=1024, cache_bucket=64, max_prefill_batch=16,
                  min_decode_width=s["slots"])  # no narrowing: all answers end together
  weights = engine.load_params(params, version=0)
  prompts = [list(map(int, p)) for p in _prompts(s, model_cfg.vocab_size)]

  def go(seed: int):
    ro = rollout(engine, weights, prompts, group_size=1, max_new_tokens=s["decode_new"],
                 eos_id=-1, pad_id=0, key=jax.random.key(seed))
    assert (ro.lengths == s["decode_new"]).all()
    return ro

  t0 = time.perf_counter()
  go(0)
  first = time.perf_counter() - t0
  times = []
  for seed in (1, 2):
    t0 = time.perf_counter()
    go(seed)
    times.append(time.perf_counter() - t0)
  seconds = min(times)
  return {"engine_tokens_per_s": s["slots"] * s["decode_new"] / seconds,
          "engine_seconds": seconds, "engine_first_call_seconds": first}


def hf_child(model_dir: str, prompts, new_tokens: int, replies) -> None:
  """transformers' `generate` (torch, bfloat16) on the exported weights: tokens/s of a warm call."""
  import torch
  import transformers
  cuda = torch.cuda.is_available()
  device = "cuda" if cuda else "cpu"
  dtype = torch.bfloat16 if cuda else torch.float32
  major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
  key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in transformers 4.56
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{key: dtype}).to(device)
  model.eval()
  ids = torch.tensor(prompts, device=device)
  kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                eos_token_id=1)
  times = []
  for seed in range(3):  # the first call is not timed
    torch.manual_seed(seed)
    if cuda:
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
    if cuda:
      torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens)
  seconds = min(times[1:])
  peak = (torch.cuda.max_memory_allocated() if cuda else _rss_peak()) / GiB
  replies.put({"hf_tokens_per_s": ids.shape[0] * new_tokens / seconds, "hf_seconds": seconds,
               "hf_device": torch.cuda.get_device_name() if cuda else "cpu",
               "hf_dtype": str(dtype).replace("torch.", ""), "torch_peak_gib": peak,
               "torch": str(torch.__version__), "transformers": str(transformers.__version__)})


def hf_generate(s: dict, model, vocab: int) -> dict:
  """`hf_child` in a spawned process on `model` exported with `to_hf`."""
  from oapl_jax.models.hf import to_hf
  with tempfile.TemporaryDirectory() as d:
    to_hf(model, d)
    ctx = multiprocessing.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=hf_child, args=(d, _prompts(s, vocab).tolist(), s["decode_new"], replies))
    child.start()
    out = replies.get(timeout=600)
    child.join()
  return out


def decode_limit(s: dict, model_cfg, bandwidth_gbs: float) -> dict:
  """Tokens/s if every decode step only read its bytes at `bandwidth_gbs`: the weights once and
  each slot's KV cache up to its position (mean over the answer)."""
  mean_context = s["decode_prompt"] + (s["decode_new"] - 1) / 2
  per_step = weight_bytes(model_cfg) + s["slots"] * mean_context * kv_bytes_per_position(model_cfg)
  return {"bytes_per_step_mean": per_step, "bandwidth_gbs": bandwidth_gbs,
          "bandwidth_limit_tokens_per_s": s["slots"] * bandwidth_gbs * 1e9 / per_step}


def _rss_peak() -> int:
  """This process's peak resident memory in bytes (VmHWM)."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes (CI): the same keys")
  args = parser.parse_args(argv)
  s = DRY if args.dry else FULL
  if args.dry:
    os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch's child
  start = time.perf_counter()
  import flax
  import jax
  from flax import nnx
  from oapl_jax.models import build
  from oapl_jax.models.transformer import ModelConfig, Transformer

  config_lib, config_source = _config_module()
  device = jax.devices()[0]
  out = {"mode": "dry" if args.dry else "full", "device": f"{device.platform}: {device.device_kind}",
         "jax": jax.__version__, "flax": flax.__version__, "config_source": config_source,
         "model": s["preset"]}
  peak = matmul_peak(s)
  out["matmul_peak_tflops"] = peak
  out["matmul_n"] = s["matmul_n"]
  out["train_step"] = train_step(config_lib, s, peak)

  model_cfg = ModelConfig.from_config(train_config(config_lib, s).model)  # bfloat16 compute
  model = Transformer(model_cfg, rngs=nnx.Rngs(params=0))
  graphdef, params = nnx.split(model, nnx.Param)
  decode = {"slots": s["slots"], "prompt_tokens": s["decode_prompt"], "new_tokens": s["decode_new"]}
  decode.update(engine_decode(s, graphdef, params, model_cfg))
  decode.update(decode_limit(s, model_cfg, copy_bandwidth(s)))
  stats = device.memory_stats() or {}
  jax_peak = stats.get("peak_bytes_in_use")
  hf = hf_generate(s, model, model_cfg.vocab_size)
  torch_peak = hf.pop("torch_peak_gib")
  out["torch"], out["transformers"] = hf.pop("torch"), hf.pop("transformers")
  decode.update(hf)
  decode["engine_vs_hf"] = decode["engine_tokens_per_s"] / decode["hf_tokens_per_s"]
  decode["engine_fraction_of_limit"] = decode["engine_tokens_per_s"] / decode["bandwidth_limit_tokens_per_s"]
  out["decode"] = decode
  out["peak_memory_gib"] = {
      "jax": (jax_peak if jax_peak is not None else _rss_peak()) / GiB,
      "jax_source": "device peak_bytes_in_use" if jax_peak is not None else "host VmHWM (no device stats)",
      "torch": torch_peak}
  out["params"] = build.param_count(model_cfg)
  out["seconds"] = time.perf_counter() - start
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
