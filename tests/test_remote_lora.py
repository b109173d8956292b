"""Remote mode under model.lora (issue 63): the trainer publishes pi_old as its adapters alone, with
its frozen base's identity in the header; a sampler job builds the base once, refuses another
base in one line, and merges each version's adapters into it before sampling."""

import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from oapl_jax import config as config_lib
from oapl_jax.models import build
from oapl_jax.rl import remote
from test_remote import COMMON, REPO, _env, _losses, _start, _wait

LORA = ["--config.model.lora.rank=4", "--config.model.lora.alpha=8.0"]
EARNS = ["--config.seed=3", "--config.warmup.steps=200", "--config.warmup.noisy_steps=50"]  # a base that earns rewards


def _lora_config(*overrides):
  c = config_lib.repo_config("tiny.py:smoke")
  c.model.lora.rank, c.model.lora.alpha, c.rl.mode = 4, 8.0, "remote"
  c.rl.groups_per_rollout = 4  # as COMMON
  for name, value in overrides:
    *sections, field = name.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[field] = value
  return c


def _adapter_bytes(config) -> int:
  """The adapters' bytes in model.dtype (what a snapshot of them must weigh, less its header)."""
  size = np.dtype(config.model.dtype).itemsize
  return sum(int(np.prod(x.shape)) * size for x in jax.tree.leaves(build.lora_abstract(config)[1]))


def test_a_lora_trainer_publishes_adapters_only_and_one_reproducible_sampler_gives_the_sync_losses(tmp_path):
  warm = [*EARNS, f"--config.warmup.cache_dir={tmp_path / 'warm'}"]  # one warm-up, cached for all three
  sync = tmp_path / "sync"
  p = _start("oapl_jax.main", [*COMMON, *LORA, *warm, f"--workdir={sync}"], tmp_path / "sync.log", _env())
  _wait(p, tmp_path / "sync.log")
  workdir = tmp_path / "remote"
  args = [*COMMON, *LORA, *warm, "--config.rl.mode=remote", "--config.rl.remote.reproducible=True",
          f"--workdir={workdir}"]
  trainer = _start("oapl_jax.main", args, tmp_path / "trainer.log", _env())
  sampler = _start("oapl_jax.sample", args, tmp_path / "sampler.log", _env())
  _wait(trainer, tmp_path / "trainer.log")
  _wait(sampler, tmp_path / "sampler.log")
  config = _lora_config()
  adapters = _adapter_bytes(config)
  full = sum(int(np.prod(x.shape)) * np.dtype(config.model.dtype).itemsize
             for x in jax.tree.leaves(build.abstract_model(config)[2]))
  snapshots = sorted((workdir / "remote" / "snapshots").iterdir())
  assert [s.name for s in snapshots] == ["v00000000.npz", "v00000001.npz"]
  for path in snapshots:
    raw = path.read_bytes()
    with np.load(io.BytesIO(raw)) as z:
      header, members = str(z["header"]), len(z.files)
    # the adapters' bytes, the header (numpy stores text in 4 bytes a character), and the zip's and
    # npy's headers of each member (about 250 bytes)
    assert adapters <= len(raw) <= adapters + 4 * len(header) + 320 * members, (path, len(raw), adapters)
    assert '"base": {"path": null, "sha256": "' in header and '"lora": {"alpha": 8.0' in header
  assert full > 4 * len(snapshots[0].read_bytes())  # not the merged weights
  with np.load(snapshots[1]) as z:  # version 1's adapters moved: B is not its zero init
    names = [leaf["name"] for leaf in json.loads(str(z["header"]))["leaves"]]
    assert all(np.any(z[f"leaf{i}"]) for i, name in enumerate(names) if "lora_b" in name)
  said = open(tmp_path / "sampler.log").read()
  assert "the trainer marked its run done" in said and "MiB of adapters, read and merged in" in said, said[-3000:]
  # the sync run's losses, rewards and versions, bit for bit: the sampler merges the same adapters
  # into the same base (built from the same warm-up cache) by the same jitted function
  assert _losses(workdir / "metrics.jsonl") == _losses(sync / "metrics.jsonl")
  assert [v for *_, v in _losses(workdir / "metrics.jsonl")] == [0, 0, 0, 1, 1, 1]  # a refresh was crossed
  assert any(reward > 0 for _, _, reward, _ in _losses(workdir / "metrics.jsonl"))


def test_a_sampler_job_given_another_base_is_refused_in_one_line(tmp_path):
  """A snapshot whose adapters were trained on a base other than the one the sampler job builds
  (here: the header names another sha256; in life, another model.path or warm-up) stops the job
  at once with one line and exit code 2; it samples nothing."""
  config = _lora_config(("warmup.steps", 0), ("warmup.noisy_steps", 0))
  root = str(tmp_path / "run" / "remote")
  arch = build.abstract_model(config)[0].architecture()
  adapters = jax.tree.map(lambda x: np.zeros(x.shape, config.model.dtype), build.lora_abstract(config)[1])
  meta = {**arch, "lora": build.lora_of(config).record(), "base": {"path": None, "sha256": "0" * 64}}
  remote.publish_snapshot(root, adapters, version=0, snapshot_step=0, model_meta=meta)
  remote.write_status(root, {"next_rollout": 0, "version": 0, "step": 0, "done": False, "steps": 6,
                             "settings": remote.served_settings(config, arch)})
  p = subprocess.run([sys.executable, "-m", "oapl_jax.sample", *COMMON, *LORA, "--config.warmup.steps=0", "--config.warmup.noisy_steps=0",
                      "--config.rl.mode=remote", f"--workdir={tmp_path / 'run'}", "--max_rollouts=1",
                      "--max_idle_s=60"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
  errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
  assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
  assert errors[0].startswith(f"error: snapshot {root}/snapshots/v00000000.npz: its adapters were trained on "
                              "another base (model.path=None, sha256 0000000000000000...) than this sampler "
                              "job's (model.path=None, sha256 "), errors[0]
  assert p.stderr.splitlines()[-1] == errors[0]
  rollouts = os.path.join(root, "rollouts")
  assert not os.path.isdir(rollouts) or not os.listdir(rollouts)


def test_a_lora_trainer_of_several_processes_is_refused_in_one_line(tmp_path, monkeypatch):
  """Its base's sha256 is taken over its processes' shards (`checkpoint.tree_digest`): no sampler
  job could match it, so the run is refused before it publishes anything."""
  from types import SimpleNamespace  # noqa: PLC0415

  from oapl_jax.errors import ConfigError  # noqa: PLC0415
  from oapl_jax.rl.sources import RemoteSource  # noqa: PLC0415
  config = _lora_config()
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ConfigError) as e:
    RemoteSource(SimpleNamespace(config=config, lora=build.lora_of(config)), str(tmp_path))
  assert str(e.value).startswith("config.model.lora.rank=4: remote mode publishes adapters for a trainer of one "
                                 "process only (this one has 2)") and "\n" not in str(e.value)
  assert not (tmp_path / "remote").exists()
