"""A Hugging Face tokenizer (with its chat template) behind the task tokenizer interface.

The training loop only needs ``encode(text, add_bos=...)``, ``decode(ids)`` and the
``vocab_size`` / ``pad_id`` / ``bos_id`` / ``eos_id`` properties (see
:class:`oapl_jax.tasks.base.Tokenizer`). :class:`HFTokenizer` provides them on top
of ``transformers.AutoTokenizer`` loaded from a local folder (nothing is ever downloaded),
plus :meth:`HFTokenizer.chat_prompt` to format a user message with the folder's chat template.

End of sequence: for chat models generation must stop at the end-of-turn token (e.g.
``<|im_end|>`` for Qwen), not at ``<|endoftext|>``. The checkpoint's
``generation_config.json`` is the authority on this, so when it lists ``eos_token_id`` (an int
or a list) :attr:`HFTokenizer.eos_id` is its first entry; otherwise it is the tokenizer's own
``eos_token_id``. :meth:`HFTokenizer.decode` stops at the first of *any* of these end ids.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

# Files any one of which marks a folder as holding a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model", "vocab.txt")


def _generation_eos_ids(path: str) -> list[int]:
  """The ``eos_token_id`` entries of ``path/generation_config.json`` (empty if none)."""
  gen_path = os.path.join(path, "generation_config.json")
  if not os.path.isfile(gen_path):
    return []
  try:
    with open(gen_path, encoding="utf-8") as f:
      eos = json.load(f).get("eos_token_id")
  except (OSError, ValueError, AttributeError) as e:
    raise ValueError(f"{gen_path}: cannot read eos_token_id ({e})") from e
  if eos is None:
    return []
  eos = eos if isinstance(eos, list) else [eos]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
    raise ValueError(f"{gen_path}: eos_token_id must be an int or a list of ints, got {eos!r}")
  return list(eos)


def folder_problem(path: str) -> str | None:
  """Why ``path`` is not a folder :class:`HFTokenizer` can read (no such folder, no tokenizer
  files in it), or None. ``config.validate`` asks this before a run; the constructor raises it."""
  if not os.path.isdir(path):
    return f"tokenizer folder {path!r} does not exist"
  if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
    return f"no tokenizer files in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)}"
  return None


class HFTokenizer:
  """``AutoTokenizer.from_pretrained(path, local_files_only=True)`` with the task interface.

  * ``encode(text, add_bos=True)`` never doubles the BOS token: the text is encoded with
    ``add_special_tokens=False`` (a chat-formatted prompt already holds its special tokens)
    and BOS is prepended only if the tokenizer has one and the text does not already
    start with it.
  * ``eos_id``: first ``eos_token_id`` of ``generation_config.json`` if the folder has one,
    else the tokenizer's ``eos_token_id`` (see the module docstring).
  * ``pad_id``: the pad token id, else ``eos_id``.
  * ``bos_id``: the BOS token id, or ``None`` if the tokenizer has none (e.g. Qwen).
  * ``vocab_size``: ``len(tokenizer)`` (base vocabulary plus added tokens). A model's
    embedding table may be larger; ``decode`` drops ids outside the tokenizer.

  Raises:
    FileNotFoundError: if ``path`` is not a folder holding tokenizer files.
    ValueError: if the tokenizer cannot be loaded or has no end-of-sequence token.
  """

  def __init__(self, path: str) -> None:
    path = os.fspath(path)
    problem = folder_problem(path)
    if problem is not None:
      raise FileNotFoundError(problem)
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    try:
      self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
      raise ValueError(f"cannot load the tokenizer in {path!r}: {e}") from e
    self.path = path
    gen_eos = _generation_eos_ids(path)
    own_eos = self._tok.eos_token_id
    if gen_eos:
      self._eos_id = gen_eos[0]
    elif own_eos is not None:
      self._eos_id = int(own_eos)
    else:
      raise ValueError(f"tokenizer in {path!r} has no eos token and no generation_config.json "
                       "eos_token_id")
    self._eos_ids = frozenset(gen_eos + ([int(own_eos)] if own_eos is not None else []))
    self._vocab_size = len(self._tok)

  # --- interface properties -------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """``len(tokenizer)``: number of token ids the tokenizer knows, added tokens included."""
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    """The pad token id, or ``eos_id`` if the tokenizer has no pad token."""
    pad = self._tok.pad_token_id
    return self._eos_id if pad is None else int(pad)

  @property
  def bos_id(self) -> int | None:
    """The BOS token id, or ``None`` if the tokenizer has no BOS token."""
    bos = self._tok.bos_token_id
    return None if bos is None else int(bos)

  @property
  def eos_id(self) -> int:
    """The id generation stops at (see the class docstring)."""
    return self._eos_id

  @property
  def eos_ids(self) -> frozenset[int]:
    """All end ids: generation_config's ``eos_token_id`` list plus the tokenizer's eos."""
    return self._eos_ids

  @property
  def hf_tokenizer(self):
    """The wrapped ``transformers`` tokenizer."""
    return self._tok

  # --- encode / decode ------------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of ``text`` without added special tokens; BOS prepended at most once."""
    ids = list(self._tok.encode(text, add_special_tokens=False))
    bos = self.bos_id
    if add_bos and bos is not None:
      bos_token = self._tok.bos_token
      already = (bool(bos_token) and text.startswith(bos_token)) or (ids[:1] == [bos])
      if not already:
        ids.insert(0, bos)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids`` up to (excluding) the first end id; special tokens skipped.

    Ids outside ``[0, vocab_size)`` (a model's padded embedding rows) are dropped, so
    decoding arbitrary model samples never raises.
    """
    out = []
    for i in ids:
      i = int(i)
      if i in self._eos_ids:
        break
      if 0 <= i < self._vocab_size:
        out.append(i)
    return self._tok.decode(out, skip_special_tokens=True)

  # --- chat -----------------------------------------------------------------------------

  @property
  def has_chat_template(self) -> bool:
    """Whether the folder ships a chat template."""
    return bool(getattr(self._tok, "chat_template", None))

  def chat_prompt(self, user_text: str, *, thinking: bool | None = None,
                  tools: list[dict] | None = None) -> str:
    """``user_text`` as one user turn plus the assistant generation prompt.

    Uses the folder's chat template (``add_generation_prompt=True``); ``enable_thinking`` is
    passed to the template only when ``thinking`` is not ``None`` (Qwen3-style templates
    read it; others ignore it). ``tools``: the schemas of the tools the model may call, which
    the template lists (Qwen3: in a system turn). Without a chat template, returns ``user_text``
    unchanged.
    """
    if not self.has_chat_template:
      return user_text
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    if tools:
      kwargs["tools"] = tools
    out = self._tok.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                        add_generation_prompt=True, **kwargs)
    if not isinstance(out, str):  # defensive: some versions return a list for batched input
      raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out

  def __repr__(self) -> str:
    return (f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})")
