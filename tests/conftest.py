"""Shared fixtures: a tiny random model, the smoke config, `requires_sandbox`, `requires_torch` and
`requires_peft`; `start_session` for the runs a test starts in the background, none left running
when it ends."""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile

# One persistent XLA compilation cache for the whole test session, fresh per session, inherited
# by the runs tests start as subprocesses: the many tests that run the same tiny configs
# compile each program once. (Loaded executables run the same code and keep their
# memory_analysis; jit's in-process caches, which the no-recompile tests count, are unchanged.)
# OAPL_TEST_COMPILE_CACHE=0 turns it off.
if os.environ.get("OAPL_TEST_COMPILE_CACHE", "1") != "0":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="oapl_jax_test_xla_cache_"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402 (after the cache settings, which jax reads at import)
import pytest
from flax import nnx

from configs import tiny
from oapl_jax.models import ModelConfig, Transformer

NO_BWRAP = "bubblewrap (bwrap) not installed: apt-get install bubblewrap"
NO_SANDBOX = f"{NO_BWRAP}; set CI=true or OAPL_REQUIRE_SANDBOX=1 to make this a failure"


def in_ci() -> bool:
  """Whether `CI` is set (not "", "false" or "0"), as CI services and `.ci/run` runs do: what
  .ci/run installs (bubblewrap, libtpu) is then required, and its absence a failure."""
  return os.environ.get("CI", "").strip().lower() not in ("", "false", "0")


def sandbox_required() -> bool:
  """Whether a missing bwrap fails the sandbox tests: `in_ci()`, or `OAPL_REQUIRE_SANDBOX=1`."""
  return in_ci() or os.environ.get("OAPL_REQUIRE_SANDBOX") == "1"


@pytest.fixture
def requires_sandbox():
  """For tests that run programs in the code reward's sandbox: without bubblewrap they skip
  with NO_SANDBOX as the reason, or fail where `sandbox_required()`. (The reward itself
  always refuses to run unsandboxed unless told to; those tests run everywhere.)"""
  if shutil.which("bwrap") is not None:
    return
  if sandbox_required():
    pytest.fail(f"{NO_BWRAP} (a failure, not a skip: CI or OAPL_REQUIRE_SANDBOX=1 is set)",
                pytrace=False)
  pytest.skip(NO_SANDBOX)


# torch: the reference the HF tests compare against (transformers' PyTorch models). .ci/run's
# Python 3.12 venv (the newest JAX) has none on purpose: torch has no CPU wheel for 3.12 on these
# machines, and any other build is a multi-GB CUDA one. There OAPL_NO_TORCH=1 turns the tests
# that need torch into skips; anywhere else a missing torch fails them.
NO_TORCH = ("torch not installed, on purpose: OAPL_NO_TORCH=1 (.ci/run's Python 3.12 venv, the "
            "newest JAX, has no CPU torch wheel); the main venv runs this test")


def torch_may_be_missing() -> bool:
  """Whether OAPL_NO_TORCH=1: this venv lacks torch on purpose, and the tests needing it skip."""
  return os.environ.get("OAPL_NO_TORCH") == "1"


@pytest.fixture
def requires_torch():
  """For tests whose subprocess or notebook needs torch: without it they skip with NO_TORCH as
  the reason where OAPL_NO_TORCH=1, and fail anywhere else."""
  if importlib.util.find_spec("torch") is not None:
    return
  if torch_may_be_missing():
    pytest.skip(NO_TORCH)
  pytest.fail("torch is not installed (pip install -e '.[test]'); a failure, not a skip: only "
              "OAPL_NO_TORCH=1 makes it a skip, for a venv without torch on purpose", pytrace=False)


# peft (the test extra, beside torch): tests/test_lora.py loads an exported adapter with it.
NO_PEFT = "peft not installed (pip install -e '.[test]'); set CI=true to make this a failure"


@pytest.fixture
def requires_peft(requires_torch):
  """For tests that load an adapter with peft (which needs torch: `requires_torch` first): without
  peft they skip with NO_PEFT as the reason, or fail where `in_ci()` (.ci/run installs it)."""
  if importlib.util.find_spec("peft") is not None:
    return
  if in_ci():
    pytest.fail("peft is not installed (pip install -e '.[test]'); a failure, not a skip: CI is set",
                pytrace=False)
  pytest.skip(NO_PEFT)


def with_default_sigint(argv: list[str]) -> list[str]:
  """`argv` started with SIGINT's default action, as a terminal's foreground job has: a suite
  started in the background (`bash .ci/run &`) ignores SIGINT, its processes inherit that, and
  then a command keeps ignoring it (Python, and workdir.StopSignals). A small launcher sets it and
  execs `argv` in the same process (not `preexec_fn`: a fork of the multithreaded test process)."""
  launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "os.execv(sys.argv[1], sys.argv[1:])")
  return [sys.executable, "-c", launcher, *argv]


# The background runs of the test in progress (trainers, sampler jobs, launchers): `start_session`
# adds them, `_no_process_left` kills what is still running when the test ends.
_STARTED: list[subprocess.Popen] = []


def start_session(argv, **popen) -> subprocess.Popen:
  """`subprocess.Popen(argv, **popen)` as the leader of a new session, killed with all its
  children (its process group) when the test ends if still running: a test that fails midway
  leaves no trainer, sampler job (which would wait for its trainer up to --max_idle_s) or
  launcher behind."""
  proc = subprocess.Popen(argv, start_new_session=True, **popen)
  _STARTED.append(proc)
  return proc


@pytest.fixture(autouse=True)
def _no_process_left():
  yield
  while _STARTED:
    proc = _STARTED.pop()
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()


@pytest.fixture(scope="session")
def small_model():
  """(cfg, graphdef, params) of a random model with sharp logits, so top-p really truncates."""
  cfg = ModelConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, qk_norm=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.embed[...] = model.embed[...] * 15.0  # std 0.3: peaked next-token distributions
  graphdef, params = nnx.split(model, nnx.Param)
  return cfg, graphdef, params


@pytest.fixture
def smoke_config():
  return tiny.get_config("smoke")
