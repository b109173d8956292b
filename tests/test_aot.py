"""`--dry_run=compile` (oapl_jax/aot.py): every program of a run compiled ahead of time.

On this machine's CPU devices (always), and for a TPU slice by the real TPU compiler where
libtpu can be found: installed in this environment, or in a folder named by OAPL_LIBTPU_DIR
(`pip install --no-deps --target DIR "libtpu==<jax[tpu]'s pin>"`, as .ci/run does); else that
test is skipped with the reason. The TPU test compiles a small model on v5p-8 with the run's
shardings, reads XLA's memory figures and checks the optimized programs for a collective that
moves the whole embedding table or LM head (an all-gather or all-reduce of the full [V, E]).
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import in_ci
from configs import tiny
from oapl_jax import aot, plan
from oapl_jax import config as config_lib
from oapl_jax.errors import ConfigError, UserError
from oapl_jax.topology import TOPOLOGIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _libtpu_path() -> str | None:
  """A PYTHONPATH entry under which libtpu imports ("" if this environment has it), or None."""
  if importlib.util.find_spec("libtpu") is not None:
    return ""
  folder = os.environ.get("OAPL_LIBTPU_DIR")
  if folder and os.path.isdir(os.path.join(folder, "libtpu")):
    return folder
  return None


NO_LIBTPU = ("libtpu not found (install it in this environment, or set OAPL_LIBTPU_DIR to a "
             "`pip install --no-deps --target DIR libtpu==...` folder; .ci/run does)")


def test_compiles_every_program_on_this_machine():
  config = tiny.get_config()
  report = aot.compile_run(config)
  names = [p.name for p in report.programs]
  assert names == ["train step", "refresh", "prefill", "decode @ 14", "decode step"], names
  step = report.programs[0]
  assert step.argument > 0 and step.temp > 0 and step.total >= step.argument + step.temp - step.alias
  # the run's peak holds at least the train step, and the plan's total is within a small factor
  assert report.peak >= step.total
  assert 0.5 < report.peak / report.plan.total < 2.0, (report.peak, report.plan.total)
  text = report.format()
  assert "peak per device: compiled" in text and "train step" in text


def test_capacities_are_the_engines_buckets():
  config = tiny.get_config()
  config.sampling.max_prompt_len, config.sampling.max_new_tokens = 100, 1000  # rows of 1100
  config.sampling.cache_bucket = 256
  assert aot.capacities(config) == [256, 512, 1024, 1100]


def _program(name, where, argument, temp=0, output=0, alias=0):
  return aot.Program(name, where, argument, output, alias, temp, 0.0, 0.0, 0.0)


def test_compiled_peak_keeps_pi_old_where_the_step_does_not_read_it():
  # jit drops an argument its program does not read: a loss that does not score pi_old compiles
  # a train step without it, but the run keeps pi_old (the refresh's argument) all the same
  config = tiny.get_config()
  plan = aot.plan_lib.make_plan(config)
  assert plan.shared and not plan.concurrent  # sync mode: trainer and engine take turns
  progs = [_program("train step", "trainer", 100, temp=50),
           _program("refresh", "trainer", 7, output=9, temp=1),
           _program("decode @ 64", "engine", 30, temp=5),
           _program("decode step", "engine", 30, temp=2)]
  # the trainer's side (train step 150 + pi_old 7) beside the engines' state (30)
  assert aot.compiled_peak(progs, plan, scores_snapshot=False) == 100 + 50 + 7 + 30
  assert aot.compiled_peak(progs, plan, scores_snapshot=True) == 100 + 50 + 30


def test_sampler_plan_counts_the_lane_padded_loop_arrays_only_on_tpu():
  from oapl_jax import plan as plan_lib
  c = tiny.get_config()
  s, v = c.sampling.max_slots, c.model.vocab_size
  cpu = plan_lib.Devices("local cpu", 1, 1, None)
  tpu = plan_lib.Devices("v5p-8", 4, 1, 95 * 2**30)
  assert plan_lib.sampler_bytes(c, cpu) == plan_lib.SAMPLER_COPIES * s * v * 4
  assert plan_lib.sampler_bytes(c, tpu, loop=False) == plan_lib.SAMPLER_COPIES * s * v * 4
  assert plan_lib.sampler_bytes(c, tpu) == 2 * max(s, 128) * v * 4 + 2 * s * v * 4
  c.sampling.top_p = 0.95  # the kept-token mask: two more, and no lane-major loop arrays
  copies = plan_lib.SAMPLER_COPIES + plan_lib.TRUNCATION_COPIES
  assert plan_lib.sampler_bytes(c, tpu) == copies * s * v * 4


def test_libtpu_names_of_the_slices():
  assert aot.libtpu_name(TOPOLOGIES["v5p-64"]) == ("v5:2x4x4", "megacore", (2, 2, 1))
  assert aot.libtpu_name(TOPOLOGIES["v5p-128"]) == ("v5:4x4x4", "megacore", (2, 2, 1))
  assert aot.libtpu_name(TOPOLOGIES["v5e-8"]) == ("v5e:2x4", "default", (2, 4, 1))
  assert aot.libtpu_name(TOPOLOGIES["v6e-256"]) == ("v6e:16x16", "default", (2, 2, 1))
  assert aot.libtpu_name(TOPOLOGIES["v5e-1"]) == ("v5e:1x1", "default", (1, 1, 1))  # Colab's TPU
  with pytest.raises(ConfigError, match="not a single TPU slice"):
    aot.libtpu_name(TOPOLOGIES["v5e-1024"])  # 1024 v5e chips: more than one slice
  with pytest.raises(ConfigError, match="compiles for TPU slices"):
    aot.libtpu_name(TOPOLOGIES["h100x8"])


@pytest.mark.skipif(_libtpu_path() == "", reason="libtpu is importable in this environment, so "
                    "the refusal without it cannot happen here (the TPU compile test runs instead)")
def test_without_libtpu_the_command_says_how_to_get_it():
  with pytest.raises(UserError, match=r"pip install -e '\.\[tpu\]'"):
    aot.tpu_devices(TOPOLOGIES["v5p-8"])


# Run in a child process with libtpu on its path: a small model (V = 1024 so the vocab-split
# table is worth sharding) compiled for v5p-8; prints each program's figures and the
# collectives whose result is a whole [V, E] / [E, V] table. Then the decode loops of the same
# model with head_dim 128 (as the real presets have) and answers of 120 tokens, so that its KV
# cache (128 slots x 128 positions, 67 MB) outweighs the engine's other buffers, and the cache's
# bytes per device.
_TPU_SCRIPT = r"""
import json, re, sys
from configs import tiny
from oapl_jax import aot, plan
c = tiny.get_config()
c.model.vocab_size, c.model.hidden_size, c.model.mlp_dim = 1024, 128, 256
c.mesh.topology = "v5p-8"
report = aot.compile_run(c, keep_hlo=True)
v, e = c.model.vocab_size, c.model.hidden_size
full = re.compile(r"=\s*\(?[a-z0-9]+\[(%d,%d|%d,%d)\]" % (v, e, e, v))
out = {}
for p in report.programs:
  bad = [line.strip()[:200] for line in p.hlo.splitlines()
         if ("all-gather" in line or "all-reduce" in line) and full.search(line)]
  out[p.name] = {"argument": p.argument, "temp": p.temp, "output": p.output,
                 "flops": p.flops, "full_table_collectives": bad, "pallas_calls": p.pallas_calls,
                 "outside_band": p.outside_band()}
c.model.head_dim, c.sampling.max_new_tokens = 128, 120
loops = {p.name: p.temp for p in aot.compile_run(c, only=("decode @",)).programs}
print("REPORT " + json.dumps({"programs": out, "peak": report.peak, "fits": report.fits,
                              "loops": loops, "kv_cache": plan.kv_cache_bytes(c),
                              "text": report.format()}))
"""


def _run_with_libtpu(script: str) -> dict:
  """Runs `script` in a child process with libtpu on its path (skipped without libtpu, failed
  in CI) and returns the JSON it printed after "REPORT "."""
  path = _libtpu_path()
  if path is None:
    if in_ci():  # .ci/run installs libtpu: its absence there is a failure, not a skip
      pytest.fail(f"{NO_LIBTPU}; CI is set", pytrace=False)
    pytest.skip(NO_LIBTPU)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, ROOT) if p),
         "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1200)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[0][len("REPORT "):])


def test_compiles_for_a_tpu_slice_with_the_tpu_compiler():
  report = _run_with_libtpu(_TPU_SCRIPT)
  print(report["text"])
  programs = report["programs"]
  assert {"train step", "refresh", "prefill", "decode step"} <= set(programs)
  # attention "auto" on a TPU slice: the Pallas kernels are in the compiled programs (splash
  # attention forward and backward in the train step, the engine's prefill and decode kernels)
  for name in ("train step", "prefill", "decode step"):
    assert programs[name]["pallas_calls"] >= 1, (name, programs[name]["pallas_calls"])
  assert "Pallas kernels per program: train step" in report["text"]
  # every program within the plan's band, so `--dry_run=compile` passes its check
  assert all(p["outside_band"] is None for p in programs.values()), programs
  for name, p in programs.items():
    assert p["argument"] > 0, (name, p)  # XLA's memory figures were read
  assert programs["train step"]["temp"] > 0 and programs["train step"]["flops"] > 0
  assert report["fits"]
  for name in ("train step", "prefill", "decode step"):
    assert programs[name]["full_table_collectives"] == [], (name, programs[name])
  # The decode loop updates the KV cache in place: no second cache in its temp (before the
  # cache writes of sampling/decode.py kept the cache's layout, XLA:TPU copied the loop's cache
  # in and out of its while loop: temp about the cache's bytes). At 64 positions, fewer than a
  # TPU tile's 128 lanes, the copy is still there (plan.py counts it: `loop_copies_cache`).
  loops, cache = report["loops"], report["kv_cache"]
  assert list(loops) == ["decode @ 64", "decode @ 128"] and cache >= 32 * 2**20, (loops, cache)
  assert loops["decode @ 128"] < cache / 4, (loops, cache)


# The refresh of configs/code.py on its v5p-128 (48 layers of 14B weights; ~1-2 min): one
# layer's weights in transit beside the LM head, as `plan.refresh_bytes` counts. XLA:TPU left
# to itself gathers every layer's weights before laying any out (4.52 GiB per device), and with
# the unfused weights in `EngineLayout.relayout`'s chain it copied them all at the end (1.68);
# a small model does not show it (its gathers are scheduled well either way).
_REFRESH_SCRIPT = r"""
import json
from oapl_jax import aot, config as config_lib
c = config_lib.repo_config("code.py")
c.mesh.topology = "v5p-128"
p = aot.compile_run(c, only=("refresh",)).programs[0]
print("REPORT " + json.dumps({"temp": p.temp, "planned": p.planned_temp}))
"""


def test_the_refresh_of_a_pod_config_holds_one_layer_in_transit():
  report = _run_with_libtpu(_REFRESH_SCRIPT)
  assert abs(report["temp"] / report["planned"] - 1) <= 0.1, report


_SAMPLER_SCRIPT = r"""
import json
from configs import tiny
from oapl_jax import aot
c = tiny.get_config()
c.model.vocab_size, c.model.hidden_size, c.model.mlp_dim = 1024, 128, 256
c.rl.mode, c.mesh.topology, c.sampling.engines, c.sampling.tensor = "remote", "v6e-8", 2, 2
report = aot.compile_run(c, sampler_job=True)
print("REPORT " + json.dumps({"programs": [p.name for p in report.programs],
                              "where": sorted({p.where for p in report.programs}), "peak": report.peak,
                              "largest": max(p.total for p in report.programs), "fits": report.fits,
                              "text": report.format()}))
"""


def test_a_sampler_jobs_programs_compile_for_its_own_slice_with_the_tpu_compiler():
  """A remote sampler job on a v6e-8 (not the trainer's v5p): its prefill and decode programs,
  compiled by libtpu for that slice, the peak being the largest of them."""
  report = _run_with_libtpu(_SAMPLER_SCRIPT)
  print(report["text"])
  assert report["programs"][0] == "prefill" and report["programs"][-1] == "decode step"
  assert all(name.startswith(("prefill", "decode")) for name in report["programs"])
  assert report["where"] == ["engine"] and report["peak"] == report["largest"] > 0 and report["fits"]
  assert "roofline on TPU v6e" in report["text"] and "train step" not in report["text"]


# A LoRA run over an int8 base (model.base_quant) on v5p-8, remat full: the train step (its
# frozen base int8 values and float32 scales as arguments, sharded as the weights) and the
# refresh, compiled by libtpu; the step's base argument bytes against a bf16 base's.
_QUANT_SCRIPT = r"""
import json
from configs import tiny
from oapl_jax import aot
out = {}
for quant in ("int8", "none"):
  c = tiny.get_config("lora")
  c.model.base_quant = quant
  c.model.vocab_size, c.model.hidden_size, c.model.mlp_dim, c.model.dtype = 1024, 256, 512, "bfloat16"
  c.mesh.topology, c.train.remat = "v5p-8", "full"
  report = aot.compile_run(c, only=("train step", "refresh"))
  out[quant] = {p.name: {"argument": p.argument, "temp": p.temp, "pallas_calls": p.pallas_calls,
                         "outside_band": p.outside_band()} for p in report.programs}
  out[quant]["planned base"] = {i.name: i.nbytes for i in report.plan.items}["frozen base"]
print("REPORT " + json.dumps(out))
"""


def test_a_step_over_an_int8_base_compiles_for_a_tpu_slice_with_the_tpu_compiler():
  report = _run_with_libtpu(_QUANT_SCRIPT)
  print(report)
  q, plain = report["int8"], report["none"]
  planned = plain.pop("planned base") - q.pop("planned base")
  assert set(q) == {"train step", "refresh"}
  assert q["train step"]["pallas_calls"] >= 1 and all(p["outside_band"] is None for p in q.values()), q
  # the step's arguments: the base's projections at 1 byte (+ scales) where the bf16 base has 2,
  # as the planner counts them up to TPU tiling (measured: 276,480 B saved, 234,496 planned)
  saved = plain["train step"]["argument"] - q["train step"]["argument"]
  assert 0.8 * planned <= saved <= 1.25 * planned and saved > 0.2 * plain["train step"]["argument"], (
      saved, planned, q, plain)


def test_a_program_outside_the_plans_band_fails_the_compile_check_in_one_line():
  """`--dry_run=compile` refuses a run whose compiled programs the plan misjudges (aot.PLAN_BAND,
  aot.PLAN_FLOOR; docs/memory.md): compiled here for this machine's CPU, then one program's temp
  set past the band."""
  import dataclasses  # noqa: PLC0415
  c = config_lib.repo_config("tiny.py")
  report = aot.compile_run(c)
  report.check()  # as compiled: within the band
  assert all(p.outside_band() is None for p in report.programs)
  train = next(p for p in report.programs if p.name == "train step")
  edge = int(aot.PLAN_BAND * train.planned + aot.PLAN_FLOOR)
  inside = dataclasses.replace(train, argument=train.planned_argument, temp=train.planned_temp + edge - 1)
  outside = dataclasses.replace(train, argument=train.planned_argument, temp=train.planned_temp + edge + 1)
  assert inside.outside_band() is None and outside.outside_band() is not None
  report.programs[report.programs.index(train)] = outside
  with pytest.raises(plan.PlanError) as e:
    report.check()
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(f"compiled for {report.topology}, the train step compiles to ")
  assert "outside the plan's band (+-15% + 64 MiB: docs/memory.md)" in str(e.value)
  assert "1 program(s) OUTSIDE the plan's band" in report.format()


def _packed_tiny(pack_rows: int):
  c = tiny.get_config()
  c.rl.groups_per_step, c.rl.group_size = 2, 2  # 4 answers in 2 groups
  c.train.packing, c.train.pack_rows = True, pack_rows
  return c


def test_packing_flops_count_what_each_process_packs():
  """Answers of 3 + 4 and 2 + 4 tokens (two groups; rows of 14): one process packs all four into one row
  of its two; over two processes each packs its group into its one row. Either way one
  micro-batch runs, every position of its rows computed, attention over each segment and each
  row's trailing padding."""
  c = _packed_tiny(2)
  s = plan.seq_len(c)
  lengths = np.array([3, 4, 2, 4])
  segments = (9 + 16 + 4 + 16) / 2
  for processes, padding in ((1, [s - 13, s]), (2, [s - 7, s - 6])):
    cost = aot.packing_flops(c, lengths, processes)
    assert (cost["packed"]["micro_batches"], cost["packed"]["rows"], cost["real_tokens"]) == (1, 2, 13)
    pairs = segments + sum(p * p for p in padding) / 2
    assert cost["packed"]["flops"] == aot.model_flops(c, tokens=2 * (s - 1), pairs=pairs), processes
  assert cost["padded"]["flops"] == aot.model_flops(c)
  with pytest.raises(ConfigError, match="train.pack_rows: 3 packed rows"):
    aot.packing_flops(_packed_tiny(3), lengths, 2)


def test_the_packed_step_compiles_and_prints_both_layouts():
  report = aot.compile_run(_packed_tiny(2))
  assert report.programs[0].name == "train step" and report.programs[0].temp > 0
  text = "\n".join(report.packing_lines(1e12))
  # rows of 14 tokens hold one of these answers (5-10 tokens) each: 2 micro-batches of 2 rows
  assert "train.packing=True" in text and "padded: 1 micro-batch(es) of 4 x 13 positions" in text
  assert "packed: 2 of 2 micro-batch(es) of 2 x 13 positions" in text
