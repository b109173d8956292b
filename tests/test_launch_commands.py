"""Every `python -m oapl_jax...` command in launch/, README.md, configs/, docs/ and the package's
docstrings parses against the code: its config file exists, every `--config.X=Y` names a
setting of that config, and every other flag is one the module defines. A renamed setting or
flag therefore fails here instead of leaving a stale launch line (tests at the bottom prove it
on wrong lines).

Reading a command: backslash-continued lines are joined; the words after `-m oapl_jax...` up to
the end of the shell command (`;`, `&&`, `|`, `>`, `#` comment, a closing backtick) are split
like a shell would; `${VAR:-default}` reads as its default. Placeholders are not checked: a
config given as a variable (`"$config"`), `...` or `<name>` (then neither are its overrides).
Flags are read from the module's source and the oapl_jax modules it imports (absl `DEFINE_*`,
argparse `add_argument`), plus absl's own and `--verbose` of `errors.run_command`.
"""

import glob
import os
import re
import shlex
import subprocess
import time

import pytest

from oapl_jax import config as config_lib
from oapl_jax.studies.definitions import STUDIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "verbosity", "v",
              "logtostderr", "alsologtostderr", "log_dir", "stderrthreshold", "showprefixforinfo"}


def documents() -> list[str]:
  """The files whose commands are checked (paths relative to the repository)."""
  paths = [p for p in sorted(glob.glob(os.path.join(REPO, "launch", "*"))) if os.path.isfile(p)]
  paths += [os.path.join(REPO, "README.md")]
  paths += sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
  paths += sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
  paths += sorted(glob.glob(os.path.join(REPO, "oapl_jax", "**", "*.py"), recursive=True))  # docstrings
  return [os.path.relpath(p, REPO) for p in paths]


def logical_lines(text: str):
  """(line number, line) with backslash continuations joined."""
  pending, start = "", None
  for number, line in enumerate(text.splitlines(), 1):
    start = start or number
    stripped = line.rstrip()
    if stripped.endswith("\\"):
      pending += stripped[:-1].lstrip("# ") + " " if pending else stripped[:-1] + " "
      continue
    yield start, pending + (line.lstrip("# ") if pending else line)
    pending, start = "", None
  if pending:
    yield start, pending


def _words(rest: str) -> list[str]:
  rest = rest.split("`")[0]  # an inline code span ends the command
  rest = re.sub(r"<(\w+)>", r"@\1@", rest)  # a <placeholder>, not a redirection
  try:
    lexer = shlex.shlex(rest, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
  except ValueError:  # an unbalanced quote (a command quoted inside another): split plainly
    words = [w.strip("'\"") for w in rest.split()]
  out = []
  for w in words:
    if w and set(w) <= set(";&|<>()") or w.startswith("#"):
      break
    out.append(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", w))
  return out


def commands(text: str):
  """(line number, module, words) of every `-m oapl_jax...` command in `text`."""
  for number, line in logical_lines(text):
    for m in re.finditer(r"-m\s+(oapl_jax(?:\.\w+)*)", line):
      yield number, m.group(1), _words(line[m.end():])


def _module_file(module: str) -> str | None:
  base = os.path.join(REPO, *module.split("."))
  for path in (base + ".py", os.path.join(base, "__main__.py"), os.path.join(base, "__init__.py")):
    if os.path.isfile(path):
      return path
  return None


def module_flags(module: str, seen: set | None = None) -> set[str]:
  """Flag names `python -m module` accepts (see the module docstring)."""
  seen = set() if seen is None else seen
  path = _module_file(module)
  if path is None or path in seen:
    return set()
  seen.add(path)
  source = open(path).read()
  names = set(re.findall(r"DEFINE\w*\(\s*(?:\w+\(\),\s*)?[\"'](\w+)[\"']", source))  # DEFINE(parser(), "name"
  names |= {n.lstrip("-").replace("-", "_") for n in re.findall(r"add_argument\(\s*[\"'](--[\w-]+)[\"']", source)}
  names |= {n.lstrip("-") for n in re.findall(r"add_argument\(\s*[\"'](--[\w-]+)[\"']", source)}
  if "run_command(" in source:
    names.add("verbose")
  if "absl" in source:
    names |= ABSL_FLAGS
  imported = re.findall(r"^\s*from (oapl_jax(?:\.\w+)*) import ([\w, ]+)", source, re.M)
  for package, items in imported:
    for name in [package] + [f"{package}.{i.split()[0]}" for i in items.split(",") if i.strip()]:
      names |= module_flags(name, seen)
  for name in re.findall(r"^\s*import (oapl_jax(?:\.\w+)*)", source, re.M):
    names |= module_flags(name, seen)
  return names


def _placeholder(value: str) -> bool:
  return any(s in value for s in ("$", "...", "@", "[", "{"))


def _has_setting(c, dotted: str) -> bool:
  for part in dotted.split("."):
    try:
      if part not in c:
        return False
    except TypeError:  # a value, not a section
      return False
    c = c[part]
  return True


def check_text(text: str, name: str, load=config_lib.from_file) -> tuple[int, list[str]]:
  """(commands read, problems) of the commands in `text` (named `name` in the problems).
  load: spec -> config, as `--config=` reads it."""
  problems, count = [], 0
  flag_cache: dict[str, set[str]] = {}
  for number, module, words in commands(text):
    count += 1
    where = f"{name}:{number}: python -m {module}"
    if _module_file(module) is None:
      problems.append(f"{where}: no module {module}")
      continue
    flags = flag_cache.setdefault(module, module_flags(module))
    spec, overrides = None, []
    for w in (w.lstrip("[").rstrip("]") for w in words):  # [--optional=flag]
      if not w.startswith("-"):
        continue
      flag, _, value = w.lstrip("-").partition("=")
      if flag == "config":
        spec = value
      elif flag.startswith("config."):
        overrides.append(flag[len("config."):])
      elif flag not in flags and not (flag.startswith("no") and flag[2:] in flags):
        problems.append(f"{where}: --{flag} is not a flag of {module}")
    if spec is None or _placeholder(spec):
      continue
    path = spec.partition(":")[0]
    if not os.path.isfile(os.path.join(REPO, path)):
      problems.append(f"{where}: --config={spec}: no such file")
      continue
    try:
      c = load(os.path.join(REPO, spec))
    except Exception as e:  # noqa: BLE001 (reported, with the line)
      problems.append(f"{where}: --config={spec} does not load: {e}")
      continue
    for setting in overrides:
      if not _has_setting(c, setting):
        problems.append(f"{where}: --config.{setting}: no such setting in {spec}")
  return count, problems


def check_files(paths, load=config_lib.from_file) -> tuple[dict[str, int], list[str]]:
  counts, problems = {}, []
  for path in paths:
    n, p = check_text(open(os.path.join(REPO, path)).read(), path, load)
    counts[path] = n
    problems += p
  return counts, problems


def test_every_command_in_launch_and_readme_parses_against_its_config():
  counts, problems = check_files(documents())
  assert not problems, "\n".join(problems)
  assert counts["README.md"] >= 10
  for script in ("launch/tpu_pod.sh", "launch/gke_xpk.sh", "launch/slurm_gpu.sbatch", "launch/tiny_seeds.sh",
                 "launch/lag_study.sh", "launch/reasoning_study.sh", "launch/mix_study.sh"):
    assert counts[script] >= 1, f"{script}: no python -m oapl_jax command found"


def test_the_reasoning_study_launcher_searches_splits_the_seeds_and_saves_the_results():
  p = subprocess.run(["bash", "launch/reasoning_study.sh", "--dry-run", "/tmp/rs", "--budget-minutes=30"],
                     cwd=REPO, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "reasoning_study.sh --dry-run")
  assert n == 4 and not problems, (p.stdout, problems)
  lines = [l for l in p.stdout.splitlines() if "oapl_jax" in l]
  # both halves at once: they share the search, then every seed in order (3 seeds done first)
  seeds = " ".join(map(str, STUDIES["reason"].seeds))  # the seeds the report counts as planned
  assert seeds == "0 1 2 3 4"
  assert lines[0].endswith(f"--seeds {seeds} --budget-minutes=30 &") and lines[1].endswith(f"--seeds {seeds} --budget-minutes=30 &")
  assert lines[2].endswith("--seeds 0 1 2 3 4 --budget-minutes=30 --save-results")
  assert lines[3].endswith("--seeds 0 1 2 3 4 --budget-minutes=30 --report-only")
  assert all("--out=/tmp/rs" in l and " --search " in l and "--results=docs/reasoning_study/results" in l
             and "--lags 1 10 50 100" in l for l in lines)
  assert "--report=docs/reasoning_study.md" in lines[3]
  assert "--report=/tmp/rs/half_a.md" in lines[0] and "--report=/tmp/rs/half_b.md" in lines[1]


def test_the_tpu_launcher_dry_run_prints_commands_that_parse():
  p = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--name=t", "--run=runs/t",
                      "--config=configs/code.py", "--", "--config.rl.lag=400",
                      "--config.task.train_path=/mnt/bucket/data/deepcoder.jsonl"],
                     cwd=REPO, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  assert "tpu-vm create t" in p.stdout and "--worker=all" in p.stdout
  n, problems = check_text(p.stdout, "tpu_pod.sh --dry-run")
  assert n == 1 and not problems, (p.stdout, problems)
  assert "--workdir=gs://BUCKET/runs/t --config.rl.lag=400" in p.stdout  # the workdir is the bucket
  assert "gcsfuse --implicit-dirs -o ro BUCKET /mnt/bucket" in p.stdout  # weights and data, read-only
  assert "sys.version_info < (3, 11)" in p.stdout and "python3.11-venv" in p.stdout  # a new Python
  assert "install -y -q bubblewrap" in p.stdout and "packages.cloud.google.com/apt gcsfuse-" in p.stdout
  queued = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--name=t", "--queued", "--watch"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
  assert queued.returncode == 0, queued.stderr
  assert "queued-resources create t" in queued.stdout and "tpu-vm create" not in queued.stdout
  assert "# watch: every 600s until gs://BUCKET/runs/oapl/summary.json exists" in queued.stdout
  bad = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--config=configs/nope.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "--config=configs/nope.py: no such file" in bad.stderr


def test_the_gke_launcher_dry_run_prints_an_xpk_workload_that_parses():
  p = subprocess.run(["bash", "launch/gke_xpk.sh", "--dry-run", "--workload=t", "--run=runs/t",
                      "--config=configs/code.py", "--", "--config.rl.lag=400"],
                     cwd=REPO, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "gke_xpk.sh --dry-run")
  assert n == 1 and not problems, (p.stdout, problems)
  assert "xpk workload create --workload=t --cluster=CLUSTER --tpu-type=v5p-64" in p.stdout
  assert "--max-restarts=10" in p.stdout and "--script-dir=." in p.stdout
  # the restarted workload waits for the killed one's lease (300 s) instead of refusing
  assert ("--workdir=gs://BUCKET/runs/t --config.checkpoint.lock_wait_s=420 --config.rl.lag=400"
          in p.stdout)
  lease = subprocess.run(["bash", "launch/gke_xpk.sh", "--dry-run", "--",
                          "--config.checkpoint.lock_lease_s=60"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
  assert "--config.checkpoint.lock_wait_s=180" in lease.stdout, lease.stdout
  bad = subprocess.run(["bash", "launch/gke_xpk.sh", "--cluster=c"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
  assert bad.returncode == 2 and "--bucket=gs://BUCKET are required" in bad.stderr


def test_the_slurm_script_dry_run_prints_the_srun_line_that_parses():
  env = {**os.environ, "DRY_RUN": "1", "CONFIG": "configs/math.py", "WORKDIR": "/shared/runs/m"}
  p = subprocess.run(["bash", "launch/slurm_gpu.sbatch", "--config.rl.lag=100"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "slurm_gpu.sbatch dry run")
  assert n == 1 and not problems, (p.stdout, problems)
  assert p.stdout.startswith("+ srun --ntasks-per-node=1") and ("--config=configs/math.py "
      "--workdir=/shared/runs/m --config.checkpoint.lock_wait_s=420 --config.rl.lag=100") in p.stdout


# --- the check fails on wrong lines ------------------------------------------------------------


@pytest.mark.parametrize("line, why", [
    ("python -m oapl_jax.main --config=configs/tiny.py --workdir=/tmp/w --config.rl.lagg=3",
     "--config.rl.lagg: no such setting in configs/tiny.py"),
    ("python -m oapl_jax.main --config=configs/math.py:tiny --workdir=/tmp/w \\\n"
     "    --config.task.train_pth=/data/x.jsonl", "--config.task.train_pth: no such setting"),
    ("python -m oapl_jax.main --config=configs/nope.py --workdir=/tmp/w", "configs/nope.py: no such file"),
    ("python -m oapl_jax.main --config=configs/tiny.py --work_dir=/tmp/w", "--work_dir is not a flag"),
    ("python -m oapl_jax.generate --config=configs/tiny.py --output=/tmp/f.npz", "--output is not a flag"),
    ("python -m oapl_jax.studies.lag_study --out=/tmp/ls --lag 1", "--lag is not a flag"),
    ("python -m oapl_jax.trainer --config=configs/tiny.py", "no module oapl_jax.trainer"),
    ("* `python -m oapl_jax.evaluate --config=... --workdir=DIR [--polcy=theta|snapshot]` — pass@k",
     "--polcy is not a flag"),
    ("srun \"${PYTHON:-python}\" -m oapl_jax.main --config=\"${CONFIG:-configs/code.py}\" \\\n"
     "  --workdir=w --config.rl.grpo.eps=0.2", "--config.rl.grpo.eps: no such setting in configs/code.py"),
])
def test_a_wrong_line_is_caught(line, why):
  n, problems = check_text(line, "wrong")
  assert n == 1 and len(problems) == 1 and why in problems[0], problems


@pytest.mark.parametrize("section, name, used_in", [
    ("rl", "lag", "README.md"),  # --config.rl.lag=20
    ("task", "train_path", "launch/tpu_pod.sh"),  # the command every pod worker runs
])
def test_renaming_a_setting_used_in_launch_or_readme_fails_the_check(section, name, used_in):
  """As if config.py renamed `section.name`: the lines that set it fail the check."""
  def renamed(spec):
    c = config_lib.from_file(spec)
    if name in c[section]:
      c[section][name + "_renamed"] = c[section][name]
      del c[section][name]
    return c

  _, problems = check_files(documents(), load=renamed)
  assert problems and all(f"--config.{section}.{name}: no such setting" in p for p in problems), problems
  assert any(p.startswith(used_in + ":") for p in problems), problems


def test_the_mix_study_launcher_searches_every_method_and_runs_the_studys_lags_and_seeds():
  p = subprocess.run(["bash", "launch/mix_study.sh", "--dry-run", "/tmp/ms"], cwd=REPO, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "mix_study.sh --dry-run")
  assert n == 4 and not problems, (p.stdout, problems)
  lines = [l for l in p.stdout.splitlines() if "oapl_jax" in l]
  spec = STUDIES["mix"]
  for l in lines:
    assert "--study=mix" in l and " --search " in l and "--results=docs/mix_study/results" in l
    assert f"--methods {' '.join(spec.methods)} " in l and f"--lags {' '.join(map(str, spec.lags))} " in l
    assert f"--seeds {' '.join(map(str, spec.seeds))}" in l
  assert lines[2].endswith("--report=docs/mix_study.md --seeds 0 1 2 --save-results")


def test_the_launchers_start_sampler_slices_beside_the_trainer_in_remote_mode():
  p = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--name=t", "--run=runs/t", "--samplers=2",
                      "--sampler-accelerator=v6e-8", "--sampler-set=--config.sampling.max_slots=48",
                      "--", "--config.rl.lag=100"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "tpu_pod.sh --samplers --dry-run")
  assert n == 3 and not problems, (p.stdout, problems)  # one trainer, two sampler commands
  assert "tpu-vm create t-s2 --zone=us-east5-a --accelerator-type=v6e-8 --version=v2-alpha-tpuv6e" in p.stdout
  trainer = ("oapl_jax.main --config=configs/math.py --workdir=gs://BUCKET/runs/t --config.rl.mode=remote "
             "--config.rl.window_rollouts=1 --config.rl.lag=100")
  sampler = ("oapl_jax.sample --config=configs/math.py --workdir=gs://BUCKET/runs/t --config.rl.mode=remote "
             "--config.rl.window_rollouts=1 --config.rl.lag=100 --config.sampling.max_slots=48")
  assert p.stdout.count(trainer) == 1 and p.stdout.count(sampler) == 2, p.stdout
  gone = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--name=t", "--samplers=2", "--delete"],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
  assert [line for line in gone.stdout.splitlines() if " delete " in line] == [
      f"+ gcloud compute tpus tpu-vm delete {n} --zone=us-east5-a --quiet" for n in ("t", "t-s1", "t-s2")]
  g = subprocess.run(["bash", "launch/gke_xpk.sh", "--dry-run", "--workload=t", "--samplers=1",
                      "--sampler-set=--config.sampling.max_slots=48"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert g.returncode == 0, g.stderr
  n, problems = check_text(g.stdout, "gke_xpk.sh --samplers --dry-run")
  assert n == 2 and not problems, (g.stdout, problems)
  assert "xpk workload create --workload=t-s1 --cluster=CLUSTER --tpu-type=v6e-8" in g.stdout
  assert "oapl_jax.sample --config=configs/math.py --workdir=gs://BUCKET/runs/oapl --config.rl.mode=remote" in g.stdout
  for script in ("tpu_pod.sh", "gke_xpk.sh"):
    bad = subprocess.run(["bash", f"launch/{script}", "--dry-run", "--samplers=two"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--samplers=two: give a count" in bad.stderr


def test_the_step2_launcher_runs_42_runs_in_stages_from_the_committed_bases():  # 39, and S2-7's 3
  from oapl_jax.studies import lag_study
  p = subprocess.run(["bash", "launch/mix_step2.sh", "--dry-run", "/tmp/s2"], cwd=REPO, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  n, problems = check_text(p.stdout, "mix_step2.sh --dry-run")
  assert n == 11 and not problems, (p.stdout, problems)
  runs = 0
  for line in p.stdout.splitlines():
    assert "--bases=docs/mix_study/paired_check/base_models" in line
    assert "--results=docs/mix_study/paired_check " in line and "--seeds 0 1 2" in line
    args = lag_study._parse(shlex.split(line)[3:])  # every stage's flags are accepted as given
    if "half_" in line:
      runs += len(args.methods) * len(args.lags) * len(args.seeds)
  assert runs == 42
  assert os.path.isdir(os.path.join(REPO, "docs/mix_study/paired_check/base_models"))


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_two_halves_passes_on_a_half_s_failure_and_a_sigterm_stops_both_halves_processes(tmp_path):
  """launch/halves.sh, the study launchers' two processes: `two_halves FN` returns a half's
  non-zero status, and a SIGTERM to the launcher reaches both halves' commands (through `half`),
  none left running (broken by hand: with two_halves' trap not passing the kill on, the two
  commands outlive the launcher and this fails)."""
  status = subprocess.run(["bash", "-c", "source launch/halves.sh; job() { [[ $1 == b ]] && return 3; return 0; }; "
                           "two_halves job; echo status $?"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HALVES_GAP_S": "0"})
  assert status.stdout.strip() == "status 3", (status.stdout, status.stderr)

  script = ("source launch/halves.sh; "
            f"job() {{ half bash -c 'echo $$ > {tmp_path}/$0.pid; exec sleep 300' \"$1\"; }}; "
            "two_halves job")
  launcher = subprocess.Popen(["bash", "-c", script], cwd=REPO, env={**os.environ, "HALVES_GAP_S": "0"},
                              start_new_session=True)
  pids = {}
  try:
    deadline = time.time() + 30
    while len(pids) < 2 and time.time() < deadline:
      for h in "ab":
        f = tmp_path / f"{h}.pid"
        if h not in pids and f.exists() and f.read_text().strip():
          pids[h] = int(f.read_text())
      time.sleep(0.1)
    assert set(pids) == {"a", "b"}, "the two halves did not both start"
    launcher.terminate()
    assert launcher.wait(timeout=30) == 143
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in pids.values()):
      time.sleep(0.1)
    assert not [h for h, p in pids.items() if _alive(p)], "a half's command outlived the launcher"
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, 9)
    for p in pids.values():
      if _alive(p):
        os.kill(p, 9)
