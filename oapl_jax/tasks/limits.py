"""Prompt lengths: a prompt the sampler cannot prefill is refused when the task makes it.

The engine's prefill buffer holds `sampling.max_prompt_len` tokens. A longer prompt used to
pass loading, eval and the first checkpoint and only fail at its first rollout, naming neither
the row nor the setting; the tasks check every prompt as they make it, counting tokens exactly
as the trainer encodes them (`tokenizer.encode(prompt, add_bos=True)`).
"""

from __future__ import annotations

SETTING = "sampling.max_prompt_len"


def prompt_tokens(tokenizer, prompt: str) -> int:
  """Tokens of `prompt` as the trainer feeds it to the engine (chat-formatted text, BOS added)."""
  return len(tokenizer.encode(prompt, add_bos=True))


def too_long(tokenizer, prompt: str, max_prompt_len: int | None) -> str | None:
  """Why `prompt` does not fit in `max_prompt_len` tokens, or None (also for no limit)."""
  if max_prompt_len is None:
    return None
  n = prompt_tokens(tokenizer, prompt)
  if n <= max_prompt_len:
    return None
  return (f"prompt of {n} tokens (chat template and BOS included) is longer than "
          f"{SETTING}={max_prompt_len}")
