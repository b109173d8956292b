"""Google Tunix's native JAX sampler on `benchmarks/sampler.py`'s fixed workload (CPU).

Run it with the Python of a separate venv that has Tunix (it does not import `oapl_jax`):

  python3 -m venv tunix-venv && tunix-venv/bin/pip install google-tunix
  # identical weights: our model (benchmarks/sampler.py's config, nnx.Rngs(0)) as an HF folder
  python -c "import sys; sys.path.insert(0, 'benchmarks'); from flax import nnx; \
    from oapl_jax.models import Transformer, to_hf; from sampler import model_config; \
    to_hf(Transformer(model_config(), rngs=nnx.Rngs(0)), '/tmp/tiny_qwen3_hf')"
  tunix-venv/bin/python benchmarks/tunix_sampler.py --reps 9 --hf-dir /tmp/tiny_qwen3_hf \
      --ours-python "$(which python)"
  tunix-venv/bin/python benchmarks/tunix_sampler.py [--reps 5] [--cache-sizes 160,1024]
      [--hf-dir DIR] [--ours-python PATH/TO/PROJECT/VENV/bin/python]

Workload: the tiny Qwen3 of `benchmarks/sampler.py` (vocab 1024, hidden 256, 4 layers, 4 query /
2 KV heads of 64, MLP 768, QK-norm, tied embeddings, float32); 32 prompts x 32 random token ids
(the same ids as `sampler.prompts(32, 32, 32, seed=0)`), exactly 128 new tokens each (no EOS),
temperature 1, no top-p / top-k.

Tunix: `tunix.models.qwen3.model.Qwen3` built from a `ModelConfig` with that shape, random
weights (`nnx.Rngs(0)`) or, with `--hf-dir`, the HF checkpoint that `oapl_jax.models.to_hf`
wrote for our model (so both sides run identical weights), through
`tunix.generate.sampler.Sampler` with a KV cache of each `--cache-sizes` (at least 32 + 128 = 160,
which Tunix requires). Sampler wants strings and a tokenizer: a shim maps "12 7 901" <-> ids.
`top_p=1.0, top_k=None, temperature=1.0` is Tunix's plain categorical sampling (`top_p=None`
would be greedy). The timed region is one whole `Sampler.__call__`: state init, prefill
(jitted), the decode `while_loop` (jitted), the device-to-host copy and per-row host post-
processing, as in our benchmark (whole `rollout` call). Compile time = first call minus the
median warm call. A second, separate pass times prefill and decode apart (block_until_ready) to
give the decode step time.

With `--ours-python`, a child process of that interpreter runs our engine on the same prompts,
as `benchmarks/sampler.py` does for its fixed workload (with a cache of max_len = the same
size), once per `--ours-engines` count: 1 = one `Engine` with 32 slots; N = `sampling.engines=N`
(N engines of 32 / N slots, one per host device: the child asks JAX for N). All sides alternate
repetition by repetition, so that they see the same machine load. Tunix runs as shipped, in
one process with JAX's default single CPU device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH, PROMPT_LEN, NEW_TOKENS, SLOTS = 32, 32, 128, 32
_SETTLE = 0.3  # seconds of idleness before each alternating repetition
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
  """Same as `benchmarks/sampler.py`'s `prompts`."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 1024, rng.integers(lo, hi + 1))] for _ in range(n)]


class IdTokenizer:
  """Token ids in, ids out: "3 17 1000" <-> [3, 17, 1000]. bos 0 (falsy: none prepended),
  pad 0, eos -1 (never sampled)."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self) -> int:
    return 0

  def eos_id(self) -> int:
    return -1

  def pad_id(self) -> int:
    return 0


def tunix_config():
  import jax.numpy as jnp
  from tunix.models.qwen3 import model as qwen3
  return qwen3.ModelConfig(num_layers=4, vocab_size=1024, embed_dim=256, hidden_dim=768,
                           num_heads=4, head_dim=64, num_kv_heads=2, rope_theta=1_000_000,
                           norm_eps=1e-6, use_tied_embedding=True, dtype=jnp.float32,
                           param_dtype=jnp.float32)


def build_model(hf_dir: str | None):
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  if hf_dir:
    from tunix.models.qwen3 import params as qwen3_params
    return qwen3_params.create_model_from_safe_tensors(hf_dir, tunix_config())
  return qwen3.Qwen3(tunix_config(), rngs=nnx.Rngs(0))


_OURS_WORKER = r"""
import json, sys, time
sys.path.insert(0, {repo!r}); sys.path.insert(0, {repo!r} + "/benchmarks")
from oapl_jax.placement import request_host_devices
request_host_devices({max_engines})
import jax
from flax import nnx
from sampler import fixed_engines, fixed_rollout, model_config
from oapl_jax.models import Transformer
from oapl_jax.sampling import SamplingParams
graphdef, params = nnx.split(Transformer(model_config(), rngs=nnx.Rngs(0)), nnx.Param)
sides = {{}}
print(json.dumps({{"ready": True, "jax": jax.__version__, "devices": len(jax.devices())}}), flush=True)
for line in sys.stdin:
  cache, engines, r = map(int, line.split())
  if (cache, engines) not in sides:
    sides[cache, engines] = fixed_engines(graphdef, params, engines, cache, SamplingParams())
  replicas, weights = sides[cache, engines]
  time.sleep({settle})
  t0 = time.perf_counter()
  ro = fixed_rollout(replicas, weights, r)
  dt = time.perf_counter() - t0
  print(json.dumps({{"seconds": dt, "decode_calls": ro.stats["decode_calls"]}}), flush=True)
"""


class Ours:
  """Our engine in a child process of another interpreter (the oapl_jax venv)."""

  def __init__(self, python: str, max_engines: int):
    code = _OURS_WORKER.format(repo=REPO, settle=_SETTLE, max_engines=max_engines)
    self._p = subprocess.Popen([python, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=REPO)
    self.info = self._read()

  def _read(self) -> dict:
    while True:
      line = self._p.stdout.readline()
      if not line:
        raise RuntimeError("our engine's worker died")
      if line.startswith("{"):
        return json.loads(line)

  def rep(self, cache: int, engines: int, seed: int) -> dict:
    self._p.stdin.write(f"{cache} {engines} {seed}\n")
    self._p.stdin.flush()
    return self._read()

  def close(self):
    self._p.stdin.close()
    self._p.wait(timeout=60)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--cache-sizes", default=f"{PROMPT_LEN + NEW_TOKENS},1024")
  parser.add_argument("--hf-dir", default=None,
                      help="HF checkpoint of our model (oapl_jax.models.to_hf): identical weights")
  parser.add_argument("--ours-python", default=None,
                      help="interpreter with oapl_jax: alternate with our engine rep by rep")
  parser.add_argument("--ours-engines", default=f"1,{os.cpu_count()}",
                      help="our sides: engine replicas (sampling.engines), each a host device")
  args = parser.parse_args()

  import jax
  import numpy as np
  import tunix
  from tunix.generate import sampler as sampler_lib

  try:
    from importlib.metadata import version
    tunix_version = version("google-tunix")
  except Exception:  # pragma: no cover
    tunix_version = getattr(tunix, "__version__", "?")

  t0 = time.perf_counter()
  model = build_model(args.hf_dir)
  build_seconds = time.perf_counter() - t0
  work = prompts(BATCH, PROMPT_LEN, PROMPT_LEN, seed=0)
  texts = [" ".join(map(str, p)) for p in work]
  ours_engines = sorted({int(n) for n in args.ours_engines.split(",")})
  ours = Ours(args.ours_python, max(ours_engines)) if args.ours_python else None
  tokens = BATCH * NEW_TOKENS
  result = {"config": {"batch": BATCH, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                       "temperature": 1.0, "reps": args.reps, "jax": jax.__version__,
                       "tunix": tunix_version, "cpus": os.cpu_count(),
                       "weights": "hf:" + args.hf_dir if args.hf_dir else "random",
                       "model_build_seconds": build_seconds}, "runs": {}}

  for cache in [int(c) for c in args.cache_sizes.split(",")]:
    smp = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
        cache_size=cache, num_layers=4, num_kv_heads=2, head_dim=64))

    def call(seed: int):
      out = smp(texts, max_generation_steps=NEW_TOKENS, max_prompt_length=PROMPT_LEN,
                temperature=1.0, top_p=1.0, top_k=None, eos_tokens=[-1], seed=seed, echo=False)
      assert all(len(t) == NEW_TOKENS for t in out.tokens), [len(t) for t in out.tokens]
      return out

    t0 = time.perf_counter()
    call(0)
    first = time.perf_counter() - t0
    ours_first, ours_times = {}, {n: [] for n in ours_engines}
    for n in ours_engines if ours else ():
      t0 = time.perf_counter()
      ours.rep(cache, n, 0)
      ours_first[n] = time.perf_counter() - t0
    times = []
    for r in range(1, args.reps + 1):
      for n in ours_engines if ours else ():
        ours_times[n].append(ours.rep(cache, n, r)["seconds"])
        time.sleep(_SETTLE)
      t0 = time.perf_counter()
      call(r)
      times.append(time.perf_counter() - t0)
    median = statistics.median(times)

    # Prefill and decode apart (not alternated): the decode step time.
    pre, dec = [], []
    ids = jax.numpy.array(np.array(work, dtype=np.int32))
    smp.eos_ids = jax.numpy.array([-1])
    for r in range(max(3, args.reps)):
      state = smp.init_sample_state(ids, total_sampling_steps=PROMPT_LEN + NEW_TOKENS,
                                    include_logits=False, forbidden_token_ids=None,
                                    temperature=1.0, top_p=1.0, top_k=None,
                                    seed=jax.random.PRNGKey(r), beam_size=None)
      jax.block_until_ready(state)
      params = smp._flattened_transformer_state
      t0 = time.perf_counter()
      state = jax.block_until_ready(smp._compiled_prefill_fn(params, state, None, echo=False))
      t1 = time.perf_counter()
      steps0 = int(state.decoding_step)
      t1b = time.perf_counter()
      state = jax.block_until_ready(smp._compiled_decode_fn(params, state))
      t2 = time.perf_counter()
      steps = int(state.decoding_step) - steps0
      pre.append(t1 - t0)
      dec.append((t2 - t1b) / steps)

    run = {"cache_size": cache, "tokens_per_s": tokens / median, "seconds": median,
           "seconds_all": times, "compile_seconds": first - median,
           "prefill_seconds": statistics.median(pre), "decode_step_ms": 1e3 * statistics.median(dec),
           "decode_steps_per_call": steps}
    line = (f"tunix  cache {cache:5d}: {run['tokens_per_s']:8.0f} tok/s  ({median:.3f} s, compile "
            f"{run['compile_seconds']:.1f} s, prefill {run['prefill_seconds'] * 1e3:.1f} ms, "
            f"decode step {run['decode_step_ms']:.2f} ms)")
    for n in ours_engines if ours else ():
      om = statistics.median(ours_times[n])
      run[f"ours_{n}_engines"] = {"tokens_per_s": tokens / om, "seconds": om,
                                  "seconds_all": ours_times[n], "slots_per_engine": SLOTS // n,
                                  "compile_seconds": ours_first[n] - _SETTLE - om,
                                  "ratio_over_tunix": median / om}
      line += (f"\nours   cache {cache:5d}, {n} engine(s) x {SLOTS // n} slots: {tokens / om:8.0f} "
               f"tok/s  ({om:.3f} s)  -> {median / om:.2f}x tunix")
    print(line, flush=True)
    result["runs"][str(cache)] = run
  if ours:
    result["ours_worker"] = ours.info
    ours.close()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
