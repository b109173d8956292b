"""A tiny random Hugging Face checkpoint (weights + tokenizer + chat template), made locally.

The real-model configs' `:tiny` variants run against it on CPU: it goes through the same
`from_hf` path, tokenizer and chat template code as Qwen3-4B or R1-Distill-Qwen-14B would.
Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few sentences.
"""

from __future__ import annotations

import os

from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from oapl_jax.models.hf import to_hf
from oapl_jax.models.presets import PRESETS
from oapl_jax.models.transformer import ModelConfig, Transformer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}")
_CORPUS = [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is 3 + 4? The answer is \\boxed{7}. Compute 12 * 5 - 6 / 2 = 57.",
    "\\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}; x^2 - 1 = (x - 1)(x + 1).",
    "def solve():\n    n = int(input())\n    print(sum(map(int, input().split())))\n",
    "Read from standard input and write to standard output. ```python\nprint('hello')\n```",
    "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n",
]


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
  """Byte-level BPE (so any text encodes) with Qwen-style chat special tokens."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_CORPUS * 4, trainer)
  return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_tiny_hf(out_dir: str, *, preset: str = "tiny_qwen3", seed: int = 0) -> str:
  """Writes a random `preset` model and its tokenizer to `out_dir`; returns `out_dir`."""
  cfg = ModelConfig(**PRESETS[preset])
  tokenizer = make_tokenizer(cfg.vocab_size)
  if len(tokenizer) > cfg.vocab_size:
    raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size={cfg.vocab_size}")
  os.makedirs(out_dir, exist_ok=True)
  tokenizer.save_pretrained(out_dir)
  model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
  to_hf(model, out_dir)
  return out_dir
