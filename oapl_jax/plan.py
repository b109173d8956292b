"""Memory planner: bytes per device of a run's state and activations, against a topology.

TOPOLOGIES names the device topologies `config.mesh.topology` may give. A TPU slice is named
by its TensorCores (Cloud TPU's convention): v4 and v5p chips hold two TensorCores that JAX
shows as one device ("megacore"), so `v5p-64` is 32 devices; v5e and v6e chips have one
TensorCore each, so `v5e-64` is 64 devices. GPU entries are one host's GPUs (`h100x8`).
"""

from __future__ import annotations

import dataclasses

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Topology:
  """Devices of a named topology and each device's memory (HBM) in bytes."""

  name: str
  devices: int
  device_bytes: int


def _tpu(generation: str, cores: int, cores_per_device: int, hbm_gib: float) -> Topology:
  name = f"{generation}-{cores}"
  return Topology(name, cores // cores_per_device, int(hbm_gib * GiB))


TOPOLOGIES: dict[str, Topology] = {}
for _cores in (8, 16, 32, 64, 128, 256, 512, 1024):
  for _t in (_tpu("v4", _cores, 2, 32), _tpu("v5p", _cores, 2, 95), _tpu("v5e", _cores, 1, 16),
             _tpu("v6e", _cores, 1, 32)):
    TOPOLOGIES[_t.name] = _t
for _gpu, _gib in (("a100", 80), ("h100", 80), ("h200", 141)):
  for _n in (1, 2, 4, 8):
    TOPOLOGIES[f"{_gpu}x{_n}"] = Topology(f"{_gpu}x{_n}", _n, int(_gib * 1e9))
