"""A SIGTERM / Ctrl-C stops the command wherever it lands (workdir.StopSignals, errors.Interrupted).

The handler raises `Interrupted` in the main thread; code that guards its own failures with
`except Exception` must let it through. JAX's compiler does so around its persistent cache
reads: with `Interrupted` an `Exception`, a signal landing there was logged as an unreadable
cache entry and the command went on (a SIGTERM'd sampler finished its rollout; issue 59)."""

import os
import subprocess
import sys
import textwrap

from oapl_jax.errors import Interrupted, UserError

# The signal is sent from inside JAX's cache read (the one place timing is forced): the real
# handler raises there, and JAX's own `except Exception` around the read either lets it through
# (the command stops: exit 143) or logs it and compiles on (exit 0, "went on").
_PROBE = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp
    from jax._src import compilation_cache
    from oapl_jax.workdir import Interrupted, StopSignals
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    real, reads = compilation_cache.get_executable_and_time, []
    def read(*args, **kwargs):
      reads.append(1)
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(1000):  # the handler runs here, between bytecodes
        pass
      return real(*args, **kwargs)
    compilation_cache.get_executable_and_time = read
    with StopSignals():
      try:
        jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()
      except Interrupted as e:
        print("stopped after", len(reads), "cache read")
        sys.exit(e.exit_code)
    print("went on after", len(reads), "cache reads")
""")


def test_a_signal_during_a_compilation_cache_read_stops_the_command(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "cache")], env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 143, done.stdout + done.stderr
  assert done.stdout.strip() == "stopped after 1 cache read"


def test_interrupted_is_not_an_exception_so_guards_let_it_through():
  """A reward's, a restore's or a library's `except Exception` does not take a stop for its
  own failure; the commands still print it as one line (errors.run_command)."""
  caught = None
  try:
    try:
      raise Interrupted(15, "stopped by SIGTERM")
    except Exception:  # noqa: BLE001 - the guard under test
      caught = "by the guard"
  except Interrupted as e:
    caught = e.exit_code
  assert caught == 143
  assert not issubclass(Interrupted, UserError)


# A command stopped by SIGTERM inside library code whose cleanup then fails: tqdm's first write
# makes its lock lazily; the signal landing there left `_lock` unset and tqdm's `finally` raised
# AttributeError over the stop (a CI run's sampler job exited 1 with a traceback, not 143).
_MASKED = textwrap.dedent("""
    import os, signal
    from oapl_jax import errors
    from oapl_jax.workdir import StopSignals

    class Library:
      def write(self):
        try:
          os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Interrupted here
          for _ in range(1000):
            pass
        finally:
          self._lock.release()  # never made: AttributeError, raised while handling the stop

    def main(argv):
      with StopSignals():
        Library().write()
      print("went on")

    errors.run_command(main)
""")


def test_a_stop_whose_library_cleanup_fails_is_still_one_line_and_143():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", _MASKED], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 143, done.stdout + done.stderr
  assert done.stderr.strip().splitlines() == ["error: stopped by SIGTERM"], done.stderr
  # a bug whose own exception is not raised while handling a stop keeps its traceback
  bug = _MASKED.replace("os.kill(os.getpid(), signal.SIGTERM)", "pass")
  done = subprocess.run([sys.executable, "-c", bug], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1 and "AttributeError" in done.stderr and "Traceback" in done.stderr, done.stderr


# A process started with SIGINT ignored (a job a script starts with `&`, as .ci/run's and the
# study launchers' are) keeps ignoring it inside StopSignals, as Python itself does; SIGTERM, the
# launchers' way to stop their jobs, still stops it.
_IGNORED = textwrap.dedent("""
    import os, signal, sys, time
    from oapl_jax.workdir import Interrupted, StopSignals
    with StopSignals():
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.2)
      print("went on after SIGINT")
      try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
      except Interrupted as e:
        print("stopped by signal", e.signum)
    print("handlers restored:", signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
          sys.unraisablehook is sys.__unraisablehook__)
""")


def test_a_signal_ignored_at_start_stays_ignored_and_sigterm_still_stops():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "os.execv(sys.argv[1], sys.argv[1:])")  # as `&` in a script starts a job
  done = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-c", _IGNORED], env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stdout.splitlines() == ["went on after SIGINT", "stopped by signal 15",
                                      "handlers restored: True True"], done.stdout
