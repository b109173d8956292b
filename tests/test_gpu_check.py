"""benchmarks/gpu_check.py --dry: CPU, tiny shapes; the keys of the GPU run, every figure finite
and positive, with the packages a prepared GPU image lacks (TensorFlow, JetStream, seqio, orbax,
ml_collections, clu, ...) made unimportable."""

import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSENT = ("tensorflow", "tensorflow_datasets", "jetstream", "seqio", "orbax", "ml_collections",
          "clu", "math_verify", "pyarrow", "tokenizers", "transformers", "torch")
# The script (not its transformers child) under an import hook that refuses ABSENT; afterwards,
# the ABSENT modules that were imported anyway (the ml_collections stand-in is not one).
_WRAPPER = f"""
import json, runpy, sys
ABSENT = {ABSENT!r}
class Refuse:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ABSENT:
      raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)
    return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["benchmarks/gpu_check.py", "--dry"]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
loaded = sorted({{m.split(".")[0] for m, mod in sys.modules.items()
                 if getattr(mod, "__file__", None)}} & set(ABSENT))
print("IMPORTED " + json.dumps(loaded))
"""

KEYS = {"mode", "device", "jax", "flax", "torch", "transformers", "config_source", "model",
        "params", "matmul_peak_tflops", "matmul_n", "train_step", "decode", "peak_memory_gib",
        "seconds"}
TRAIN_KEYS = {"rows", "tokens_per_row", "params", "step_seconds", "compile_seconds",
              "tokens_per_s", "model_tflops_per_step", "achieved_tflops", "mfu"}
DECODE_KEYS = {"slots", "new_tokens", "engine_tokens_per_s", "hf_tokens_per_s", "engine_vs_hf",
               "bandwidth_gbs", "bytes_per_step_mean", "bandwidth_limit_tokens_per_s",
               "engine_fraction_of_limit"}


def _positive_numbers(d: dict, keys: set) -> None:
  for k in keys:
    assert isinstance(d[k], (int, float)) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


def test_dry_run_prints_the_keys_with_finite_positive_figures(requires_torch):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  start = time.perf_counter()
  out = subprocess.run([sys.executable, "-c", _WRAPPER], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
  seconds = time.perf_counter() - start
  assert out.returncode == 0, out.stderr[-3000:]
  text, _, imported = out.stdout.rpartition("IMPORTED ")
  assert json.loads(imported) == [], imported  # only the spawned transformers child used torch
  r = json.loads(text)
  print(f"\ngpu_check --dry: {seconds:.0f} s wall (script: {r['seconds']:.0f} s)")
  assert KEYS <= set(r), KEYS - set(r)
  assert r["mode"] == "dry" and r["config_source"].startswith("stand-in")
  assert r["train_step"]["loss_finite"] and r["train_step"]["rows"] == 4
  _positive_numbers(r, {"matmul_peak_tflops", "params", "seconds"})
  _positive_numbers(r["train_step"], TRAIN_KEYS)
  _positive_numbers(r["decode"], DECODE_KEYS)
  _positive_numbers(r["peak_memory_gib"], {"jax", "torch"})
  assert r["train_step"]["mfu"] < 1 and r["decode"]["engine_fraction_of_limit"] < 1
