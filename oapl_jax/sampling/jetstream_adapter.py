"""JetStream 0.2.2 against current JAX: restores `jax.tree_map`, which JAX removed.

`jetstream.core.orchestrator` calls `jax.tree_map` (freeing prefixes after insert); without it
the generate thread dies on the first request. Imported by `oapl_jax.sampling`, hence before
any orchestrator runs. The alias is set only if missing.
"""

import jax

if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map
