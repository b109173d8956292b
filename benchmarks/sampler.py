"""Sampling throughput: our JetStream engine vs transformers' `generate`, same weights, on CPU.

One tiny Qwen3 (vocab 1024, hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 768,
QK-norm, tied embeddings, float32), random weights exported with `oapl_jax.models.to_hf` and
loaded by `AutoModelForCausalLM` (PyTorch CPU) for the reference.

  python benchmarks/sampler.py [--reps 5] [--engines N] [--skip-hf]

1. fixed: 32 prompts x 32 tokens, exactly 128 new tokens each, temperature 1 (our engine: no
   EOS; transformers: do_sample=True, min_new_tokens=max_new_tokens). Generated tokens/s of
   the whole call (prefill, decode, host work), median of `--reps`, and the ratios. Three
   sides alternate repetition by repetition, so that all see the same machine load:
   transformers (a child process of its own, torch using every core, OpenMP threads waiting
   passively: `OMP_WAIT_POLICY=PASSIVE`), our engine alone (one
   `Engine`, 32 slots), and our engine as the trainer runs it with `sampling.engines=N`
   (`oapl_jax.sampling.parallel.Replicas`: N engines of 32 / N slots, one per host device,
   every N-th prompt each; N = `--engines`, default the number of cores; this script asks JAX
   for N host devices before it starts). Compile time (first call minus a warm one) apart.
   Peak RSS (VmHWM): ours = this process (JAX, and the TensorFlow that `jetstream` imports),
   transformers = its child process.
2. cache size: the same workload with a 1024- and a 4096-position KV cache; and with the
   paper's code-run sampling (temperature 0.6, top-p 0.95: a sort per step).
3. weight swap: `Engine.load_params(new snapshot, version=)` time (on device, and from host
   numpy), whether anything recompiled, the first rollout after the swap.
4. continuous batching: 1024 prompts (8-32 tokens) through 32 slots, answer lengths forced
   by per-prompt budgets drawn from a Pareto (long-tailed) distribution, 1..256 tokens.
   Slot utilisation = live slot-steps / computed slot-steps (a decode call of n steps at
   width W computes n * W rows; W = 32, or less once `rollout` has narrowed the state in the
   final drain: `Engine.min_decode_width`), overall and while prompts were still queued (the
   final drain, when the last long answers run on, left out; there W is always 32).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, PROMPT_LEN, NEW_TOKENS, SLOTS = 32, 32, 128, 32
_SETTLE = 0.3  # seconds of idleness before each alternating repetition (spinning threads)


def _top_p():
  from oapl_jax.sampling import SamplingParams
  return SamplingParams(temperature=0.6, top_p=0.95)  # the paper's code-run sampling


def model_config():
  from oapl_jax.models import ModelConfig
  return ModelConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=64, mlp_dim=768, qk_norm=True, tie_embeddings=True,
                     param_dtype="float32", dtype="float32")


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
  import numpy as np
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 1024, rng.integers(lo, hi + 1))] for _ in range(n)]


def peak_rss_mb() -> float:
  """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited by a child)."""
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024


def _timed(fn, reps: int):
  """(first-call seconds, median of `reps` warm calls, last result)."""
  t0 = time.perf_counter()
  out = fn(0)
  first = time.perf_counter() - t0
  times = []
  for r in range(reps):
    t0 = time.perf_counter()
    out = fn(r + 1)
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times), out


def _compiles(engine) -> dict:
  return {f: getattr(engine, f)._cache_size() for f in ("_prefill", "_insert", "_generate_steps", "_resize")}


def _engine_settings(**overrides) -> dict:
  """The Engine settings of the config's defaults (`config.sampling`, their owner), with `overrides`."""
  from oapl_jax import config as config_lib
  from oapl_jax.sampling.engine import engine_settings
  return {**engine_settings(config_lib.defaults("tiny_addition").sampling), **overrides}


def fixed_engines(graphdef, params, num: int, max_len: int, sampling):
  """`num` replicas of the fixed workload's engine (32 / num slots each), weights loaded."""
  from oapl_jax.sampling import Engine
  from oapl_jax.sampling.parallel import Replicas
  replicas = Replicas(lambda mesh: Engine(graphdef, model_config(), sampling, max_slots=SLOTS // num,
                                          max_prefill_length=PROMPT_LEN, max_len=max_len, mesh=mesh,
                                          **_engine_settings(max_prefill_batch=BATCH // num)), num)
  return replicas, replicas.load_params(params, version=0)


@functools.cache
def fixed_prompts() -> list[list[int]]:
  """The fixed workload's prompts (made once, outside the timed calls)."""
  return prompts(BATCH, PROMPT_LEN, PROMPT_LEN, seed=0)


def fixed_rollout(replicas, weights, seed: int):
  import jax
  ro = replicas.rollout(weights, fixed_prompts(), group_size=1,
                        max_new_tokens=NEW_TOKENS, eos_id=-1, pad_id=0, key=jax.random.key(seed))
  assert (ro.lengths == NEW_TOKENS).all()
  return ro


def bench_fixed(graphdef, params, reps: int, engines: int, hf=None) -> dict:
  """The fixed workload: transformers (`hf`, if any), one engine and `engines` replicas,
  alternating repetition by repetition."""
  from oapl_jax.sampling import SamplingParams
  sides = {"one": fixed_engines(graphdef, params, 1, PROMPT_LEN + NEW_TOKENS, SamplingParams())}
  if engines > 1:
    sides["replicas"] = fixed_engines(graphdef, params, engines, PROMPT_LEN + NEW_TOKENS,
                                      SamplingParams())
  first, times = {}, {name: [] for name in sides}
  for name, (replicas, weights) in sides.items():
    t0 = time.perf_counter()
    fixed_rollout(replicas, weights, 0)
    first[name] = time.perf_counter() - t0
  for r in range(1, reps + 1):
    if hf is not None:
      hf.rep(r)
    for name, (replicas, weights) in sides.items():
      time.sleep(_SETTLE)
      t0 = time.perf_counter()
      fixed_rollout(replicas, weights, r)
      times[name].append(time.perf_counter() - t0)
  out = {}
  for name, (replicas, weights) in sides.items():
    median = statistics.median(times[name])
    out[name] = {"engines": len(replicas), "slots_per_engine": replicas.engine.max_concurrent_decodes,
                 "tokens_per_s": BATCH * NEW_TOKENS / median, "seconds": median,
                 "seconds_all": times[name], "compile_seconds": first[name] - median,
                 "compiles": _compiles(replicas.engine), **bench_swap(replicas, params)}
  return out


def bench_ours(graphdef, params, reps: int, engines: int, hf=None) -> dict:
  """Our engine on every workload; the fixed one alternates repetitions with `hf` (if any)."""
  import jax
  from oapl_jax.sampling import SamplingParams

  out = {"fixed": bench_fixed(graphdef, params, reps, engines, hf)}
  out["peak_rss_mb_after_fixed"] = peak_rss_mb()
  for name, max_len, sampling in [("cache_1024", 1024, SamplingParams()),
                                  ("cache_4096", 4096, SamplingParams()),
                                  ("top_p", PROMPT_LEN + NEW_TOKENS, _top_p())]:
    replicas, weights = fixed_engines(graphdef, params, 1, max_len, sampling)
    first, median, ro = _timed(lambda r: fixed_rollout(replicas, weights, r), reps)
    out[name] = {"tokens_per_s": BATCH * NEW_TOKENS / median, "seconds": median,
                 "compile_seconds": first - median, "decode_calls": ro.stats["decode_calls"],
                 "cache_capacities_compiled": replicas.engine._generate_steps._cache_size()}
    if name == "cache_4096":
      state = replicas.engine.init_decode_state()
      out["decode_state_mb_cache_4096"] = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
  out["continuous"] = bench_continuous(graphdef, params, reps)
  out["peak_rss_mb"] = peak_rss_mb()
  return out


def bench_swap(replicas, params) -> dict:
  """The lag sync as the trainer does it (`Replicas.load_params`: the snapshot re-laid out into
  every engine's layout on its devices, on device), and the first rollout with it."""
  import jax
  import numpy as np

  snapshot = jax.block_until_ready(jax.tree.map(lambda x: x * 1.01, params))
  host = jax.tree.map(np.asarray, snapshot)
  before = [_compiles(e) for e in replicas.engines]
  t0 = time.perf_counter()
  jax.block_until_ready(replicas.load_params(snapshot, version=1))
  swap_device = time.perf_counter() - t0
  t0 = time.perf_counter()
  weights = jax.block_until_ready(replicas.load_params(host, version=1))
  swap_host = time.perf_counter() - t0
  t0 = time.perf_counter()
  ro = fixed_rollout(replicas, weights, 99)
  first_after = time.perf_counter() - t0
  assert (ro.versions == 1).all()
  return {"swap_seconds_on_device": swap_device, "swap_seconds_from_host": swap_host,
          "recompiled_after_swap": [_compiles(e) for e in replicas.engines] != before,
          "first_rollout_after_swap_seconds": first_after}


def bench_continuous(graphdef, params, reps: int) -> dict:
  import jax
  import numpy as np
  from oapl_jax.sampling import Engine, SamplingParams, rollout

  n_prompts, max_answer = 1024, 256
  work = prompts(n_prompts, 8, 32, seed=1)
  rng = np.random.default_rng(2)
  limits = np.clip((rng.pareto(1.2, n_prompts) + 1) * 12, 1, max_answer).astype(int)
  engine = Engine(graphdef, model_config(), SamplingParams(temperature=1.0), max_slots=SLOTS,
                  max_prefill_length=32, max_len=32 + max_answer,
                  **_engine_settings(max_prefill_batch=8))
  weights = engine.load_params(params)
  go = lambda r: rollout(engine, weights, work, group_size=1, max_new_tokens=max_answer,
                         eos_id=-1, pad_id=0, key=jax.random.key(r), answer_limits=limits)
  first, median, ro = _timed(go, max(1, reps // 2))
  assert (ro.lengths == limits).all()
  return {"prompts": n_prompts, "slots": SLOTS, "answer_tokens": int(limits.sum()),
          "answer_length_mean": float(limits.mean()), "answer_length_p50": float(np.median(limits)),
          "answer_length_max": int(limits.max()), "slot_utilisation": ro.slot_utilisation,
          "queued_slot_utilisation": ro.queued_slot_utilisation,
          "tokens_per_s": float(limits.sum()) / median, "seconds": median,
          "compile_seconds": first - median, "decode_calls": ro.stats["decode_calls"],
          "prefill_calls": ro.stats["prefill_calls"], "compiles": _compiles(engine)}


def hf_child(model_dir: str, requests, replies) -> None:
  """transformers' generate on the exported checkpoint, one repetition per request (its own
  process: its own threads and peak memory). OpenMP threads wait passively (set before torch
  loads): spinning threads on a shared 2-core machine made torch's times erratic (one
  `generate` took 41 s, then 12 s, then 1.6 s)."""
  os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
  import numpy as np
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model.eval()
  ids = torch.tensor(np.array(prompts(BATCH, PROMPT_LEN, PROMPT_LEN, seed=0)))
  kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                pad_token_id=0, eos_token_id=1)
  while (seed := requests.get()) is not None:
    torch.manual_seed(seed)
    time.sleep(_SETTLE)  # the other side's worker threads go idle first
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - t0
    assert out.shape == (BATCH, PROMPT_LEN + NEW_TOKENS)
    replies.put(seconds)
  replies.put({"torch_threads": torch.get_num_threads(), "peak_rss_mb": peak_rss_mb(),
               "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
               "transformers": transformers.__version__, "torch": torch.__version__})


class HFWorker:
  """A child process running `hf_child`; `rep(seed)` runs one generate and records its time."""

  def __init__(self, model):
    from oapl_jax.models import to_hf
    self._dir = tempfile.TemporaryDirectory()
    to_hf(model, self._dir.name)
    ctx = multiprocessing.get_context("spawn")
    self._requests, self._replies = ctx.Queue(), ctx.Queue()
    self._child = ctx.Process(target=hf_child, args=(self._dir.name, self._requests, self._replies))
    self._child.start()
    self.first = self.rep(0)  # loading and first-call costs, not counted
    self.times = []

  def rep(self, seed: int) -> float:
    self._requests.put(seed)
    seconds = self._replies.get(timeout=1800)
    time.sleep(_SETTLE)
    if seed:
      self.times.append(seconds)
    return seconds

  def finish(self) -> dict:
    self._requests.put(None)
    info = self._replies.get(timeout=600)
    self._child.join()
    self._dir.cleanup()
    median = statistics.median(self.times)
    return {"tokens_per_s": BATCH * NEW_TOKENS / median, "seconds": median,
            "first_call_seconds": self.first, **info}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--engines", type=int, default=os.cpu_count(),
                      help="replicas for the fixed workload's sampling.engines side (1: skip it)")
  parser.add_argument("--skip-hf", action="store_true")
  args = parser.parse_args()

  from oapl_jax.placement import request_host_devices
  request_host_devices(args.engines)  # before JAX starts: a host device per engine
  import jax
  from flax import nnx
  from oapl_jax.models import Transformer

  model = Transformer(model_config(), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  hf = None if args.skip_hf else HFWorker(model)
  ours = bench_ours(graphdef, params, args.reps, args.engines, hf)
  result = {"config": {"batch": BATCH, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                       "temperature": 1.0, "reps": args.reps, "jax": jax.__version__,
                       "cpus": os.cpu_count(), "devices": len(jax.devices())},
            "ours": ours}
  if hf is not None:
    result["transformers"] = hf.finish()
  for name, fixed in ours["fixed"].items():
    line = (f"ours   fixed (cache {PROMPT_LEN + NEW_TOKENS}), {fixed['engines']} engine(s) x "
            f"{fixed['slots_per_engine']} slots: {fixed['tokens_per_s']:8.0f} tok/s  "
            f"({fixed['seconds']:.3f} s, compile {fixed['compile_seconds']:.1f} s)")
    if hf is not None:
      fixed["ratio_over_transformers"] = fixed["tokens_per_s"] / result["transformers"]["tokens_per_s"]
      line += f"  -> {fixed['ratio_over_transformers']:.2f}x transformers"
    print(line)
  for size in (1024, 4096):
    c = ours[f"cache_{size}"]
    print(f"ours   fixed (cache {size}): {c['tokens_per_s']:8.0f} tok/s  ({c['seconds']:.3f} s)")
  c = ours["top_p"]
  print(f"ours   fixed, temperature 0.6, top-p 0.95: {c['tokens_per_s']:8.0f} tok/s  ({c['seconds']:.3f} s)")
  if hf is not None:
    print(f"transformers generate:      {result['transformers']['tokens_per_s']:8.0f} tok/s  "
          f"({result['transformers']['seconds']:.3f} s, torch threads "
          f"{result['transformers']['torch_threads']})")
  cb = ours["continuous"]
  print(f"continuous batching: utilisation {cb['slot_utilisation']:.3f} "
        f"({cb['queued_slot_utilisation']:.3f} while prompts queued), "
        f"{cb['tokens_per_s']:.0f} tok/s, {cb['answer_tokens']} tokens "
        f"(mean answer {cb['answer_length_mean']:.0f}, max {cb['answer_length_max']})")
  for fixed in ours["fixed"].values():
    print(f"weight swap into {fixed['engines']} engine(s): {fixed['swap_seconds_on_device'] * 1e3:.1f} ms "
          f"from device, {fixed['swap_seconds_from_host'] * 1e3:.1f} ms from host; recompiled: "
          f"{fixed['recompiled_after_swap']}; first rollout after it "
          f"{fixed['first_rollout_after_swap_seconds']:.3f} s (steady {fixed['seconds']:.3f} s)")
  print(f"peak RSS: ours {ours['peak_rss_mb']:.0f} MB (decode state at cache 4096: "
        f"{ours['decode_state_mb_cache_4096']:.1f} MB)"
        + (f", transformers {result['transformers']['peak_rss_mb']:.0f} MB" if not args.skip_hf else ""))
  print(json.dumps(result, default=str))


if __name__ == "__main__":
  main()
