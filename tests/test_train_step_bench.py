"""benchmarks/train_step.py's bookkeeping: the FLOP count behind its MFU figures and the batch
every side trains on (hand-checked; no framework runs)."""

import importlib.util
import os

import numpy as np

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "train_step.py")
_spec = importlib.util.spec_from_file_location("train_step_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_forward_macs_counts_weights_and_the_causal_half_of_attention():
  # tiny Qwen3: E 256, N 4, K 2, D 64, F 768, V 1024, 4 layers
  per_position = 4 * (256 * (4 + 2 * 2) * 64 + 4 * 64 * 256 + 3 * 256 * 768) + 256 * 1024
  assert per_position == 3_407_872
  # one row of 3 positions: q.k and p.v over 1 + 2 + 3 = 6 (query, key) pairs per head
  assert bench.forward_macs(1, 3) == 3 * per_position + 4 * 2 * 4 * 64 * 6
  assert bench.forward_macs(8, 3) == 8 * bench.forward_macs(1, 3)


def test_batch_and_shape_parsing():
  assert bench.parse_shape("8x32+2048") == (8, 32, 2048)
  b = bench.make_batch(16, 5, 7)
  assert b["tokens"].shape == (16, 12) and b["mask"].shape == (16, 11)
  assert (b["mask"][:, :4] == 0).all() and (b["mask"][:, 4:] == 1).all()  # targets 5.. = answer
  assert (b["sampler_logprobs"][b["mask"] > 0] < 0).all()
  assert set(np.unique(b["rewards"])) <= {0.0, 1.0}
  np.testing.assert_array_equal(b["tokens"], bench.make_batch(16, 5, 7)["tokens"])  # one seed
