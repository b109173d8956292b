"""The names a config's device settings are checked against: mesh axes and named topologies.

JAX-free (names and numbers), so that `oapl_jax.config` can check `mesh.topology` and
`sharding.rules` without starting JAX, and the memory planner and the run read one table.

`MESH_AXES` are the trainer's mesh axes (`config.mesh`, `sharding.make_mesh`). `TOPOLOGIES`
names the device topologies `config.mesh.topology` may give. A TPU slice is named by its
TensorCores (Cloud TPU's convention): v4 and v5p chips hold two TensorCores that JAX shows as
one device ("megacore"), so `v5p-64` is 32 devices; v5e and v6e chips have one TensorCore each,
so `v5e-64` is 64 devices. A TPU VM host drives 4 chips (v4, v5p; v5e and v6e slices of more
than 8 chips), or all 8 of a one-host v5e-8 / v6e-8: one JAX process per host. GPU entries are
one host's GPUs (`h100x8`), one process.
"""

from __future__ import annotations

import dataclasses

MESH_AXES = ("data", "fsdp", "tensor")  # The trainer's mesh axes; the ones a rule may name.

GiB = 1024**3

LOCAL = "auto"  # config.mesh.topology: the devices this process finds (their kind and memory), as None


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named set of devices: how many, over how many hosts (one JAX process each), and each
  device's memory (HBM) in bytes."""

  name: str
  devices: int
  device_bytes: int
  devices_per_host: int

  @property
  def processes(self) -> int:
    """JAX processes of a run on this topology (one per host)."""
    return max(1, self.devices // self.devices_per_host)


def _tpu(generation: str, cores: int, cores_per_device: int, hbm_gib: float) -> Topology:
  """A TPU slice of `cores` TensorCores (its Cloud TPU name); hosts of 4 chips, but for the
  one-host 8-chip slices of the single-core generations (v5e-8, v6e-8)."""
  devices = cores // cores_per_device
  per_host = 8 if cores_per_device == 1 and devices == 8 else min(4, devices)
  return Topology(f"{generation}-{cores}", devices, int(hbm_gib * GiB), per_host)


TPU_GENERATIONS = ("v4", "v5p", "v5e", "v6e")  # the first part of a TPU slice's name
TOPOLOGIES: dict[str, Topology] = {}
for _cores in (8, 16, 32, 64, 128, 256, 512, 1024):
  for _t in (_tpu("v4", _cores, 2, 32), _tpu("v5p", _cores, 2, 95), _tpu("v5e", _cores, 1, 16),
             _tpu("v6e", _cores, 1, 32)):
    TOPOLOGIES[_t.name] = _t
for _generation, _hbm in (("v5e", 16), ("v6e", 32)):  # one-host slices of 1 and 4 chips (Colab: v5e-1)
  for _cores in (1, 4):
    TOPOLOGIES[f"{_generation}-{_cores}"] = _tpu(_generation, _cores, 1, _hbm)
for _gpu, _gib in (("a100", 80), ("h100", 80), ("h200", 141), ("a100-40g", 40), ("l4", 24), ("t4", 16)):
  for _n in (1, 2, 4, 8):
    TOPOLOGIES[f"{_gpu}x{_n}"] = Topology(f"{_gpu}x{_n}", _n, int(_gib * 1e9), _n)

# Per device (a chip; v4 and v5p: both TensorCores): (name, peak dense bf16 FLOP/s, HBM bytes/s),
# Cloud TPU's published figures; the roofline of `--dry_run=compile` (oapl_jax/aot.py).
CHIPS: dict[str, tuple[str, float, float]] = {
    "v4": ("TPU v4", 275e12, 1228e9),
    "v5p": ("TPU v5p", 459e12, 2765e9),
    "v5e": ("TPU v5e", 197e12, 819e9),
    "v6e": ("TPU v6e", 918e12, 1640e9),
    # NVIDIA's published dense (no sparsity) bf16 / fp16 tensor-core figures, SXM parts
    "a100": ("NVIDIA A100", 312e12, 2039e9),
    "h100": ("NVIDIA H100", 989e12, 3350e9),
    "h200": ("NVIDIA H200", 989e12, 4800e9),
    "l4": ("NVIDIA L4", 121e12, 300e9),
    "t4": ("NVIDIA T4", 65e12, 320e9),
}
# JAX's `device_kind` (lower case) -> CHIPS key, first match wins ("TPU v5 lite" is a v5e).
_DEVICE_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"), ("v5p", "v5p"),
                 ("v5", "v5p"), ("v4", "v4"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
                 ("l4", "l4"), ("t4", "t4"))


def chip_of(device_kind: str) -> tuple[str, float, float] | None:
  """The CHIPS entry of a JAX device's `device_kind` ("TPU v5p", "NVIDIA H100 80GB HBM3"), or
  None (a CPU, or a chip not in the table)."""
  kind = device_kind.lower()
  return next((CHIPS[key] for pattern, key in _DEVICE_KINDS if pattern in kind), None)
