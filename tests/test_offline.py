"""Offline mode (rl.mode="offline"): files written by generate, rounds, then online; refusals.

The runs here skip the warm-up (`warmup.steps=0`): the base is the seed's random init, which
`generate` and the run both build, so a file of the base is the run's pi_old's. The full
tiny offline-then-online run (warmed-up base, two rounds of 4 epochs) is in docs/offline.md.
"""

import os
import subprocess
import sys
import zipfile

import jax
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax import train
from oapl_jax.generate import generate
from oapl_jax.rl import offline
from oapl_jax.tasks import make_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _offline(c, **off):
  """The smoke config offline: rounds of 8 groups, 1 epoch of 2 steps (4 groups a step)."""
  c.warmup.steps = c.warmup.noisy_steps = 0
  c.rl.mode = "offline"
  c.rl.offline.update(problems=8, epochs=1, rounds=2, check_rows=8)
  c.rl.offline.update(off)
  return c


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
  """A file of the smoke config's base (random init), written by `generate`."""
  path = str(tmp_path_factory.mktemp("offline") / "round1.npz")
  out = generate(_offline(config_lib.repo_config("tiny.py:smoke")), path)
  assert out["groups"] == 8 and out["answers"] == 8 * 8
  return path


def _rewrite(src: str, dst: str, edit) -> None:
  """`src` with `edit(header, arrays)` applied, written as a valid file (a fresh checksum)."""
  data = offline.read(src)
  header = {k: v for k, v in data.header.items() if k != "format"}
  arrays = {k: v.copy() for k, v in data.arrays.items()}
  edit(header, arrays)
  offline.write(dst, header, arrays)


def test_file_round_trip_and_schedule(smoke_config, base_file):
  data = offline.read(base_file)
  c = _offline(smoke_config)
  assert data.groups == 8 and data.group_size == c.rl.group_size
  assert [p.prompt for p in data.problems] == [
      p.prompt for p in offline.round_one_problems(c, make_task(c)[0])]
  rows = data.rows(np.array([3, 1]), seq_len=14, pad_id=0, count_truncated=True)
  assert rows.tokens.shape == (16, 14) and (rows.mask.sum(1) == rows.answer_lengths).all()
  np.testing.assert_array_equal(rows.rewards, np.concatenate([data.arrays["rewards"][24:32],
                                                              data.arrays["rewards"][8:16]]))
  sched = offline.Schedule(groups=10, per_step=4, epochs=3, rounds=2)
  assert (sched.steps_per_epoch, sched.round_steps, sched.steps) == (2, 6, 12)
  seen = [sched.batch(0, s) for s in range(12)]
  assert [r for r, _ in seen] == [0] * 6 + [1] * 6
  for epoch in range(3):  # each pass: 8 distinct groups of 10 (the incomplete batch left out)
    groups = np.concatenate([g for _, g in seen[2 * epoch:2 * epoch + 2]])
    assert len(set(groups.tolist())) == 8


def _same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def test_offline_rounds_then_online_and_resume(smoke_config, base_file, tmp_path):
  c = _offline(smoke_config, path=base_file)
  c.train.steps = 6  # 2 rounds x 2 steps offline, then 2 online steps (lag 3)
  r = train.Run(c, str(tmp_path))
  ms = [r.step() for _ in range(3)]
  r.save()  # in round 2, its file written
  ms += [r.step() for _ in range(3)]
  assert [m["policy_version"] for m in ms] == [0, 0, 1, 1, 2, 2]  # refreshed at each round's end
  assert [m["lag_hist"] for m in ms[:4]] == [{"0": 32}, {"1": 32}, {"0": 32}, {"1": 32}]
  # Round 1 came from the file (no answers sampled); round 2 was sampled by pi_old at step 2
  # on round 1's problems; online steps sample fresh problems.
  assert [m["samples_generated"] for m in ms[:4]] == [0, 0, 64, 64]
  assert ms[5]["samples_generated"] > 64
  second = offline.read(str(tmp_path / "offline" / "round_2.npz"))
  assert second.header["policy"]["snapshot_step"] == 2 and second.header["round"] == 2
  assert [p.prompt for p in second.problems] == [p.prompt for p in offline.read(base_file).problems]
  assert all(np.isfinite(m["loss"]) for m in ms) and ms[1]["loss"] > 0
  # Resumed from step 3, reading round 2's file back: the same run.
  resumed = train.Run(c, str(tmp_path))
  assert resumed.restore_latest() and resumed.counters.step == 3
  # generate from that checkpoint's snapshot: its file is pi_old's (version 1, copied at step 2).
  out = str(tmp_path / "from_checkpoint.npz")
  generate(c, out, workdir=str(tmp_path), policy="snapshot")
  data = offline.read(out)
  assert {k: data.header["policy"][k] for k in ("version", "snapshot_step")} == {"version": 1, "snapshot_step": 2}
  gap = offline.check_logprobs(data, c, offline.logprob_fn(c, resumed.graphdef, resumed.mesh),
                               resumed.snapshot, seq_len=14, pad_id=0, what="pi_old")
  assert gap < 1e-4
  for _ in range(3):
    resumed.step()
  assert _same(resumed.params, r.params)
  r.close()
  resumed.close()


def test_a_file_of_another_policy_is_refused_by_rescoring(smoke_config, base_file, tmp_path):
  other = str(tmp_path / "seed1.npz")
  generate(_seed(1), other)  # the random init of seed 1: same model, other weights
  r = train.Run(_offline(smoke_config, path=other), str(tmp_path / "run"))
  with pytest.raises(offline.OfflineFileError,
                     match=rf"offline file {other}: its log-probs are not those of this run's pi_old \(version 0\): mean"):
    r.step()


def _seed(seed):
  c = _offline(config_lib.repo_config("tiny.py:smoke"))
  c.seed = seed
  return c


def test_tampered_log_probs_are_refused(smoke_config, base_file, tmp_path):
  bad = str(tmp_path / "shifted.npz")
  _rewrite(base_file, bad, lambda h, a: a.update(answer_logprobs=a["answer_logprobs"] - 0.3))
  r = train.Run(_offline(smoke_config, path=bad), str(tmp_path / "run"))
  with pytest.raises(offline.OfflineFileError, match=r"mean \|stored - recomputed\| = 0.3 per token"):
    r.step()


@pytest.mark.parametrize("damage, why", [
    ("flip", "unreadable: truncated, corrupted or not an .npz file .*Bad CRC-32"),
    ("truncate", "unreadable: truncated, corrupted or not an .npz file"),
    ("empty", "unreadable: truncated, corrupted or not an .npz file"),
    ("edit", "checksum mismatch: the file is corrupted or was edited"),
])
def test_corrupted_or_truncated_files_are_refused(base_file, tmp_path, damage, why):
  blob = open(base_file, "rb").read()
  path = tmp_path / "bad.npz"
  if damage == "flip":  # a byte inside the answer log-probs' data (the zip's CRC catches it)
    with zipfile.ZipFile(base_file) as z:
      info = z.getinfo("answer_logprobs.npy")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    blob = blob[:at] + bytes([blob[at] ^ 0x40]) + blob[at + 1:]
  elif damage == "truncate":
    blob = blob[:len(blob) // 2]
  elif damage == "empty":
    blob = b""
  if damage == "edit":  # a valid zip whose log-probs were changed, the digest left as it was
    with np.load(base_file) as z:
      members = {k: z[k] for k in z.files}
    members["answer_logprobs"] = members["answer_logprobs"] * 0.5
    with open(path, "wb") as f:
      np.savez(f, **members)
  else:
    path.write_bytes(blob)
  with pytest.raises(offline.OfflineFileError, match=rf"^offline file {path}: {why}"):
    offline.read(str(path))


@pytest.mark.parametrize("setting, value, why", [
    ("model.mlp_dim", 256, "written for another model: mlp_dim=384 \\(run: 256\\)"),
    ("task.min_digits", 1, "written for another task: task.min_digits=2 \\(run: 1\\)"),
    ("sampling.max_new_tokens", 8, "written with sequence length 8 \\+ 6 .*this run's is 8 \\+ 8"),
    ("sampling.temperature", 0.7, "sampled with other settings: sampling.temperature=1.0 \\(run: 0.7\\)"),
    ("rl.group_size", 4, "groups of 8 answers; this run's rl.group_size=4"),
])
def test_a_file_of_another_model_task_or_length_is_refused(smoke_config, base_file, tmp_path,
                                                           setting, value, why):
  c = _offline(smoke_config, path=base_file)
  section, name = setting.rsplit(".", 1)
  config_lib._get(c, section)[name] = value
  with pytest.raises(offline.OfflineFileError, match=rf"offline file {base_file}: {why}"):
    train.Run(c, str(tmp_path))  # at start-up, before any warm-up


def test_offline_settings_are_validated(smoke_config, tmp_path):
  c = _offline(smoke_config, path=str(tmp_path / "missing.npz"))
  with pytest.raises(config_lib.ConfigError, match=r"config.rl.offline.path=.*missing.npz.*: no such file"):
    config_lib.validate(c)
  for setting, value, why in (("problems", 2, r">= rl.groups_per_step=4"), ("epochs", 0, ">= 1"),
                              ("logprob_tol", 0.0, "> 0")):
    c = _offline(config_lib.repo_config("tiny.py:smoke"), **{setting: value})
    with pytest.raises(config_lib.ConfigError, match=rf"config.rl.offline.{setting}=.*{why}"):
      config_lib.validate(c)
  c = _offline(config_lib.repo_config("tiny.py:smoke"))
  c.rl.max_lag = 3  # a round is 2 steps: lags 0..1, fine; 8 groups / 4 x 3 epochs: lags to 5
  c.rl.offline.epochs = 3
  with pytest.raises(config_lib.ConfigError, match=r"config.rl.max_lag=3: an offline round trains 6 steps"):
    train.Run(c, str(tmp_path / "run"))


def test_the_command_refuses_a_corrupted_file_in_one_line(base_file, tmp_path):
  bad = tmp_path / "half.npz"
  bad.write_bytes(open(base_file, "rb").read()[:1000])
  p = subprocess.run(
      [sys.executable, "-m", "oapl_jax.main", "--config=configs/tiny.py:smoke",
       f"--workdir={tmp_path / 'run'}", "--config.rl.mode=offline", f"--config.rl.offline.path={bad}",
       "--config.rl.offline.problems=8"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": REPO})
  assert p.returncode == 2, p.stderr[-2000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: offline file {bad}: unreadable: truncated, corrupted"), p.stderr[-2000:]
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_tiny_offline_rounds_then_online_raise_pass_at_1(tmp_path):
  """docs/offline.md: generate from the warmed-up base, two rounds of 4 epochs offline,
  then online; pass@1 rises in each phase (seed 0 measured 0.240 -> 0.616 -> 0.747 -> 0.936)."""
  env = {**os.environ, "PYTHONPATH": REPO}
  cache, out = f"--config.warmup.cache_dir={tmp_path / 'cache'}", str(tmp_path / "round1.npz")
  for cmd in (["oapl_jax.generate", "--config=configs/tiny.py", f"--out={out}", cache],
              ["oapl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", cache,
               "--config.rl.mode=offline", f"--config.rl.offline.path={out}",
               "--config.train.steps=320", "--config.eval.every=64", "--config.log.progress=False"]):
    p = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
  import json  # noqa: PLC0415
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  during = {e["step"]: e["pass@1"] for e in summary["evals_during"]}
  before, after = summary["eval_before"]["pass@1"], summary["eval_after"]["pass@1"]
  assert before + 0.2 < during[64] < during[128] < after, (before, during, after)


def _longer_first_answer(h, a):
  """Answer 0 made 10 tokens longer than it is (offsets shifted): past max_new_tokens."""
  end = a["answer_offsets"][1]
  a["answer_tokens"] = np.insert(a["answer_tokens"], end, np.full(10, 3, np.int32))
  a["answer_logprobs"] = np.insert(a["answer_logprobs"], end, np.full(10, -1.0, np.float32))
  a["answer_offsets"][1:] += 10


def _set(name, index, value):
  def edit(h, a):
    a[name][index] = value
  return edit


@pytest.mark.parametrize("edit, why", [
    (_set("answer_logprobs", 40, np.nan), r"answer \d+ \(group \d, answer \d of it\): a log-prob that is not finite"),
    (_set("answer_logprobs", 40, 3.0), r"answer \d+ \(group \d, answer \d of it\): a log-prob above 0"),
    (_set("answer_tokens", 40, -5), r"answer \d+ .*: a token id outside \[0, \d+\) \(model.vocab_size\)"),
    (_set("answer_tokens", 40, 1000), r"answer \d+ .*: a token id outside \[0, \d+\)"),
    (_set("rewards", 13, np.inf), r"answer 13 \(group 1, answer 5 of it\): a reward that is not finite"),
    (_set("answer_logprobs", 40, -1e9), r"answer \d+ .*: a log-prob below -745 \(no float softmax"),
    (_set("finish", 9, 7), r"answer 9 \(group 1, answer 1 of it\): a finish code outside \[0, 1, 2\]"),
    (lambda h, a: a.update(answer_tokens=a["answer_tokens"] + 0.2),
     r"answer_tokens: not an array of integers \(float"),
    (lambda h, a: a.update(answer_offsets=a["answer_offsets"].astype(np.float64)),
     r"answer_offsets: not an array of integers \(float64\)"),
    (_set("prompt_tokens", 3, 999), r"group 0's prompt: a token id outside"),
    (_longer_first_answer, r"answer 0 \(group 0, answer 0 of it\): longer than sampling.max_new_tokens=6"),
    (lambda h, a: a.update(rewards=a["rewards"].reshape(8, 8)), r"rewards: not a 1-D array of numbers"),
    (lambda h, a: h.pop("problems"), r"its header has no list of problems"),
    (lambda h, a: h["problems"][2].update(prompt="1+1="), r"group 2's prompt tokens are not its header problem's prompt"),
    (lambda h, a: h["problems"][2].update(level=3), r"header problem 2 is not a problem \(prompt, answer, id\)"),
])
def test_a_forged_file_is_refused_naming_the_row(smoke_config, base_file, tmp_path, edit, why):
  """Written through the project's own writer (its checksum holds): every row is checked when
  the file is read, not only the rescored ones, and the first bad one is named."""
  bad = str(tmp_path / "forged.npz")
  _rewrite(base_file, bad, edit)
  c = _offline(smoke_config, path=bad)
  with pytest.raises(offline.OfflineFileError, match=rf"^offline file {bad}: {why}"):
    data = offline.read(bad)
    offline.check_matches(data, c, _model_meta(c))
    offline.check_problems(data, make_task(c)[1])
  data = offline.read(base_file)  # the file it was forged from passes
  offline.check_matches(data, c, _model_meta(c))
  offline.check_problems(data, make_task(c)[1])


def _model_meta(c) -> dict:
  from oapl_jax.models.transformer import ModelConfig  # noqa: PLC0415
  return ModelConfig.from_config(c.model).architecture()


def test_a_killed_offline_run_counts_each_answer_once(smoke_config, tmp_path):
  """Killed after round 2's file was written but before a checkpoint counted it: the resumed
  run reads the file back and counts its answers, as the straight run does."""
  c = _offline(smoke_config)
  c.train.steps = 4  # 2 rounds x 2 steps, both sampled by the run
  straight = train.Run(c, str(tmp_path / "straight"))
  for _ in range(4):
    straight.step()
  killed = train.Run(c, str(tmp_path / "killed"))
  for _ in range(2):
    killed.step()
  killed.save()  # step 2: round 2 not sampled yet
  killed.step()  # samples round 2 into offline/round_2.npz; then the kill
  assert (tmp_path / "killed" / "offline" / "round_2.npz").exists()
  resumed = train.Run(c, str(tmp_path / "killed"))
  assert resumed.restore_latest() and resumed.counters.step == 2
  for _ in range(2):
    resumed.step()
  assert resumed.counters.samples_generated == straight.counters.samples_generated == 2 * 64
  for r in (straight, killed, resumed):
    r.close()
