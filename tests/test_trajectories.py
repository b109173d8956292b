"""Multi-turn trajectories as trainer rows, and stored traces (JSONL chat) as round files.

Only the model's tokens are targets: the mask, the sampler's log-probs, ell, the entropy, the
KL and pi_old's rescoring cover them alone; a trajectory without environment turns is today's
single-turn answer bit for bit; a traces file's malformed lines are refused by number and the
rest kept.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from oapl_jax.rl import losses, offline, packing, traces
from oapl_jax.rl.logprobs import make_batch
from oapl_jax.rl.trajectory import ENV, MODEL, Span, Trajectory, rows_of
from oapl_jax.sampling.rollout import FINISH_EOS, FINISH_LENGTH, Rollout

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen3's layout of tools, tool calls and tool results (its template, shortened): tools in the
# system turn, each call as <tool_call>{"name", "arguments"}</tool_call> in the assistant turn,
# results as a user turn of <tool_response> blocks. (transformers renders with trim_blocks: a newline
# right after a block tag is dropped.)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  from oapl_jax.tasks.hf_tokenizer import HFTokenizer
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(['What is 12 * 7? {"name": "calculator", "arguments": {"expression": "12 * 7"}}',
                           "The answer is 84. You are a helpful assistant."] * 3, trainer)
  folder = tmp_path_factory.mktemp("tok")
  PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          chat_template=TEMPLATE).save_pretrained(str(folder))
  return HFTokenizer(str(folder))


# --- rows ------------------------------------------------------------------------------------

def _trajectory(prompt, spans, reward=1.0, finish=FINISH_EOS):
  return Trajectory(prompt=prompt, spans=spans, reward=reward, finish=finish)


def test_a_trajectory_without_environment_turns_is_the_single_turn_answer_bit_for_bit():
  rng = np.random.default_rng(0)
  g, seq_len = 3, 24
  prompts = [[1, 5, 6], [1, 7, 8, 9, 10]]
  lengths = np.array([4, 9, 1, 16, 2, 7], np.int32)
  answers = rng.integers(11, 50, size=(6, 16)).astype(np.int32)
  logprobs = -rng.random((6, 16)).astype(np.float32)
  finish = np.array([FINISH_EOS, FINISH_EOS, FINISH_LENGTH, FINISH_LENGTH, FINISH_EOS, FINISH_EOS], np.int8)
  rewards = np.array([1, 0, 1, 0, 0.5, 1], np.float32)
  for count_truncated in (True, False):
    want = make_batch(Rollout(prompts=prompts, group_size=g, answers=answers, logprobs=logprobs,
                              lengths=lengths, finish=finish, versions=np.full(6, -1, np.int32)),
                      rewards, seq_len=seq_len, pad_id=0, count_truncated=count_truncated)
    got = rows_of([_trajectory(prompts[i // g], [Span(MODEL, answers[i, :n].tolist(), logprobs[i, :n].tolist())],
                               float(rewards[i]), int(finish[i])) for i, n in enumerate(lengths)],
                  group_size=g, seq_len=seq_len, pad_id=0, count_truncated=count_truncated)
    for name, a in want.as_dict().items():
      b = getattr(got, name)
      assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


PROMPT = [1, 2, 3]
A, E1, B, E2 = [10, 11, 12], [20, 21], [13, 14], [22]  # model, env, model, env (trailing)


def _multi_turn():
  return _trajectory(PROMPT, [Span(MODEL, A, [-0.1, -0.2, -0.3]), Span(ENV, E1),
                              Span(MODEL, B, [-0.4, -0.5]), Span(ENV, E2)])


def test_the_mask_and_the_sampler_log_probs_cover_model_tokens_only():
  rows = rows_of([_multi_turn()], group_size=1, seq_len=16, pad_id=0)
  tokens = PROMPT + A + E1 + B + E2
  assert rows.tokens[0, :len(tokens)].tolist() == tokens
  # target t is token t + 1: a target counts iff the token it predicts is the model's
  model_token = [False] * len(PROMPT) + [True] * 3 + [False] * 2 + [True] * 2 + [False]
  want = np.zeros(15, np.float32)
  want[:len(tokens) - 1] = model_token[1:]
  np.testing.assert_array_equal(rows.mask[0], want)
  old = np.zeros(15, np.float32)
  old[np.flatnonzero(want)] = [-0.1, -0.2, -0.3, -0.4, -0.5]
  np.testing.assert_array_equal(rows.sampler_logprobs[0], old)
  assert rows.answer_lengths.tolist() == [5]  # model tokens


def test_ell_entropy_and_kl_see_no_environment_token():
  """The loss and its metrics read only masked positions: changing the trainer's (or the
  reference's) log-prob of an environment token changes nothing."""
  rows = rows_of([_multi_turn(), _trajectory(PROMPT, [Span(MODEL, [15, 16], [-1.0, -2.0])], reward=0.0)],
                 group_size=2, seq_len=16, pad_id=0)
  rng = np.random.default_rng(1)
  logp = -rng.random(rows.mask.shape).astype(np.float32)
  env_positions = (rows.mask == 0)
  noisy = np.where(env_positions, logp - 5.0, logp)  # environment targets moved by 5 nats
  ell = losses.sequence_log_ratio(jnp.asarray(logp), jnp.asarray(rows.sampler_logprobs), jnp.asarray(rows.mask))
  model = rows.mask[0] > 0
  np.testing.assert_allclose(float(ell[0]), float((logp[0] - rows.sampler_logprobs[0])[model].sum()), rtol=1e-6)
  args = dict(group_size=2, beta1=1.0, beta2=0.1)
  for loss_fn in (
      lambda lp: losses.oapl(jnp.asarray(lp), jnp.asarray(rows.sampler_logprobs), jnp.asarray(rows.mask),
                             jnp.asarray(rows.rewards), **args),
      lambda lp: losses.grpo(jnp.asarray(lp), jnp.asarray(logp), jnp.asarray(rows.sampler_logprobs),
                             jnp.asarray(rows.mask), jnp.asarray(rows.rewards), group_size=2,
                             ref_logprobs=jnp.asarray(logp - 0.3), kl_coef=0.1)):
    (a, ma), (b, mb) = loss_fn(logp), loss_fn(noisy)
    assert float(a) == float(b)
    assert {k: float(v) for k, v in ma.items()} == {k: float(v) for k, v in mb.items()}
  from oapl_jax.rl.step import _token_mean  # the step's entropy and mismatch metrics
  ent = rng.random(rows.mask.shape).astype(np.float32)
  assert float(_token_mean(jnp.asarray(ent), jnp.asarray(rows.mask))) == float(
      _token_mean(jnp.asarray(np.where(env_positions, 99.0, ent)), jnp.asarray(rows.mask)))


def test_a_mutation_counting_one_environment_token_is_caught():
  """The check the tests above make, on a mask with one environment target switched on: what
  a layout bug counting a tool token would do."""
  rows = rows_of([_multi_turn()], group_size=1, seq_len=16, pad_id=0)
  mutated = rows.mask.copy()
  mutated[0, len(PROMPT) - 1 + len(A)] = 1.0  # the target predicting E1's first token
  logp = np.zeros_like(rows.mask)
  noisy = np.where(rows.mask == 0, -5.0, 0.0).astype(np.float32)
  ell = lambda lp, m: float(losses.sequence_log_ratio(jnp.asarray(lp), jnp.asarray(rows.sampler_logprobs),  # noqa: E731
                                                      jnp.asarray(m))[0])
  assert ell(logp, rows.mask) == ell(noisy, rows.mask)
  assert ell(logp, mutated) != ell(noisy, mutated)


def test_packing_keeps_the_environment_tokens_as_context_up_to_the_last_model_token():
  t = [_multi_turn(), _trajectory(PROMPT, [Span(MODEL, [15], [-1.0])])]
  rows = rows_of(t, group_size=2, seq_len=16, pad_id=0)
  used = packing.used_lengths(rows)
  assert used.tolist() == [len(PROMPT + A + E1 + B), len(PROMPT) + 1]  # the trailing E2 is not needed
  packed = packing.pack(rows, rows_per_micro=1, budget=16, micro_batches=1)
  row, start = packed.answer_row[0, 0], packed.answer_start[0, 0]
  assert packed.tokens[0, row, start:start + used[0]].tolist() == PROMPT + A + E1 + B
  # every counted target of the padded layout has its packed token at the same offset
  counted = np.flatnonzero(rows.mask[0])
  assert (packed.tokens[0, row, start + counted + 1] == rows.tokens[0, counted + 1]).all()


# --- stored traces -----------------------------------------------------------------------------

CALC = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                         "parameters": {"type": "object"}}}


def _line(reward=1.0, *, logprobs=None, **extra):
  messages = [
      {"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What is 12 * 7?"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}}]},
      {"role": "tool", "content": "84"},
      {"role": "assistant", "content": "The answer is 84."}]
  row = {"messages": messages, "reward": reward, "tools": [CALC], **extra}
  if logprobs is not None:
    for m, lp in zip([m for m in messages if m["role"] == "assistant"], logprobs):
      m["logprobs"] = lp
  return json.dumps(row)


def _read(lines, tokenizer, group_size=2, **kw):
  return traces.read_traces(lines, tokenizer, group_size=group_size, max_prompt_len=kw.get("max_prompt_len", 512),
                            max_new_tokens=kw.get("max_new_tokens", 512))


def test_a_trace_is_the_template_rendering_with_assistant_turns_as_model_spans(tokenizer):
  traj, prompt_text, has_lp = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  hf = tokenizer.hf_tokenizer
  row = json.loads(_line())
  full = hf.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
  assert not has_lp and prompt_text.endswith("<|im_start|>assistant\n")
  assert [s.kind for s in traj.spans] == [MODEL, ENV, MODEL]
  decode = lambda ids: hf.decode(ids, skip_special_tokens=False)  # noqa: E731
  # prompt + spans are the conversation as the template renders it (its last newline dropped)
  assert decode(traj.prompt + [t for s in traj.spans for t in s.tokens]) == full.rstrip("\n")
  assert decode(traj.spans[0].tokens) == ('<tool_call>\n{"name": "calculator", "arguments": '
                                          '{"expression": "12 * 7"}}\n</tool_call><|im_end|>')
  assert decode(traj.spans[1].tokens) == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>"
                                          "<|im_end|>\n<|im_start|>assistant\n")
  assert decode(traj.spans[2].tokens) == "The answer is 84.<|im_end|>"
  assert traj.finish == FINISH_EOS and traj.reward == 1.0


def test_given_token_ids_are_the_model_span_never_retokenized(tokenizer):
  row = json.loads(_line())
  row["messages"][-1]["token_ids"] = [7, 8, 9, tokenizer.eos_id]
  row["messages"][-1]["logprobs"] = [-0.5] * 4
  row["messages"][2]["logprobs"] = None
  with pytest.raises(traces.BadRow, match="log-probs on some assistant messages but not on others"):
    traces.parse_row(json.dumps(row), tokenizer, max_prompt_len=512, max_new_tokens=512)
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  row["messages"][2]["logprobs"] = [-0.25] * len(traj.spans[0].tokens)
  traj, _, has_lp = traces.parse_row(json.dumps(row), tokenizer, max_prompt_len=512, max_new_tokens=512)
  assert has_lp and traj.spans[2].tokens == [7, 8, 9, tokenizer.eos_id] and traj.spans[2].logprobs == [-0.5] * 4


BAD = [
    ("not json", "not JSON"),
    ('["a list"]', "not a JSON object"),
    (json.dumps({"messages": [], "reward": 1}), "no list of messages"),
    (_line(reward="high"), "reward 'high' is not a finite number"),
    (_line(reward=float("nan")), "reward nan is not a finite number"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "reward": 1}), "no assistant message"),
    (json.dumps({"messages": [{"role": "assistant", "content": "hi"}], "reward": 1}), "no prompt before it"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}], "reward": 1}), "role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}],
                 "reward": 1}), "message 0 (user): content is not a string"),
    (json.dumps({"messages": [{"role": "user", "content": "q", "tool_calls": []},
                              {"role": "assistant", "content": "x"}], "reward": 1}),
     "tool_calls on a message that is not the assistant's"),
    (json.dumps({"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}],
                 "reward": 1}), "a tool call without a function name"),
    (_line(logprobs=[[-0.1], [-0.1]]), "log-probs for its"),
    (_line(logprobs=[[0.5] * 19, [-0.1] * 7]), None),  # the count or the value: refused either way
]


def test_malformed_lines_are_refused_by_number_and_the_rest_kept(tokenizer):
  good = _line()
  lines = [good]
  for text, _ in BAD:
    lines += [text, good]
  lines += ["", good]  # a blank line is skipped, not refused
  out = _read(lines, tokenizer, group_size=2)
  assert len(out.refused) == len(BAD)
  for k, ((_, why), said) in enumerate(zip(BAD, out.refused)):
    assert said.startswith(f"line {2 * k + 2}: "), said
    assert "\n" not in said
    if why is not None:
      assert why in said, (why, said)
  kept = len(BAD) + 2
  assert len(out.trajectories) == kept - kept % 2 and out.groups == kept // 2
  assert out.lines == [1 + 2 * k for k in range(len(BAD) + 1)]  # the good lines, the last one left out:
  assert out.left_out == [f"line {2 * len(BAD) + 3}: 1 trajectories of the prompt of line 1 left out "
                          "(not a whole group of rl.group_size=2)"]


def test_lines_with_and_without_log_probs_do_not_mix_and_groups_are_whole(tokenizer):
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  n0, n1 = (len(traj.spans[0].tokens), len(traj.spans[2].tokens))
  with_lp = _line(logprobs=[[-0.1] * n0, [-0.2] * n1])
  other = json.loads(_line(reward=0.0, logprobs=[[-0.1] * n0, [-0.2] * n1]))
  other["messages"][1]["content"] = "What is 3 * 4?"
  out = _read([with_lp, _line(), with_lp, with_lp, json.dumps(other)], tokenizer, group_size=2)
  assert out.refused == ["line 2: has no log-probs, while line 1's trajectory has them: a file is "
                         "all one or the other"]
  assert out.has_logprobs and out.groups == 1 and out.lines == [1, 3]
  assert out.left_out == ["line 4: 1 trajectories of the prompt of line 1 left out (not a whole group of rl.group_size=2)",
                          "line 5: 1 trajectories of the prompt of line 5 left out (not a whole group of rl.group_size=2)"]


def test_length_limits_refuse_a_line(tokenizer):
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  after = sum(len(s.tokens) for s in traj.spans)
  out = _read([_line(), _line()], tokenizer, max_new_tokens=after - 1)
  assert out.refused[0] == (f"line 1: {after} tokens after the prompt (model and environment turns) is longer "
                            f"than sampling.max_new_tokens={after - 1}")
  out = _read([_line()], tokenizer, max_prompt_len=len(traj.prompt) - 1)
  assert "longer than sampling.max_prompt_len" in out.refused[0]


def _round_file(tmp_path, imported, tokenizer, logprobs="sampler"):
  header = {"model": {}, "task": {}, "sampling": {}, "group_size": 2, "round": 1, "seed": 0,
            "policy": {"version": 0, "snapshot_step": 0, "source": "traces test"}, "logprobs": logprobs,
            "problems": [{"prompt": p.prompt, "answer": p.answer, "id": p.id} for p in imported.problems]}
  path = str(tmp_path / "round.npz")
  offline.write(path, header, traces.round_arrays(imported))
  return offline.read(path)


def test_a_round_file_of_traces_gives_the_trajectories_rows(tmp_path, tokenizer):
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  n0, n1 = (len(traj.spans[0].tokens), len(traj.spans[2].tokens))
  lines = [_line(logprobs=[[-0.1] * n0, [-0.2] * n1]), _line(0.0, logprobs=[[-0.3] * n0, [-0.4] * n1])]
  imported = _read(lines, tokenizer)
  data = _round_file(tmp_path, imported, tokenizer)
  offline.check_problems(data, tokenizer)  # the prompts are the problems' as the run encodes them
  assert data.has_logprobs
  got = data.rows(np.array([0]), seq_len=256, pad_id=0, count_truncated=True)
  want = rows_of(imported.trajectories, group_size=2, seq_len=256, pad_id=0, version=0)
  for name, a in want.as_dict().items():
    assert getattr(got, name).tobytes() == a.tobytes(), name
  assert got.answer_lengths.tolist() == [n0 + n1] * 2


def test_the_rescoring_check_compares_model_tokens_only(tmp_path, tokenizer):
  """offline.check_logprobs on a file of traces: a kernel that agrees with the stored log-probs
  on the model's tokens and not at all on the environment's passes; one off on a model token fails."""
  import types
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  n0, n1 = (len(traj.spans[0].tokens), len(traj.spans[2].tokens))
  imported = _read([_line(logprobs=[[-0.1] * n0, [-0.2] * n1])] * 2, tokenizer)
  data = _round_file(tmp_path, imported, tokenizer)
  config = types.SimpleNamespace(seed=0, rl=types.SimpleNamespace(offline=types.SimpleNamespace(
      check_rows=2, logprob_tol=0.01)))
  rows = data.rows(np.array([0]), seq_len=256, pad_id=0, count_truncated=True)
  env = rows.mask == 0

  def agrees(params, tokens):
    return np.where(env, -50.0, rows.sampler_logprobs).astype(np.float32)

  assert offline.check_logprobs(data, config, agrees, None, seq_len=256, pad_id=0, what="pi_old") == 0.0
  with pytest.raises(offline.OfflineFileError, match="its log-probs are not those of pi_old"):
    offline.check_logprobs(data, config, lambda p, t: agrees(p, t) - 0.5, None, seq_len=256, pad_id=0,
                           what="pi_old")


def test_without_log_probs_pi_old_is_the_rescoring_of_the_model_tokens(tmp_path, tokenizer):
  imported = _read([_line(), _line(0.0)], tokenizer)
  assert not imported.has_logprobs
  data = _round_file(tmp_path, imported, tokenizer, logprobs=offline.NO_LOGPROBS)
  assert not data.has_logprobs

  def rescore(params, tokens):  # a stand-in for the trainer's kernel: -(target id) / 1000
    assert params == "pi_old"
    return -tokens[:, 1:].astype(np.float32) / 1000

  n = offline.fill_logprobs(data, rescore, "pi_old", seq_len=256, pad_id=0)
  rows = data.rows(np.array([0]), seq_len=256, pad_id=0, count_truncated=True)
  assert n == int(rows.mask.sum())
  counted = rows.mask > 0
  np.testing.assert_array_equal(rows.sampler_logprobs[counted], (-rows.tokens[:, 1:].astype(np.float32) / 1000)[counted])
  assert (rows.sampler_logprobs[~counted] == 0).all()


# --- the command, and a run on its file ------------------------------------------------------

def _tiny_trace(question, reward, k):
  return json.dumps({"messages": [
      {"role": "user", "content": question},
      {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'},
      {"role": "tool", "content": "7"},
      {"role": "assistant", "content": f"The answer is \\boxed{{{7 + k % 2}}}."}], "reward": reward})


def test_imported_traces_train_offline_with_pi_old_rescored(tmp_path):
  """import_traces writes a round file (malformed lines named on stderr, the rest kept); an
  offline run trains on it, rescoring pi_old with its base and saying so."""
  import subprocess
  import sys

  from oapl_jax.models.tiny_hf import make_tiny_hf
  model = make_tiny_hf(str(tmp_path / "tiny_qwen3"), preset="tiny_qwen3")
  lines = [_tiny_trace(q, float(k % 2), k) for q in ("What is 3 + 4?", "Add 3 and 4.") for k in range(8)]
  lines.insert(3, '{"messages": "oops", "reward": 1}')
  (tmp_path / "traces.jsonl").write_text("\n".join(lines) + "\n")
  settings = [f"--config.model.path={model}", "--config.sampling.max_new_tokens=128"]
  out = subprocess.run([sys.executable, "-m", "oapl_jax.import_traces", "--config=configs/math.py:tiny", *settings,
                        f"--traces={tmp_path / 'traces.jsonl'}", f"--out={tmp_path / 'round.npz'}"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"{tmp_path / 'traces.jsonl'}: line 4: no list of messages" in out.stderr
  summary = json.loads(out.stdout)
  assert (summary["groups"], summary["trajectories"], summary["refused_lines"], summary["logprobs"]) == (2, 16, 1, "none")
  out = subprocess.run([sys.executable, "-m", "oapl_jax.main", "--config=configs/math.py:tiny", *settings,
                        "--config.rl.mode=offline", f"--config.rl.offline.path={tmp_path / 'round.npz'}",
                        "--config.rl.offline.rounds=1", "--config.rl.offline.epochs=1", "--config.train.steps=1",
                        f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  said = out.stdout + out.stderr
  assert "stored without log-probs: pi_old is this run's pi_old (version 0: the base in round 1) rescoring the" in said, said[-3000:]
  metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step = [m for m in metrics if m.get("step") == 1][0]
  assert step["reward_mean"] == 0.5 and abs(step["trainer_vs_sampler_abs"]) < 1e-5  # pi_theta = pi_old at step 1


@pytest.mark.parametrize("loss", ["grpo"])  # with the k3 KL: the reference is scored packed too
def test_the_packed_step_equals_the_padded_step_on_rows_with_environment_spans(loss):
  """Rows whose answers have holes (environment spans inside them): the packed step computes
  the padded step's loss, metrics and update (a step's scoring does not depend on the loss;
  "oapl" passes too, left out for time)."""
  from test_packing import _answers, _close, _config, _one_step

  from oapl_jax.rl.trajectory import only_model_targets
  c = _config(loss, 2)
  rows = _answers(c, seed=4)
  prompt_lengths = np.argmax(rows.mask > 0, axis=1) + 1  # [N] the first target predicts the first answer token
  width = rows.tokens.shape[1]
  rng = np.random.default_rng(4)
  model = (rng.random((len(rows), width)) > 0.3).astype(np.int8)  # ~30% of answer tokens the environment's
  model[:, 0] = 1  # every trajectory starts with a model turn
  holed = only_model_targets(rows, model, prompt_lengths)
  assert 0 < holed.mask.sum() < rows.mask.sum()
  packed_config = _config(loss, 2, **{"train.packing": True, "train.pack_rows": 2, "train.pack_budget": 60})
  if loss == "grpo":
    c.rl.grpo.kl_coef = packed_config.rl.grpo.kl_coef = 0.05
  padded, packed = _one_step(c, holed), _one_step(packed_config, holed)
  _close(padded, packed)
  assert packed[0]["loss"] != 0.0


# --- episodes beside the engine (envs/episodes.py) ---------------------------------------------


def test_episode_turns_answer_a_tool_call_in_the_templates_own_tokens(tokenizer):
  """The calculator environment behind `EpisodeTurns`, as the rollout calls it: a model turn
  holding a Qwen3 tool call (its tokens, end-of-turn included) gets the tool's result as the
  chat template renders it after that turn (the same text a stored trace's environment span
  has); a plain turn ends the episode, which the task's score then scores; a trajectory that
  never ended a turn scores 0; the counts say one call, one episode calling."""
  from oapl_jax.envs.calculator import make_calculator_env
  from oapl_jax.envs.episodes import EpisodeTurns
  from oapl_jax.tasks.base import Problem

  class Task:
    @staticmethod
    def score(text, problem):
      return float(problem.answer in text)

  env_config = type("E", (), {"max_turns": 4, "tool_timeout_s": 5.0, "tool_output_chars": 100})
  env = make_calculator_env(env_config, Task)
  hf = tokenizer.hf_tokenizer
  problems = [Problem(prompt="What is 12 * 7?", answer="84", id=0)]
  turns = EpisodeTurns(env, problems, tokenizer, insert_width=64, workers=2)
  call = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
                          "</tool_call>") + [tokenizer.eos_id]
  reply = turns.respond(0, 1, np.array(call))
  assert hf.decode(reply, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
  # the same tokens as the environment span of the stored trace of this exchange
  traj, _, _ = traces.parse_row(_line(), tokenizer, max_prompt_len=512, max_new_tokens=512)
  assert reply == traj.spans[1].tokens
  assert turns.respond(0, 1, np.array(tokenizer.encode("The answer is 84.") + [tokenizer.eos_id])) is None
  np.testing.assert_array_equal(turns.rewards(np.array([0]), 2), [0.0, 1.0])
  m = turns.metrics()
  assert (m["tool_calls"], m["tool_ok"], m["episodes"], m["episodes_done"], m["episodes_calling"]) == (1, 1, 1, 1, 1)


def test_an_environment_needs_a_chat_template():
  from oapl_jax.envs.episodes import check_tokenizer
  from oapl_jax.errors import UserError
  from oapl_jax.tasks.arithmetic import CharTokenizer
  with pytest.raises(UserError, match="config.env.name='calculator': environments render their turns"):
    check_tokenizer(CharTokenizer(), "calculator")
