"""Orbax checkpoints of the whole run state: pi_theta, optimizer, snapshot (pi_old), buffer.

Each step directory holds two items: `state` (a pytree: params, opt_state, snapshot,
buffer rows) and `meta` (JSON: counters, buffer shapes, the model architecture). Restoring
reads `meta` first, refuses a checkpoint of another architecture with a clear error, then
restores `state` into the caller's abstract structure.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores run states under `<workdir>/checkpoints`."""

  def __init__(self, directory: str, *, keep: int):
    self.directory = os.path.abspath(directory)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    buffer = state["buffer"]
    meta = {**meta, "buffer_shapes": {k: [list(v.shape), str(v.dtype)] for k, v in buffer.items()}}
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
    buffer = {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["buffer_shapes"].items()}
    target = {**target, "buffer": buffer}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    state = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract))).state
    return state, meta
