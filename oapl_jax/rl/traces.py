"""Stored traces: multi-turn trajectories in the common chat format (JSONL) as a round's arrays.

Each line is one trajectory (docs/agents.md "Stored traces"):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str,
                   "tool_calls": [{"function": {"name": str, "arguments": {...}}}],  # assistant only
                   "logprobs": [float, ...], "token_ids": [int, ...]},                # assistant only
                  ...],
     "reward": float, "tools": [...]}                                                # tools: optional

The messages are rendered through the tokenizer's chat template (`apply_chat_template`, with
the row's `tools`): the prompt is everything up to the first assistant turn's generation prompt;
each assistant turn is a model span (its tokens as the template renders them, or its
`token_ids` when given: the sampler's own tokens, never re-tokenized) up to and including its
end-of-turn token; whatever the template puts between model spans (the end-of-turn newline,
tool results, user turns, the next generation prompt) is an environment span. Anything after
the last model span is dropped (nothing follows it to predict). `logprobs` (the sampler's, one
per model token) are all given or all absent in a file: without them the run rescores pi_old.

A line that cannot be one trajectory is refused with one line naming it (`line N: why`); the
rest are kept. Trajectories are grouped by their prompt tokens (groups in order of first
appearance, each group's trajectories in file order) into groups of `group_size`; the
trajectories of a prompt beyond a whole number of groups are left out, one line per prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from oapl_jax.rl.trajectory import ENV, MODEL, Span, Trajectory
from oapl_jax.sampling.rollout import FINISH_EOS, FINISH_LENGTH
from oapl_jax.tasks.base import Problem

ROLES = ("system", "user", "assistant", "tool")
LOGPROB_SLACK = 1e-4  # as rl/offline.py: a log-prob above 0 by more than this is not one
LOGPROB_FLOOR = -745.0  # as rl/offline.py: below float64's smallest positive probability


class BadRow(ValueError):
  """Why one line of a traces file is not a trajectory."""


@dataclasses.dataclass
class Imported:
  """The trajectories of a traces file, grouped; what was refused or left out, one line each."""

  trajectories: list[Trajectory]  # groups of group_size contiguous, each group one prompt
  problems: list[Problem]  # one per group: its prompt text (answer "": a trace has no gold answer)
  lines: list[int]  # the file line of each trajectory
  has_logprobs: bool
  refused: list[str]  # "line N: why"
  left_out: list[str]  # per prompt whose trajectories did not fill whole groups

  @property
  def groups(self) -> int:
    return len(self.problems)


def _check_message(k: int, m) -> None:
  if not isinstance(m, dict):
    raise BadRow(f"message {k} is not an object")
  role = m.get("role")
  if role not in ROLES:
    raise BadRow(f"message {k}: role {role!r}, expected one of {', '.join(ROLES)}")
  content = m.get("content")
  if not (isinstance(content, str) or (content is None and role == "assistant" and m.get("tool_calls"))):
    raise BadRow(f"message {k} ({role}): content is not a string")
  extra = [f for f in ("tool_calls", "logprobs", "token_ids") if f in m and role != "assistant"]
  if extra:
    raise BadRow(f"message {k} ({role}): {', '.join(extra)} on a message that is not the assistant's")
  calls = m.get("tool_calls")
  if calls is not None:
    if not isinstance(calls, list):
      raise BadRow(f"message {k}: tool_calls is not a list")
    for c in calls:
      f = c.get("function", c) if isinstance(c, dict) else None
      if not (isinstance(f, dict) and isinstance(f.get("name"), str)
              and isinstance(f.get("arguments", {}), (dict, str))):
        raise BadRow(f"message {k}: a tool call without a function name and arguments")
  lp = m.get("logprobs")
  if lp is not None and not (isinstance(lp, list) and all(
      isinstance(x, (int, float)) and not isinstance(x, bool) for x in lp)):
    raise BadRow(f"message {k}: logprobs is not a list of numbers")
  ids = m.get("token_ids")
  if ids is not None and not (isinstance(ids, list) and ids and all(
      isinstance(x, int) and not isinstance(x, bool) for x in ids)):
    raise BadRow(f"message {k}: token_ids is not a non-empty list of integers")


def _template_messages(messages: list[dict]) -> list[dict]:
  """The messages as the chat template reads them (tool calls as {"type", "function"}; our
  own fields dropped)."""
  out = []
  for m in messages:
    t = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
      calls = []
      for c in m["tool_calls"]:
        f = dict(c.get("function", c))
        if isinstance(f.get("arguments"), str):  # OpenAI stores arguments as a JSON string
          try:
            f["arguments"] = json.loads(f["arguments"])
          except json.JSONDecodeError:
            pass  # rendered as the string it is
        calls.append({"type": "function", "function": {"name": f["name"], "arguments": f.get("arguments", {})}})
      t["tool_calls"] = calls
    out.append(t)
  return out


def parse_row(text: str, tokenizer, *, max_prompt_len: int, max_new_tokens: int,
              thinking: bool | None = None) -> tuple[Trajectory, str, bool]:
  """(trajectory, prompt text, has log-probs) of one line; `BadRow` (the reason) otherwise.
  tokenizer: an `HFTokenizer` (its chat template renders the messages)."""
  try:
    row = json.loads(text)
  except json.JSONDecodeError as e:
    raise BadRow(f"not JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(row, dict):
    raise BadRow("not a JSON object")
  messages, reward = row.get("messages"), row.get("reward")
  if not isinstance(messages, list) or not messages:
    raise BadRow("no list of messages")
  if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
    raise BadRow(f"reward {reward!r} is not a finite number")
  for k, m in enumerate(messages):
    _check_message(k, m)
  turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
  if not turns:
    raise BadRow("no assistant message: nothing the model wrote")
  if turns[0] == 0:
    raise BadRow("the first message is the assistant's: no prompt before it")
  with_lp = [m.get("logprobs") is not None for m in (messages[k] for k in turns)]
  if any(with_lp) and not all(with_lp):
    raise BadRow("log-probs on some assistant messages but not on others")
  tools = row.get("tools")
  if tools is not None and not isinstance(tools, list):
    raise BadRow("tools is not a list")
  chat = _template_messages(messages)
  kwargs = {"tools": tools} if tools else {}
  if thinking is not None:
    kwargs["enable_thinking"] = thinking

  def render(upto: int, generation: bool) -> str:
    try:
      return tokenizer.hf_tokenizer.apply_chat_template(chat[:upto], tokenize=False,
                                                        add_generation_prompt=generation, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is this row's fault
      raise BadRow(f"the chat template cannot render it ({type(e).__name__}: {e})") from None

  eos = tokenizer.eos_ids if hasattr(tokenizer, "eos_ids") else {tokenizer.eos_id}
  full = render(len(chat), False)
  spans, done, prompt_text, prompt = [], 0, "", []  # done: characters of `full` laid out
  pending: list[int] = []  # environment tokens waiting for the next model span
  for k in turns:
    before, after = render(k, True), render(k + 1, False)
    if not (after.startswith(before) and full.startswith(after) and before.startswith(full[:done])):
      raise BadRow(f"message {k}: the chat template renders the conversation before it differently "
                   "once later turns follow (e.g. it drops earlier reasoning): not one token sequence")
    context = before[done:]
    if not prompt_text:
      prompt_text, prompt = context, tokenizer.encode(context, add_bos=True)
    elif context:
      pending += tokenizer.encode(context)
    piece = tokenizer.encode(after[len(before):])
    cut = next((j + 1 for j, t in enumerate(piece) if t in eos), len(piece))  # through end-of-turn
    m = messages[k]
    model = list(m["token_ids"]) if m.get("token_ids") is not None else piece[:cut]
    lp = m.get("logprobs")
    if lp is not None and len(lp) != len(model):
      raise BadRow(f"message {k}: {len(lp)} log-probs for its {len(model)} tokens"
                   + ("" if m.get("token_ids") else " as the chat template renders it (give its token_ids)"))
    if lp is not None:
      bad = [x for x in lp if not (LOGPROB_FLOOR <= x <= LOGPROB_SLACK)]
      if bad:
        raise BadRow(f"message {k}: log-prob {bad[0]!r} is not in [{LOGPROB_FLOOR:g}, 0]")
    if pending:
      spans.append(Span(ENV, pending))
    spans.append(Span(MODEL, model, [float(x) for x in lp] if lp is not None else [0.0] * len(model)))
    pending = piece[cut:]
    done = len(after)
  vocab = tokenizer.vocab_size
  ids = [t for s in spans for t in s.tokens]
  if any(not 0 <= t < vocab for t in ids):
    raise BadRow(f"a token id outside [0, {vocab}) (the tokenizer's vocabulary)")
  if len(prompt) > max_prompt_len:
    raise BadRow(f"prompt of {len(prompt)} tokens is longer than sampling.max_prompt_len={max_prompt_len}")
  if len(ids) > max_new_tokens:
    raise BadRow(f"{len(ids)} tokens after the prompt (model and environment turns) is longer than "
                 f"sampling.max_new_tokens={max_new_tokens}")
  finish = FINISH_EOS if spans[-1].tokens[-1] in eos else FINISH_LENGTH
  return Trajectory(prompt=prompt, spans=spans, reward=float(reward), finish=finish), prompt_text, lp is not None


def read_traces(lines, tokenizer, *, group_size: int, max_prompt_len: int, max_new_tokens: int,
                thinking: bool | None = None) -> Imported:
  """The trajectories of a traces file's `lines` (an iterable of text lines, the first line 1),
  grouped (module docstring). Blank lines are skipped."""
  parsed, refused = [], []  # parsed: (line, trajectory, prompt text)
  has_logprobs, first_line = None, None
  for n, text in enumerate(lines, start=1):
    if not text.strip():
      continue
    try:
      traj, prompt_text, lp = parse_row(text, tokenizer, max_prompt_len=max_prompt_len,
                                        max_new_tokens=max_new_tokens, thinking=thinking)
      if has_logprobs is None:
        has_logprobs, first_line = lp, n
      elif lp != has_logprobs:
        raise BadRow(f"{'has' if lp else 'has no'} log-probs, while line {first_line}'s trajectory "
                     f"{'has them' if has_logprobs else 'has none'}: a file is all one or the other")
    except BadRow as e:
      refused.append(f"line {n}: {e}")
      continue
    parsed.append((n, traj, prompt_text))
  by_prompt: dict[tuple, list] = {}
  for item in parsed:
    by_prompt.setdefault(tuple(item[1].prompt), []).append(item)
  trajectories, problems, numbers, left_out = [], [], [], []
  for items in by_prompt.values():
    whole = len(items) - len(items) % group_size
    for start in range(0, whole, group_size):
      group = items[start:start + group_size]
      problems.append(Problem(prompt=group[0][2], answer="", id=len(problems)))
      trajectories += [t for _, t, _ in group]
      numbers += [n for n, _, _ in group]
    if whole < len(items):
      rest = ", ".join(str(n) for n, _, _ in items[whole:])
      left_out.append(f"line {rest}: {len(items) - whole} trajectories of the prompt of line "
                      f"{items[0][0]} left out (not a whole group of rl.group_size={group_size})")
  return Imported(trajectories, problems, numbers, bool(has_logprobs), refused, left_out)


def round_arrays(imported: Imported) -> dict[str, np.ndarray]:
  """The trajectories as a round file's ragged arrays (`offline.ARRAYS` and
  `offline.SPAN_ARRAY`): log-probs 0 where none were given; versions 0 (the file's sampler)."""
  trajs, g = imported.trajectories, len(imported.trajectories) // max(imported.groups, 1)
  flat = [t.flat() for t in trajs]
  prompts = [trajs[i * g].prompt for i in range(imported.groups)]
  lengths = np.array([len(f[0]) for f in flat], np.int64)
  return {
      "prompt_tokens": np.concatenate([np.asarray(p, np.int32) for p in prompts]),
      "prompt_offsets": np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int64),
      "answer_tokens": np.concatenate([f[0] for f in flat]).astype(np.int32),
      "answer_logprobs": np.concatenate([f[2] for f in flat]).astype(np.float32),
      "answer_model": np.concatenate([f[1] for f in flat]).astype(np.int8),
      "answer_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
      "finish": np.array([t.finish for t in trajs], np.int8),
      "rewards": np.array([t.reward for t in trajs], np.float32),
      "version": np.zeros(len(trajs), np.int32),
  }
