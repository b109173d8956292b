"""An offline round file written by `oapl_jax.generate` from a LoRA checkpoint says which
adapters sampled it (issue 63 point 1): its header's policy.adapters holds the adapters'
settings, their sha256 as the checkpoint holds them and the base's {path, sha256}; its answers'
log-probs are those of the base merged with exactly those adapters. Offline mode trains adapters
(over a plain or an int8 base) on such files and on the rounds it samples itself."""

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


@pytest.mark.parametrize("base_quant", ["none", "int8"])
def test_offline_rounds_train_adapters_then_online(tmp_path, base_quant):
  """rl.mode=offline with model.lora: round 1 is a file `generate` wrote of the config's base
  (under model.base_quant the int8 base read back, the run's pi_old; its check passes), round 2
  is sampled by pi_old (base + the adapters of step 2, named in its header), then two online
  steps; the adapters move, the base does not. A file of the unquantised base is another
  policy for an int8 run: its rescoring differs by 0.0037 nats per token on this model, within
  the default rl.offline.logprob_tol (0.05, sized for bfloat16 rounding) and refused at 1e-3."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  c = tiny.get_config("smoke")
  c.warmup.steps = c.warmup.noisy_steps = 0
  c.model.lora.rank, c.model.lora.alpha, c.model.base_quant = 4, 8.0, base_quant
  c.rl.mode, c.train.steps = "offline", 6
  c.rl.offline.update(problems=8, epochs=1, rounds=2, check_rows=8)
  first = str(tmp_path / "round1.npz")
  generate(c, first)
  c.rl.offline.path = first
  r = train.Run(c, str(tmp_path / "run"))
  base = jax.tree.map(np.asarray, r.base)
  ms = [r.step() for _ in range(2)]
  version_1 = checkpoint.tree_digest(r.snapshot)  # pi_old from step 2 on: round 2's sampler
  ms += [r.step() for _ in range(4)]
  assert [m["policy_version"] for m in ms] == [0, 0, 1, 1, 2, 2]
  assert [m["samples_generated"] for m in ms[:4]] == [0, 0, 64, 64]
  assert all(np.isfinite(m["loss"]) for m in ms) and ms[1]["loss"] > 0
  second = offline.read(str(tmp_path / "run" / "offline" / "round_2.npz"))
  assert second.header["policy"]["adapters"] == {**r.lora.record(), "sha256": version_1, "base": r.base_record}
  assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(r.base), jax.tree.leaves(base)))
  moved = [p for p, v in nnx.to_flat_state(r.params) if p[-1] == "lora_b" and np.any(np.asarray(v.get_value()))]
  assert moved
  r.close()
  if base_quant == "int8":  # a file of the unquantised base is not this run's pi_old
    plain = str(tmp_path / "plain.npz")
    c.model.base_quant, c.rl.offline.path = "none", None
    generate(c, plain)
    c.model.base_quant, c.rl.offline.path, c.rl.offline.logprob_tol = "int8", plain, 1e-3
    other = train.Run(c, str(tmp_path / "other"))
    with pytest.raises(UserError, match="its log-probs are not those of this run's pi_old"):
      other.step()
    other.close()
