"""The mixed chain task with a calculator the model may call (`task.name="tool_mix"`; issue 61's
built-in tool task, configs/tools.py), on CPU with a character tokenizer.

Problems and the chain answer are chain_mix's (`"123x45="` answered by column steps, then
``>5535``). A trajectory may instead call the calculator environment (`env.name="calculator"`,
oapl_jax/envs/calculator.py) in its first turn, then answer with the result::

    123x45=  [call]123*45[/call]<eos>  [response]5535[/response]  >5535<eos>
             model turn                 environment (context)      model turn

The environment is the real one: a turn is decoded to Qwen3's tool-call text (`<tool_call>{"name":
"calculator", "arguments": {"expression": "123*45"}}</tool_call>`, parsed by envs/tool_calls.py),
and its reply is rendered by the tokenizer's chat template (`envs/episodes.env_turn_tokens`).
Both go through `ChatCharTokenizer`, the character tokenizer with a small chat layer: the long
fixed pieces of that markup are one token each, so a call costs 2 tokens plus the expression's
characters, a reply 2 plus the result's.

The final answer (the episode's last turn) scores 1 if it is a well-formed chain with the right
answer, or ``>N`` alone with N the right answer (after a call: the result copied).

The base (`warmup`): chain_mix's demonstrations (carries dropped w.p. `warmup.digit_noise` for
`noisy_operations`), of which a fraction `task.tool_demos` call the calculator instead (always
right). The base so calls it rarely and solves the chains seldom; RL has a better way to find.

Pure Python/numpy; no JAX is needed here.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from oapl_jax.errors import ConfigError
from oapl_jax.tasks import chain_mix
from oapl_jax.tasks.arithmetic import CharTokenizer, check_addition_prompts
from oapl_jax.tasks.base import Problem

# One token each: the fixed text around a calculator call's expression, in Qwen3's tool-call
# format, and around the calculator's reply (the chat template's tool turn).
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
EOS_TEXT = "<eos>"  # the end-of-turn token's text in the chat template
UNKNOWN = "?"  # a tool reply that is not a whole number is shown as this one character
_NUMBER = re.compile(r"^-?\d+$")
_BARE = re.compile(rf"^{re.escape(chain_mix.ANSWER_MARK)}(\d+)$")


class ChatCharTokenizer(CharTokenizer):
  """The character tokenizer (`extra` characters as CharTokenizer's) plus the four markup tokens
  above and ``?``, and a chat layer that `envs/episodes.py` renders environment turns with.

  `hf_tokenizer` is the tokenizer itself: `apply_chat_template`, `convert_ids_to_tokens`,
  `decode(..., skip_special_tokens=)` as Hugging Face's tokenizers name them. The template puts a
  user turn's content, an assistant turn's content followed by ``<eos>``, and a tool turn as
  ``<tool_response>N</tool_response>`` (N the reply when it is a whole number, else ``?``; the
  model needs no more to learn that a call failed); tool schemas are not rendered (the prompt
  is the problem alone) and the generation prompt is empty."""

  has_chat_template = True
  _MARKUP = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)

  def __init__(self, extra: str = "") -> None:
    super().__init__(extra=extra + UNKNOWN)
    for piece in self._MARKUP:
      i = self.vocab_size
      self._id_to_char[i], self._char_to_id[piece] = piece, i
    self.hf_tokenizer = self

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Characters as CharTokenizer's, each markup piece as its one token (longest first)."""
    ids = [self.bos_id] if add_bos else []
    at = 0
    while at < len(text):
      piece = next((p for p in self._MARKUP if text.startswith(p, at)), text[at])
      ids += super().encode(piece) if len(piece) == 1 else [self._char_to_id[piece]]
      at += len(piece)
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`, markup pieces written out; as a Hugging Face tokenizer's, the whole
    trajectory (every turn: an answer's text for votes), ``<eos>`` written only when
    `skip_special_tokens` is False; ``<pad>``, ``<bos>`` and unknown ids dropped."""
    out = []
    for i in ids:
      if int(i) == self.eos_id:
        out.append("" if skip_special_tokens else EOS_TEXT)
      else:
        out.append(self._id_to_char.get(int(i), ""))
    return "".join(out)

  def convert_ids_to_tokens(self, i: int) -> str:
    return EOS_TEXT if int(i) == self.eos_id else self._id_to_char.get(int(i), "")

  def apply_chat_template(self, messages: list[dict], *, tokenize: bool = False,
                          add_generation_prompt: bool = True, tools=None) -> str:
    del add_generation_prompt, tools  # the generation prompt is empty; schemas not rendered
    if tokenize:
      raise ValueError("ChatCharTokenizer.apply_chat_template renders text only (tokenize=False)")
    out = []
    for m in messages:
      content = str(m.get("content", ""))
      if m["role"] == "assistant":
        out.append(content + EOS_TEXT)
      elif m["role"] == "tool":
        shown = content.strip() if _NUMBER.match(content.strip()) else UNKNOWN
        out.append(RESPONSE_OPEN + shown + RESPONSE_CLOSE)
      else:  # system, user: their content
        out.append(content)
    return "".join(out)



def final_answer(response: str) -> str | None:
  """The answer of a well-formed chain, or of ``>N`` alone; else None (never raises). A whole
  trajectory's text is read after its last tool response (its last turn, as its episode scores)."""
  if isinstance(response, str):
    response = response.rsplit(RESPONSE_CLOSE, 1)[-1]
  answer = chain_mix.final_answer(response)
  if answer is not None:
    return answer
  try:
    match = _BARE.match(response.strip())
  except Exception:  # noqa: BLE001 - a reward must never crash training
    return None
  return match.group(1) if match else None


def call_text(problem: Problem) -> str:
  """The model turn that calls the calculator on `problem` ("x" written as Python's "*")."""
  a, op, b = chain_mix.parse(problem)
  return f"{CALL_OPEN}{a}{'*' if op in '*x' else op}{b}{CALL_CLOSE}"


class ToolMixTask(chain_mix.ChainMixTask):
  """chain_mix's problems; answers a chain or, after a calculator call, ``>N`` (module
  docstring). tool_demos: the fraction of warm-up demonstrations that call the calculator."""

  def __init__(self, *args, tool_demos: float, **kwargs) -> None:
    super().__init__(*args, **kwargs)
    if not 0.0 <= tool_demos <= 1.0:
      raise ValueError(f"tool_demos must be in [0, 1], got {tool_demos}")
    self.tool_demos = tool_demos

  def longest_answer_tokens(self) -> int:
    """The longest chain (EOS included), or a call trajectory, whichever is longer."""
    top = 10 ** self.max_digits - 1
    digits = len(str(top * (99 if "x" in self.operations else 9 if "*" in self.operations else 1) + top))
    call = 1 + 2 * self.max_digits + 1 + 1 + 1  # [call] a ? b [/call] <eos>
    return max(super().longest_answer_tokens(), call + (digits + 2) + (1 + digits + 1))

  final_answer = staticmethod(final_answer)

  def demonstration(self, problem: Problem, rng: np.random.Generator, *, digit_noise: float):
    """chain_mix's chain (a str: one turn), or w.p. `tool_demos` the calculator trajectory: a
    list of the model's turns (str) and the environment's messages (list of dicts) between
    them, as the warm-up lays it out (oapl_jax/warmup.py)."""
    if rng.random() < self.tool_demos:
      return [call_text(problem), [{"role": "tool", "content": problem.answer}],
              chain_mix.ANSWER_MARK + problem.answer]
    return super().demonstration(problem, rng, digit_noise=digit_noise)


def make_tool_mix_task(config) -> tuple[ToolMixTask, ChatCharTokenizer]:
  """The task of `config.task` (seeded by `config.seed`) and its chat tokenizer; refuses prompts
  longer than `sampling.max_prompt_len`, a `sampling.max_new_tokens` the longest answer does not
  fit in, and a run without the calculator (`env.name`)."""
  t = config.task
  try:
    task = ToolMixTask(t.min_digits, t.max_digits, t.num_eval, config.seed, t.operations,
                       t.get("noisy_operations"), tool_demos=t.tool_demos)
  except ValueError as e:
    raise ConfigError(f"config.task: {e}") from e
  tokenizer = ChatCharTokenizer(extra=chain_mix.ANSWER_MARK + ("x" if "x" in task.operations else ""))
  check_addition_prompts(task, tokenizer, config.sampling.max_prompt_len)
  need = task.longest_answer_tokens()
  if config.sampling.max_new_tokens < need:
    raise ConfigError(f"config.sampling.max_new_tokens={config.sampling.max_new_tokens}: the "
                      f"longest answer of {t.max_digits}-digit operands (task.max_digits) is "
                      f"{need} tokens; must be >= {need}")
  if config.env.name != "calculator":
    raise ConfigError(f"config.env.name={config.env.name!r}: the tool_mix task's calls are the "
                      "calculator's; set env.name='calculator'")
  return task, tokenizer
