"""Orbax checkpoints of the whole run state: pi_theta, optimizer, snapshot (pi_old), buffer.

Each step directory holds two items: `state` (a pytree: params, opt_state, snapshot, the
buffer's rows and, in async mode, the rows of the rollout in flight) and `meta` (JSON:
counters, the shapes of those rows, the model architecture). Restoring
reads `meta` first, refuses a checkpoint of another architecture with a clear error, then
restores `state` into the caller's abstract structure.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


ROWS = ("buffer", "inflight")  # host row dicts of a run state (names of `state` entries)


class Checkpointer:
  """Saves and restores run states under `<workdir>/checkpoints`."""

  def __init__(self, directory: str, *, keep: int):
    self.directory = os.path.abspath(directory)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """state: pytrees of device arrays, plus host row dicts (`ROWS`) whose shapes vary."""
    meta = {**meta, **{f"{name}_shapes": {k: [list(v.shape), str(v.dtype)] for k, v in state[name].items()}
                       for name in ROWS if name in state}}
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._mgr.wait_until_finished()

  def restore(self, step: int, target: dict[str, Any], model_meta: dict[str, Any]):
    """Returns (state, meta). `target` gives the structure of params/opt_state/snapshot."""
    meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if meta.get("model") != model_meta:
      raise ValueError(
          f"checkpoint {self.directory}/{step} is of another model:\n  saved:  {meta.get('model')}"
          f"\n  config: {model_meta}\nUse another --workdir or the matching config.model.")
    rows = {name: {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta[f"{name}_shapes"].items()}
            for name in ROWS if f"{name}_shapes" in meta}
    target = {**target, **rows}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    state = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract))).state
    return state, meta
