"""Where a step's time goes (oapl_jax/timing.py): the devices' peaks, the rates' arithmetic.
A run's timing fields, their sum and a profiler trace: tests/test_e2e.py."""

import jax
import pytest

from oapl_jax import timing, topology


@pytest.mark.parametrize("kind, chip", [
    ("TPU v5p", "TPU v5p"), ("TPU v5 lite", "TPU v5e"), ("TPU v6 lite", "TPU v6e"), ("TPU v4", "TPU v4"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100"), ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"), ("Tesla T4", "NVIDIA T4"), ("NVIDIA L4", "NVIDIA L4")])
def test_a_devices_kind_names_its_published_peak(kind, chip):
  assert topology.chip_of(kind)[0] == chip


def test_a_cpu_has_no_peak_so_no_mfu_only_its_achieved_flops_and_an_override_wins():
  """A CPU has no published peak (a matmul timed once on a shared machine gave MFU > 1): its
  runs log achieved FLOP/s per device, never an MFU, unless log.peak_flops gives a figure."""
  cpu = jax.devices("cpu")[0]
  assert topology.chip_of(cpu.device_kind) is None
  peak, why = timing.device_peak(cpu)
  assert peak is None and "CPU" in why
  rates = timing.train_rates(positions=100, seconds_training=2.0, devices=2, useful_flops=8e9, peak_flops=peak)
  assert rates == {"train_tokens_per_s_per_device": 25.0, "flops_per_s_per_device": 2e9}
  assert timing.device_peak(cpu, 2e12) == (2e12, "log.peak_flops")


class _Unknown:  # an accelerator with no published figure here
  platform, device_kind = "gpu", "Some GPU 9000"


def test_an_unknown_accelerator_logs_no_mfu_rather_than_failing_the_run():
  peak, why = timing.device_peak(_Unknown())
  assert peak is None and "log.peak_flops" in why
  assert "mfu" not in timing.train_rates(positions=1, seconds_training=1.0, devices=1, useful_flops=1.0,
                                         peak_flops=peak)


def test_rates():
  r = timing.rollout_rates(answer_tokens=600, seconds_sampling=2.0, engine_devices=3, live_slot_steps=75,
                           slot_steps=100)
  assert r == {"slot_utilisation": 0.75, "answer_tokens_per_s_per_device": 100.0}
  assert timing.rollout_rates(answer_tokens=0, seconds_sampling=0.0, engine_devices=1, live_slot_steps=0,
                              slot_steps=0) == {}  # no rollout taken at this step
  t = timing.train_rates(positions=8000, seconds_training=2.0, devices=4, useful_flops=4e12, peak_flops=1e12)
  assert t == {"train_tokens_per_s_per_device": 1000.0, "flops_per_s_per_device": 5e11, "mfu": 0.5}
  assert "flops_per_s_per_device" not in timing.train_rates(  # no FLOP count, no FLOP rate
      positions=1, seconds_training=1.0, devices=1, useful_flops=0.0, peak_flops=1e12)


# --- the train step's FLOPs (aot.model_flops), counted here by hand --------------------------
# configs/tiny.py's model (presets.py "tiny_addition"): E = 128 wide, L = 2 layers, N = 4 query
# heads and K = 2 key/value heads of D = 32, SwiGLU width F = 384, V = 32 tokens. Its :smoke
# batch: 4 groups x 8 answers = 32 rows of T = 8 + 6 - 1 = 13 positions (the last token
# predicts nothing). 2 FLOPs per multiply-add.
E, L, N, K, D, F, V, T = 128, 2, 4, 2, 32, 384, 32, 13
PROJECTIONS = {  # (in, out) of each matmul of a layer
    "q_proj": (E, N * D), "k_proj": (E, K * D), "v_proj": (E, K * D), "o_proj": (N * D, E),
    "gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}
# weights a token multiplies by: 196,608 per layer, twice, and the LM head E x V (tied to the
# embedding or not; the embedding itself is a lookup: no FLOPs); norms and biases: no matmul
MATMUL_WEIGHTS = L * (E * 128 + E * 64 + E * 64 + 128 * E + 3 * E * F) + E * V
assert MATMUL_WEIGHTS == 397_312 == L * sum(i * o for i, o in PROJECTIONS.values()) + E * V


def _attention(rows):
  """Causal attention's forward, all rows: per layer and head, scores Q K^T and the weighted
  sum of V, each 2 x T x T x D, half of it under the causal mask."""
  return rows * L * N * (2 * T * T * D + 2 * T * T * D) / 2


def _tiny(arg="smoke", **changes):
  from oapl_jax.config import repo_config  # noqa: PLC0415
  c = repo_config(f"tiny.py:{arg}")
  for key, value in changes.items():
    section, name = key.split("__")
    c[section][name] = value
  return c


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_is_the_hand_count_of_the_forward_and_backward_passes(tied):
  from oapl_jax.aot import model_flops  # noqa: PLC0415
  rows = 4 * 8
  forward = 2 * MATMUL_WEIGHTS * rows * T + _attention(rows)
  assert forward == 333_332_480
  # backward: each matmul's input gradient and its weight gradient (2 x weights x tokens each),
  # attention's gradients twice its forward: the whole step is 3 x the forward
  backward = 2 * MATMUL_WEIGHTS * rows * T + 2 * MATMUL_WEIGHTS * rows * T + 2 * _attention(rows)
  flops = model_flops(_tiny(model__tie_embeddings=tied))
  assert flops == {"useful": forward + backward, "hardware": forward + backward}
  assert flops["useful"] == 999_997_440
  # a second forward under train.remat, counted in what the hardware computes, not in the useful
  remat = model_flops(_tiny(model__tie_embeddings=tied, train__remat="full"))
  assert remat == {"useful": forward + backward, "hardware": 2 * forward + backward}


def test_lora_flops_are_what_the_step_computes_no_weight_gradients_for_the_frozen_base():
  """configs/tiny.py:lora: rank r = 8 adapters on every projection (x @ A [in, r] @ B [r, out],
  two matmuls beside the frozen one), batch 16 groups x 8 answers. The frozen base (and LM head)
  runs forward and passes activation gradients back (4 x its weights per token) but computes no
  weight gradients; each adapter runs forward, activation and weight gradients (6 x)."""
  from oapl_jax.aot import model_flops  # noqa: PLC0415
  r, rows = 8, 16 * 8
  adapters = L * r * sum(i + o for i, o in PROJECTIONS.values())
  assert adapters == 2 * 8 * (256 + 192 + 192 + 256 + 512 + 512 + 512) == 38_912
  tokens = rows * T
  base = 4 * MATMUL_WEIGHTS * tokens
  own = 6 * adapters * tokens
  useful = base + own + 3 * _attention(rows)
  flops = model_flops(_tiny("lora"))
  assert flops == {"useful": useful, "hardware": useful}
  # full training of the same batch would count 6 x the base's weights: 1.37x more
  full = model_flops(_tiny("lora", model__lora=_tiny().model.lora))
  assert full["useful"] == 6 * MATMUL_WEIGHTS * tokens + 3 * _attention(rows)
  assert full["useful"] / useful > 1.3

