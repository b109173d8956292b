"""What our `Engine` needs of JetStream's own types, to be served by `jetstream.core.orchestrator`.

`oapl_jax.sampling.engine` imports no JetStream: JetStream's `engine_api` imports `token_utils`,
which imports seqio and TensorFlow (seconds of start-up, ~0.6 GiB resident), and neither the
trainer nor `rollout` needs any of it. The engine implements JetStream's `Engine` methods
itself; what needs JetStream's own types lives here:

* `SampledTokens`: what `Engine.generate` returns, JetStream's `ResultTokens` plus log-probs;
* `TokenizerAdapter` and `tokenizer_parameters()`: for `get_tokenizer` / `build_tokenizer`;
* `jax.tree_map`, which JAX removed and JetStream 0.2.2's orchestrator calls (freeing
  prefixes after insert; without it the generate thread dies on the first request), is
  restored as an alias of `jax.tree.map`, only if missing.

The engine loads this module itself (`engine._jetstream`) on the first call of a JetStream-only
method (`generate`, `get_tokenizer`, `build_tokenizer`: the orchestrator's prefill thread calls
the last two before anything else) and when it is built in a process that has already imported
JetStream's `engine_api`, and then registers `Engine` as a virtual subclass of
`engine_api.Engine` (JetStream's ABC has no behaviour to inherit, only abstract methods, which
`Engine` defines: tests/test_orchestrator.py checks that none is missing). So the orchestrator
works however it is reached, `isinstance(engine, engine_api.Engine)` holds for an engine built
after JetStream was imported (or once a JetStream method has been called), and a process that
never touches JetStream never loads it. This module imports nothing of `oapl_jax`.
"""

from typing import Any

import jax
import numpy as np
from flax import struct
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map


@struct.dataclass
class SampledTokens(engine_api.ResultTokens):
  """JetStream's `ResultTokens` plus the log-prob of each sampled token, `[S, 1]` float32."""

  log_probs: Any = None

  def convert_to_numpy(self) -> "SampledTokens":
    return SampledTokens(np.array(self.data), self.tokens_idx, self.valid_idx,
                         self.length_idx, self.samples_per_slot, np.array(self.log_probs))


def tokenizer_parameters() -> tokenizer_pb2.TokenizerParameters:
  """What `Engine.get_tokenizer` hands the orchestrator (which passes it back to
  `build_tokenizer`): the engine builds its tokenizer itself."""
  return tokenizer_pb2.TokenizerParameters(path="oapl_jax")


class TokenizerAdapter(tokenizer_api.Tokenizer):
  """One of our tokenizers (`CharTokenizer`, `HFTokenizer`) as JetStream's `Tokenizer`.

  The orchestrator calls `encode(text, is_bos=, max_prefill_length=, jax_padding=)` ->
  (padded ids, true length), `decode([id])`, and reads `pad_id`, `eos_id`, `bos_id`,
  `stop_tokens`.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def encode(self, s: str, **kwargs):
    ids = np.asarray(self.tokenizer.encode(s, add_bos=kwargs.get("is_bos", True)), np.int32)
    return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, is_bos=False,
                                  max_prefill_length=kwargs.get("max_prefill_length"),
                                  jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    return self.tokenizer.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    return self.tokenizer.bos_id
