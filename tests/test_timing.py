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


def test_cpu_peak_is_measured_and_an_override_wins():
  cpu = jax.devices("cpu")[0]
  assert topology.chip_of(cpu.device_kind) is None
  peak, source = timing.device_peak(cpu)
  assert 1e8 < peak < 1e14 and "measured" in source
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
  assert t == {"train_tokens_per_s_per_device": 1000.0, "mfu": 0.5}
