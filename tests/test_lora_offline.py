"""An offline round file written by `oapl_jax.generate` from a LoRA checkpoint says which
adapters sampled it (issue 63 point 1): its header's policy.adapters holds the adapters'
settings, their sha256 as the checkpoint holds them and the base's {path, sha256}; its answers'
log-probs are those of the base merged with exactly those adapters."""

import numpy as np
import pytest

from configs import tiny
from oapl_jax import checkpoint, train
from oapl_jax.errors import UserError
from oapl_jax.generate import generate
from oapl_jax.placement import seq_len
from oapl_jax.rl import offline


def test_a_round_file_from_a_lora_checkpoint_names_its_adapters(tmp_path):
  import jax  # noqa: PLC0415
  c = tiny.get_config("smoke")
  c.warmup.steps = c.warmup.noisy_steps = 0
  c.model.lora.rank, c.model.lora.alpha = 4, 8.0
  c.rl.offline.problems, c.rl.offline.check_rows = 4, 8
  run = tmp_path / "run"
  r = train.Run(c, str(run))
  keys = iter(jax.random.split(jax.random.key(2), 1000))
  r.params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), r.params)
  r.save()  # pi_theta: trained adapters; pi_old (the snapshot) still the initial ones

  files = {}
  for policy in ("theta", "snapshot"):
    files[policy] = str(tmp_path / f"{policy}.npz")
    generate(c, files[policy], str(run), policy)
  theta, snapshot = (offline.read(files[p]).header["policy"] for p in ("theta", "snapshot"))
  assert theta["adapters"] == {"rank": 4, "alpha": 8.0, "targets": list(c.model.lora.targets),
                               "param_dtype": "float32", "sha256": checkpoint.tree_digest(r.params),
                               "base": r.base_record}
  assert snapshot["adapters"]["sha256"] == checkpoint.tree_digest(r.snapshot) != theta["adapters"]["sha256"]
  assert "adapters, rank 4" in theta["source"], theta

  # the answers are the named adapters' samples: rescored with the base merged with them they
  # agree (float32: within 1e-4 per token), with the other adapters they do not
  recompute = offline.logprob_fn(c, r.engine_graphdef, r.mesh)
  data = offline.read(files["theta"])
  kw = dict(seq_len=seq_len(c), pad_id=r.sampler.tokenizer.pad_id, what="pi_theta")
  assert offline.check_logprobs(data, c, recompute, r.engine_copy(r.params), **kw) < 1e-4
  with pytest.raises(UserError, match="its log-probs are not those of"):
    c.rl.offline.logprob_tol = 1e-3
    offline.check_logprobs(data, c, recompute, r.engine_copy(r.snapshot), **kw)
