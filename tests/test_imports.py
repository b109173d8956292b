"""No TensorFlow, no seqio: `import oapl_jax` and a tiny run (trainer and engine) load neither.

JetStream's `engine_api` imports seqio and through it TensorFlow (seconds of start-up, ~0.6 GiB
resident), and clu's TensorBoard writer is `tf.summary`: the engine imports JetStream only in
`sampling/jetstream_adapter.py`, metrics write TensorBoard events with tensorboard's own protos,
and TFDS is imported only when a `tfds:` source is read. Each check runs in a fresh process,
since this test session may have loaded TensorFlow already.
"""

import json
import subprocess
import sys

HEAVY = ("tensorflow", "seqio")

# Runs its argv[1:] as `python -m oapl_jax.main ...` (or only imports oapl_jax without
# arguments), then prints the top-level HEAVY modules in sys.modules as one JSON line.
_DRIVER = f"""
import json, runpy, sys
args = sys.argv[1:]
if args:
  sys.argv = ["oapl_jax.main", *args]
  try:
    runpy.run_module("oapl_jax.main", run_name="__main__")
  except SystemExit as e:
    if e.code:
      raise
else:
  import oapl_jax
print("LOADED " + json.dumps(sorted(m for m in sys.modules if m in {HEAVY!r})))
"""


def _loaded(*args, timeout=900) -> list[str]:
  """The HEAVY modules a fresh process has loaded after running the driver with `args`."""
  out = subprocess.run([sys.executable, "-c", _DRIVER, *args], capture_output=True, text=True,
                       timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("LOADED ")][-1]
  return json.loads(line[len("LOADED "):])


def test_import_loads_no_tensorflow():
  assert _loaded() == []


def test_tiny_run_loads_no_tensorflow(tmp_path):
  """The smoke run: warm-up, eval (engine + rollout), OAPL steps, checkpoints, metrics with
  TensorBoard events, eval after."""
  workdir = tmp_path / "run"
  assert _loaded("--config=configs/tiny.py:smoke", f"--workdir={workdir}") == []
  assert any(p.name.startswith("events.out.tfevents") for p in workdir.iterdir())
