"""Packed rows (`train.packing`, oapl_jax/rl/packing.py): the packer, and the packed train step
against the padded one on the same answers.

The packed step computes the same per-answer log-ratios, loss, gradients and updated weights as
the padded step, to float32 rounding: the model sees each answer at the same positions with
the same context (its own segment), but attention's key blocks and the log-prob kernel's tiles
fall at other places in a packed row, so the online softmax and the sums run in another order
(relative differences ~1e-6 in the loss and gradients; see `_close`).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from oapl_jax.config import ConfigError, repo_config, validate
from oapl_jax.models.build import init_model
from oapl_jax.placement import seq_len
from oapl_jax.rl import packing
from oapl_jax.rl.buffer import Rows
from oapl_jax.rl.packing import max_micro_batches
from oapl_jax.rl.step import Batch, PackedBatch, make_optimizer, make_train_step, packing_shape
from oapl_jax.sampling import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def rows_of(lengths, prompt_lengths, t: int, *, vocab: int, seed: int = 0, pad_id: int = 0,
            counted=None) -> Rows:
  """Padded rows as `logprobs.make_batch` lays them out: prompt, answer, then pad_id."""
  rng = np.random.default_rng(seed)
  n = len(lengths)
  tokens = np.full((n, t), pad_id, np.int32)
  mask = np.zeros((n, t - 1), np.float32)
  sampler = np.zeros((n, t - 1), np.float32)
  for i, (a, p) in enumerate(zip(lengths, prompt_lengths)):
    tokens[i, :p + a] = rng.integers(1, vocab, p + a)
    if counted is None or counted[i]:
      mask[i, p - 1:p - 1 + a] = 1.0
    sampler[i, p - 1:p - 1 + a] = -rng.uniform(0.1, 3.0, a)
  return Rows(tokens=tokens, mask=mask, sampler_logprobs=sampler,
              rewards=rng.integers(0, 2, n).astype(np.float32), answer_lengths=np.asarray(lengths),
              version=np.zeros(n, np.int32), snapshot_step=np.zeros(n, np.int32))


# --- the packer ---------------------------------------------------------------------------


def test_pack_lays_each_answer_out_as_its_padded_row_within_a_segment():
  t = 16
  rows = rows_of([3, 9, 1, 5, 12, 2], [3, 2, 4, 3, 2, 3], t, vocab=30)
  k = packing.max_micro_batches(len(rows), t, rows=2, budget=20)
  packed = packing.pack(rows, rows_per_micro=2, budget=20, micro_batches=k)
  lengths = packing.used_lengths(rows)
  np.testing.assert_array_equal(lengths, [6, 11, 5, 8, 14, 5])
  assert packed.real_tokens == lengths.sum()
  assert (packed.member.sum(axis=0) == 1).all()  # every answer in exactly one micro-batch
  for i, n in enumerate(lengths):
    mb = int(np.argmax(packed.member[:, i]))
    r, a = packed.answer_row[mb, i], packed.answer_start[mb, i]
    np.testing.assert_array_equal(packed.tokens[mb, r, a:a + n], rows.tokens[i, :n])
    np.testing.assert_array_equal(packed.positions[mb, r, a:a + n], np.arange(n))
    seg = packed.segment_ids[mb, r, a:a + n]
    assert (seg == seg[0]).all() and seg[0] > 0
    if a + n < 20:  # the next position is another segment or padding
      assert packed.segment_ids[mb, r, a + n] != seg[0]
  # segments number 1, 2, ... along each row, then the padding as one more
  for ids, toks in zip(packed.segment_ids.reshape(-1, 20), packed.tokens.reshape(-1, 20)):
    assert ids[0] == 1 and (np.diff(ids) >= 0).all() and (np.diff(ids) <= 1).all()


def test_first_fit_decreasing_is_deterministic_and_fills_rows_in_order():
  lengths = np.array([5, 9, 9, 2, 7, 0, 3])
  row, start = packing.first_fit_decreasing(lengths, 12, 6)
  # longest first (ties by index): 9 (i=1) -> row 0, 9 (i=2) -> row 1, 7 -> row 2, 5 -> row 2
  # is full (7+5=12), 3 -> row 0 (9+3), 2 -> row 1 (9+2); length 0 is not placed
  np.testing.assert_array_equal(row, [2, 0, 1, 1, 2, -1, 0])
  np.testing.assert_array_equal(start, [7, 0, 0, 9, 0, 0, 9])
  with pytest.raises(ValueError, match="do not fit"):
    packing.first_fit_decreasing(lengths, 12, 2)


@pytest.mark.parametrize("seed", range(5))
def test_the_worst_case_micro_batch_count_always_holds_the_step(seed):
  rng = np.random.default_rng(seed)
  t, n = 40, 64
  for budget, rows in ((40, 4), (100, 3), (57, 5)):
    k = packing.max_micro_batches(n, t, rows=rows, budget=budget)
    for lengths in (rng.integers(1, t + 1, n), np.full(n, t), rng.integers(t // 2, t + 1, n)):
      row, _ = packing.first_fit_decreasing(lengths, budget, k * rows)  # never raises
      assert row.max() < k * rows


def test_an_answer_with_no_counted_token_is_not_packed():
  rows = rows_of([4, 6, 3, 2], [3, 3, 3, 3], 12, vocab=20, counted=[True, False, True, True])
  packed = packing.pack(rows, rows_per_micro=4, budget=12, micro_batches=1)
  np.testing.assert_array_equal(packed.member[0], [1, 0, 1, 1])
  assert packed.real_tokens == 7 + 6 + 5


# --- the packed step equals the padded step -------------------------------------------------


def _config(loss="oapl", accum=1, base="tiny", **changes):
  """base: "tiny" (tiny.py:smoke with room for long-tailed answers, T = 28), "reason" or "mix"
  (their :smoke configs, their own row lengths: T = 78 and 70)."""
  if base == "tiny":
    c = tiny.get_config("smoke")
    c.sampling.max_new_tokens = 20
  else:
    c = repo_config(f"{base}.py:smoke")
  c.rl.group_size, c.rl.groups_per_step, c.train.grad_accum = 4, 4, accum  # 16 answers
  c.rl.loss, c.rl.old_logprobs = loss, "snapshot"
  c.sampling.temperature, c.sampling.top_p = 0.8, 0.9
  c.train.lr, c.train.warmup_ratio, c.train.eps = 1e-3, 0.0, 1e-3  # eps: see test_mesh_train
  c.train.attn_block = 8  # several key blocks per row: segments straddle block edges
  for k, v in changes.items():
    section, name = k.split(".")
    c[section][name] = v
  return c


def _answers(c, seed=0, counted=None):
  rng = np.random.default_rng(seed)
  n, t = c.rl.groups_per_step * c.rl.group_size, seq_len(c)
  lengths = np.minimum(rng.pareto(1.2, n).astype(int) + 1, c.sampling.max_new_tokens)
  prompts = np.repeat(rng.integers(3, c.sampling.max_prompt_len + 1, c.rl.groups_per_step), c.rl.group_size)
  return rows_of(lengths, prompts, t, vocab=c.model.vocab_size, seed=seed, counted=counted)


def _one_step(c, rows):
  """(metrics, new params) of one step from fixed weights (pi_old != pi_theta)."""
  validate(c)
  _, graphdef, params = init_model(c)
  other = c.copy_and_resolve_references()
  other.seed = c.seed + 1
  _, _, old = init_model(other)
  optimizer = make_optimizer(c.train, c.train.steps)
  step = make_train_step(c, graphdef, optimizer, SamplingParams.from_config(c.sampling))
  params = step.place_params(jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, params, old))
  reference = step.place_params(old) if c.rl.loss == "grpo" and c.rl.grpo.kl_coef else None
  batch, layout = step.batch_of(rows)
  assert isinstance(batch, PackedBatch if c.train.packing else Batch)
  new, _, m = step(params, step.init_opt_state(params), step.snapshot_of(old), batch, reference)
  return jax.device_get(m), jax.device_get(new), layout


def _close(padded, packed, rtol=2e-5, atol=2e-6):
  (m0, p0, _), (m1, p1, _) = padded, packed
  assert set(m0) == set(m1)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=rtol, atol=atol, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=rtol, atol=atol), p0, p1)


@pytest.mark.parametrize("loss,accum,rows,budget", [
    ("oapl", 1, 0, 0),  # one micro-batch of 16 rows of T: always active
    ("oapl", 2, 2, 40),  # rows of 40 > T tokens, 2 per micro-batch; several skipped
    ("grpo", 1, 3, 0),
])
def test_the_packed_step_equals_the_padded_step(loss, accum, rows, budget):
  c = _config(loss, accum)
  answers = _answers(c)
  padded = _one_step(c, answers)
  packed = _one_step(_config(loss, accum, **{"train.packing": True, "train.pack_rows": rows,
                                             "train.pack_budget": budget}), answers)
  _close(padded, packed)
  assert packed[0]["loss"] != 0.0
  # one micro-batch of T-token rows computes what the padded step does; more room fills less
  assert packed[2]["pad_fraction"] <= padded[2]["pad_fraction"]
  if budget:
    assert packed[2]["pad_fraction"] < padded[2]["pad_fraction"] - 0.2
    assert packed[2]["micro_batches"] < packing.max_micro_batches(16, seq_len(c), rows=rows, budget=budget)


@pytest.mark.parametrize("base", ["reason", "mix"])
def test_the_packed_step_equals_the_padded_step_on_the_built_in_tasks_configs(base):
  c = _config("oapl", 2, base)
  t = seq_len(c)
  answers = _answers(c, seed=2)
  padded = _one_step(c, answers)
  packed = _one_step(_config("oapl", 2, base, **{"train.packing": True, "train.pack_rows": 2,
                                                 "train.pack_budget": 2 * t}), answers)
  _close(padded, packed)
  assert packed[0]["loss"] != 0.0 and packed[2]["pad_fraction"] < padded[2]["pad_fraction"]


def test_the_packed_step_with_the_k3_kl_and_truncated_answers_left_out():
  c = _config("grpo", 1, **{"rl.count_truncated": False})
  c.rl.grpo.kl_coef = 0.05
  counted = np.random.default_rng(3).random(16) > 0.2
  answers = _answers(c, seed=3, counted=counted)
  padded = _one_step(c, answers)
  p = _config("grpo", 1, **{"train.packing": True, "train.pack_rows": 2, "train.pack_budget": 60})
  p.rl.grpo.kl_coef = 0.05
  packed = _one_step(p, answers)
  _close(padded, packed)
  assert packed[0]["kl"] > 0


def test_a_short_budget_and_rows_that_do_not_split_over_processes_are_refused():
  c = _config(**{"train.packing": True, "train.pack_budget": 20})
  with pytest.raises(ConfigError, match="train.pack_budget"):
    validate(c)
  c = _config(**{"train.packing": True, "train.pack_rows": 6})
  validate(c)  # the process count is known at the run's start, not in the config
  assert packing_shape(c, 2)[1:] == packing_shape(c, 1)[1:] == (6, seq_len(c))
  with pytest.raises(ConfigError, match="train.pack_rows: 6 packed rows .* 4 processes"):
    packing_shape(c, 4)


def test_each_process_packs_its_share_into_its_rows():
  """Over P processes K is one process's worst case: B / P answers into R / P rows."""
  c = _config(**{"train.packing": True, "train.pack_rows": 4})
  b, t = c.rl.groups_per_step * c.rl.group_size, seq_len(c)
  for p in (1, 2, 4):
    k, r, s = packing_shape(c, p)
    assert (r, s) == (4, t) and k == max_micro_batches(b // p, t, rows=4 // p, budget=t)


# --- on a mesh of 8 devices, with accumulation and with adapters ---------------------------

MESH_CHILD = textwrap.dedent("""
    import jax, numpy as np
    from oapl_jax import sharding
    from oapl_jax.models import build
    from oapl_jax.rl.step import PackedBatch, make_optimizer, make_train_step
    from oapl_jax.sampling import SamplingParams
    from test_packing import _answers, _config

    def one_step(c, devices, lora):
      mesh = sharding.make_mesh(c.mesh, devices)
      key = iter(jax.random.split(jax.random.key(5), 1000))
      move = lambda t, s: jax.tree.map(lambda x: x + s * jax.random.normal(next(key), x.shape), t)
      if lora:
        _, _, base = build.init_model(c, mesh=mesh, param_dtype=c.model.dtype)
        graphdef, params = build.init_adapters(c, mesh=mesh)
      else:
        base, (_, graphdef, params) = None, build.init_model(c, mesh=mesh)
      step = make_train_step(c, graphdef, make_optimizer(c.train, c.train.steps),
                             SamplingParams.from_config(c.sampling), mesh)
      base = None if base is None else step.base_of(base)
      params = step.place_params(move(params, 0.05))  # adapters: B != 0, A gets gradients too
      snapshot = step.snapshot_of(move(params, 0.01))
      batch, _ = step.batch_of(_answers(c, seed=1))
      assert isinstance(batch, PackedBatch) == c.train.packing
      new, _, m = step(params, step.init_opt_state(params), snapshot, batch, None, base)
      return jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, new)

    assert jax.device_count() == 8
    for lora in (False, True):
      c = _config("oapl", accum=1 if lora else 2)
      c.rl.groups_per_step = 8  # 32 answers: 8 per batch shard
      if lora:
        c.model.lora.rank, c.model.lora.alpha, c.train.remat = 4, 8.0, "full"
      want = one_step(c, jax.devices()[:1], lora)
      p = c.copy_and_resolve_references()
      p.train.packing, p.train.pack_rows, p.train.pack_budget = True, 4, 40
      p.mesh.fsdp, p.mesh.tensor = 4, 2
      got = one_step(p, jax.devices(), lora)
      assert abs(want[0]["loss"]) > 1e-4, want[0]
      for k in ("loss", "grad_norm", "snapshot_vs_sampler_abs", "entropy"):
        np.testing.assert_allclose(got[0][k], want[0][k], rtol=2e-5, err_msg=k)
      for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
      print("lora" if lora else "full", "packed on fsdp 4 x tensor 2 = padded on one device; loss",
            want[0]["loss"], "micro-batches run", got[0].get("micro_batches"))
    print("OK")
""")


def test_the_packed_step_on_an_fsdp_tensor_mesh_equals_the_padded_step_on_one_device():
  """Packed on fsdp 4 x tensor 2 (8 CPU devices, a child process) against padded on one
  device: full fine-tuning with train.grad_accum 2, and low-rank adapters (remat full)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
  out = subprocess.run([sys.executable, "-c", MESH_CHILD], env=env, capture_output=True, text=True,
                       timeout=1800)
  assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
