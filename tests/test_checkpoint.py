"""Damaged checkpoints: verified at restore, skipped for the newest good one, never deleted.

One real run state (the smoke config) is saved at steps 1 and 2; each scenario damages a copy of
step 2 and restores from the copy.
"""

import glob
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from configs import tiny
from oapl_jax import checkpoint, policies, train
from oapl_jax.errors import UserError
from oapl_jax.metrics import MetricsLog, read_metrics


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _equal(tree, host_leaves) -> bool:
  leaves = _host(tree)
  return len(leaves) == len(host_leaves) and all(np.array_equal(x, y) for x, y in zip(leaves, host_leaves))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(run, checkpoints dir, {step: params on the host}) with checkpoints at steps 1 and 2."""
  workdir = str(tmp_path_factory.mktemp("run"))
  r = train.Run(tiny.get_config("smoke"), workdir)
  params = {}
  for _ in range(2):
    r.step()
    r.save()
    params[r.counters.step] = _host(r.params)
  return r, os.path.join(workdir, "checkpoints"), params


def _copy(saved, tmp_path) -> str:
  d = str(tmp_path / "checkpoints")
  shutil.copytree(saved[1], d)
  return d


def _target(r) -> dict:
  return {"params": r.params, "opt_state": r.opt_state, "snapshot": r.snapshot}


def _restore(r, directory, keep=2):
  return checkpoint.Checkpointer(directory, keep=keep).restore_latest(_target(r), r.model_meta())


def _data_files(step_dir):
  return [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
          if os.path.isfile(f)]


def _biggest(step_dir):
  return max(_data_files(step_dir), key=os.path.getsize)


def _flip(step_dir):
  path = _biggest(step_dir)
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    f.seek(0)
    f.write(data)


def _truncate(step_dir):
  path = _biggest(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


def _delete(step_dir):
  os.remove(_biggest(step_dir))


def _empty_meta(step_dir):
  open(os.path.join(step_dir, "meta", "metadata"), "w").close()


def _delete_manifests(step_dir):
  for path in glob.glob(os.path.join(step_dir, "state", "**", "manifest.ocdbt"), recursive=True):
    os.remove(path)


@pytest.mark.parametrize("damage", [_flip, _truncate, _delete, _empty_meta, _delete_manifests],
                         ids=["flip64", "truncate", "delete", "empty_meta", "no_manifests"])
def test_damaged_latest_falls_back_to_the_previous_step(saved, tmp_path, damage, caplog, capsys):
  r, _, params = saved
  d = _copy(saved, tmp_path)
  damage(os.path.join(d, "2"))
  with caplog.at_level(logging.WARNING):
    step, state, meta = _restore(r, d)
  assert step == 1 and meta["counters"]["step"] == 1
  assert _equal(state["params"], params[1])
  warned = os.path.join(d, "2")
  assert any(warned in rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING)
  assert warned in capsys.readouterr().err
  assert os.path.isdir(warned)  # kept for a look, never deleted by a restore


def test_flipped_bytes_name_the_leaf(saved, tmp_path, caplog):
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  _flip(os.path.join(d, "2"))
  with caplog.at_level(logging.WARNING):
    _restore(r, d)
  text = " ".join(rec.getMessage() for rec in caplog.records)
  assert "checksum" in text and "['" in text  # the leaf's tree path, e.g. ['params']['embed']


def test_every_checkpoint_damaged_is_a_user_error(saved, tmp_path):
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  _flip(os.path.join(d, "2"))
  _empty_meta(os.path.join(d, "1"))
  with pytest.raises(checkpoint.CheckpointError) as e:
    _restore(r, d)
  assert isinstance(e.value, UserError)
  msg = str(e.value)
  assert d in msg and "step 1" in msg and "step 2" in msg and "checksum" in msg
  assert os.path.isdir(os.path.join(d, "1")) and os.path.isdir(os.path.join(d, "2"))


def test_no_checkpoint_is_none(saved, tmp_path):
  r, _, _ = saved
  assert _restore(r, str(tmp_path / "empty")) is None


def test_checkpoint_of_another_model_is_not_skipped(saved, tmp_path):
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  _empty_meta(os.path.join(d, "2"))  # skipped as damaged; step 1 is then refused, not skipped
  other = {**r.model_meta(), "hidden_size": 64}
  with pytest.raises(ValueError, match="another model"):
    checkpoint.Checkpointer(d, keep=2).restore_latest(_target(r), other)


def test_bfloat16_arrays_are_verified(tmp_path):
  """Checksums cover every dtype a model may hold (bfloat16 has no Python buffer format)."""
  w = jax.numpy.arange(6, dtype=jax.numpy.bfloat16).reshape(2, 3)
  state = {"params": {"w": w}, "buffer": {"rewards": np.ones(4, np.float32)}}
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
  ckpt.save(1, state, {"model": {}})
  step, restored, _ = ckpt.restore_latest({"params": {"w": jax.numpy.zeros_like(w)}}, {})
  assert step == 1 and restored["params"]["w"].dtype == jax.numpy.bfloat16
  assert np.array_equal(np.asarray(restored["params"]["w"]), np.asarray(w))


def test_a_save_in_the_background_owns_its_data(tmp_path):
  """save(wait=False) returns while orbax writes; the caller may then free (donate) its device
  arrays and change its host rows, and the step still holds and verifies what was saved (orbax
  copies both before `save` returns: the training loop relies on it)."""
  w = jax.device_put(np.arange(4096, dtype=np.float32).reshape(64, 64))
  rows = np.arange(8, dtype=np.int32)
  want_w, want_rows = np.asarray(w).copy(), rows.copy()
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
  ckpt.save(3, {"params": {"w": w}, "buffer": {"tokens": rows}}, {"model": {}}, wait=False)
  w.delete()  # what a donating train step does to the old buffers
  rows[:] = -1  # and a buffer refilled in place
  ckpt.wait()
  step, restored, _ = ckpt.restore_latest({"params": {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}}, {})
  assert step == 3
  assert np.array_equal(np.asarray(restored["params"]["w"]), want_w)
  assert np.array_equal(restored["buffer"]["tokens"], want_rows)


def test_checkpoint_without_checksums_still_restores(saved, tmp_path):
  """Saved before checksums existed: restored unverified."""
  r, _, params = saved
  d = _copy(saved, tmp_path)
  meta_path = os.path.join(d, "2", "meta", "metadata")
  with open(meta_path) as f:
    meta = json.load(f)
  assert checkpoint.CHECKSUMS in meta
  del meta[checkpoint.CHECKSUMS]
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  step, state, _ = _restore(r, d)
  assert step == 2
  assert _equal(state["params"], params[2])


def test_half_written_checkpoint_is_ignored_then_cleaned(saved, tmp_path):
  """Killed mid-save: orbax's `<step>.orbax-checkpoint-tmp` directory is not a checkpoint."""
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  tmp = os.path.join(d, "3.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(d, "2"), tmp)
  _truncate(tmp)
  ckpt = checkpoint.Checkpointer(d, keep=2)
  step, state, meta = ckpt.restore_latest(_target(r), r.model_meta())
  assert step == 2 and os.path.isdir(tmp)
  ckpt.save(4, state, {"counters": meta["counters"], "model": r.model_meta()})
  assert sorted(os.listdir(d)) == ["2", "4"]  # keep=2, the dead save's leftovers gone


def test_keep_is_kept_after_a_kill_between_rename_and_cleanup(saved, tmp_path):
  """Killed after orbax renamed a new step into place but before it deleted the oldest one:
  three step directories; the next restore leaves `keep` of them, and so does the next save."""
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  shutil.copytree(os.path.join(d, "2"), os.path.join(d, "0"))
  ckpt = checkpoint.Checkpointer(d, keep=2)
  ckpt.restore_latest(_target(r), r.model_meta())  # a command that only reads (evaluate)
  assert sorted(os.listdir(d)) == ["0", "1", "2"]
  step, state, meta = ckpt.restore_latest(_target(r), r.model_meta(), tidy=True)  # a run resuming
  assert step == 2 and sorted(os.listdir(d)) == ["1", "2"]  # ... with nothing left to save
  ckpt.save(step + 1, state, {"counters": meta["counters"], "model": r.model_meta()})
  assert sorted(os.listdir(d)) == ["2", "3"]


def test_damaged_step_is_moved_aside_at_the_next_save(saved, tmp_path, capsys):
  """Resumed from step 1 past a damaged step 2: saving step 2 again keeps the damaged one (renamed),
  and orbax's clean-up of old steps does not count it (step 1 stays)."""
  r, _, _ = saved
  d = _copy(saved, tmp_path)
  _flip(os.path.join(d, "2"))
  ckpt = checkpoint.Checkpointer(d, keep=2)
  step, state, meta = ckpt.restore_latest(_target(r), r.model_meta())
  assert step == 1
  ckpt.save(2, state, {"counters": meta["counters"], "model": r.model_meta()})
  assert sorted(os.listdir(d)) == ["1", "2", "2.damaged"]
  assert "2.damaged" in capsys.readouterr().err
  assert ckpt.restore_latest(_target(r), r.model_meta())[0] == 2


def test_run_resumes_from_the_newest_good_checkpoint(saved, tmp_path, capsys):
  r, _, params = saved
  workdir = tmp_path / "run"
  shutil.copytree(saved[1], workdir / "checkpoints")
  _flip(str(workdir / "checkpoints" / "2"))
  r2 = train.Run(tiny.get_config("smoke"), str(workdir))
  assert r2.restore_latest()
  assert r2.counters.step == 1
  assert _equal(r2.params, params[1])
  assert str(workdir / "checkpoints" / "2") in capsys.readouterr().err
  r2.step()
  r2.save()  # step 2 again: the damaged one is moved aside, not in the way
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2", "2.damaged"]


# metrics.jsonl after a power loss

def _write_lines(workdir, text):
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(text)


def test_half_written_metrics_line_is_dropped_on_resume(tmp_path, caplog):
  workdir = str(tmp_path)
  _write_lines(workdir, '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
  with caplog.at_level(logging.WARNING):
    log = MetricsLog(workdir, resume_step=2)
  log.write(3, {"loss": 0.3})
  log.close()
  assert [row["step"] for row in read_metrics(workdir)] == [1, 2, 3]
  text = " ".join(rec.getMessage() for rec in caplog.records)
  assert "metrics.jsonl" in text and "line 3" in text


def test_read_metrics_skips_a_half_written_line(tmp_path, caplog):
  workdir = str(tmp_path)
  _write_lines(workdir, '{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
  with caplog.at_level(logging.WARNING):
    rows = read_metrics(workdir)
  assert rows == [{"step": 1, "loss": 0.5}]
  assert any("line 2" in rec.getMessage() for rec in caplog.records)


def test_last_line_without_newline_is_kept_apart_from_the_next(tmp_path):
  """A complete last line whose newline was lost: the next row goes on a line of its own."""
  workdir = str(tmp_path)
  _write_lines(workdir, '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}')
  log = MetricsLog(workdir, resume_step=2)
  log.write(3, {"loss": 0.3})
  log.close()
  assert [row["step"] for row in read_metrics(workdir)] == [1, 2, 3]


def test_checkpoint_directory_setting_sends_checkpoints_elsewhere(saved, tmp_path):
  """`checkpoint.directory` (a pod's gs:// URL; here a local folder, through the same epath
  code) holds the checkpoints instead of <workdir>/checkpoints; a run restores from there."""
  c = tiny.get_config("smoke")
  c.checkpoint.directory = str(tmp_path / "elsewhere")
  assert checkpoint.directory_of(c, "/any/workdir") == c.checkpoint.directory
  c.checkpoint.directory = None
  assert checkpoint.directory_of(c, "/any/workdir") == "/any/workdir/checkpoints"
  c.checkpoint.directory = _copy(saved, tmp_path)
  r = train.Run(c, str(tmp_path / "workdir"))
  assert r.ckpt.directory == c.checkpoint.directory and r.restore_latest()
  assert r.counters.step == 2 and _equal(r.params, saved[2][2])
  assert not os.path.exists(tmp_path / "workdir" / "checkpoints")


def test_evaluating_a_mistyped_workdir_is_refused_and_creates_nothing(tmp_path):
  c = tiny.get_config("smoke")
  missing = tmp_path / "runs" / "tiyn"
  with pytest.raises(UserError, match=f"no checkpoint under {missing}/checkpoints"):
    policies.restore_policy(c, str(missing), "theta")
  assert not (tmp_path / "runs").exists()


def test_storage_failures_are_told_from_other_errors():
  """A full disk (the OS's errno, or tensorstore's `[os_error_code='28']` anywhere in the chain)
  is a storage failure `Checkpointer.wait` reports in one line; other errors are bugs."""
  import errno  # noqa: PLC0415
  assert checkpoint.storage_failure(OSError(errno.ENOSPC, "No space left")) == "no space left on device"
  ts = ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']")
  try:
    try:
      raise ts
    except ValueError as inner:
      raise RuntimeError("save finalize failed") from inner
  except RuntimeError as outer:
    assert checkpoint.storage_failure(outer) == "no space left on device"
  assert checkpoint.storage_failure(OSError(errno.EDQUOT, "quota")) == "disk quota exceeded"
  assert checkpoint.storage_failure(ValueError("INVALID_ARGUMENT [os_error_code='22']")) is None
  assert checkpoint.storage_failure(KeyError("params")) is None
