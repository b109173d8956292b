"""Offline rounds (`rl.mode="offline"`): stored answers, their file, and the checks on it.

The paper's code run trains on fixed data: the base model answers a fixed set of problems, the
trainer takes 4 epochs over those answers with that sampler as pi_old, then the model round 1
ended with answers the same problems again and round 2 trains 4 epochs on those. Here (project
choice; docs/offline.md):

* A **round** is one file of G answers to each of its problems, sampled by the run's pi_old at
  the round's start, and `rl.offline.epochs` passes over it. Each pass takes the file's groups
  in an order drawn from (seed, round, epoch), `rl.groups_per_step` groups a step (an
  incomplete last batch is left out of that pass). pi_old stays the file's sampler through the
  round and is refreshed (pi_old <- pi_theta) at its end: a round's lag is its length.
* Round 1's file is `rl.offline.path`, written by `python -m oapl_jax.generate` (from the
  run's base), or, with no path, sampled by the run itself from `rl.offline.problems` training
  problems. Round r > 1 is always sampled by the run, on round 1's problems, from pi_old at the
  round's start, into `<workdir>/offline/round_<r>.npz` (kept: a resumed run reads it back).
* After the rounds the run continues online in sync mode (a refresh every `rl.lag` steps) for
  the rest of `train.steps`.

The file is one `.npz` (numpy, read without pickle): a JSON `header` (format, the model's
architecture, the task section, sampling settings and lengths, group size, the policy that
sampled it and the round, the problems), the answers as ragged arrays (`ARRAYS`: each group's
prompt tokens and each answer's tokens and engine log-probs, concatenated, with offsets; finish
reasons, rewards, the engine's version stamps), and `sha256`, a digest of the header and every
array. A file is refused with one line naming it (`OfflineFileError`) when it does not open
(truncated), its digest fails (corrupted), its arrays disagree with its header, or its header
does not match the run (model, task, sequence lengths, sampling settings, group size); and
before the run trains on it, when its log-probs are not those of the run's pi_old: the tokens
of `rl.offline.check_rows` rows are rescored with pi_old by the trainer's kernel, and a mean
|stored - recomputed| per token above `rl.offline.logprob_tol` means another policy sampled it.
Once checked, its rows are samples of the run's pi_old and carry the run's stamps (version,
snapshot step) of the round's start; the policy the header names is kept as provenance.

Imported traces (`python -m oapl_jax.import_traces`, docs/agents.md) are a round file with one
more array, `answer_model` (1 on the tokens the model wrote, 0 on the environment's: tool
results, user turns), whose rows have the environment's tokens out of the targets
(`logprobs.only_model_targets`); a header's `"logprobs": "none"` says no sampler log-probs are
stored, and the run takes pi_old's by rescoring every answer with its pi_old (`fill_logprobs`,
said in the run's log) instead of checking them.

The whole file is read into host memory (about 8 bytes per answer token plus 4 per prompt
token; nothing is padded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile

import jax
import numpy as np
from flax import nnx

from oapl_jax import distributed, storage
from oapl_jax.errors import UserError
from oapl_jax.models.names import compiler_options
from oapl_jax.rl.buffer import Rows
from oapl_jax.rl.logprobs import make_batch, token_logprobs
from oapl_jax.rl.logprobs import only_model_targets
from oapl_jax.sampling.processing import SamplingParams
from oapl_jax.sampling.rollout import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Rollout
from oapl_jax.tasks.base import Problem

FORMAT = "oapl_jax.offline/1"
# Ragged arrays of a file: prompt_tokens[prompt_offsets[p]:prompt_offsets[p+1]] is problem p's
# prompt; answer i (= p * G + g) is answer_tokens / answer_logprobs[answer_offsets[i]:...[i+1]].
ARRAYS = ("prompt_tokens", "prompt_offsets", "answer_tokens", "answer_logprobs",
          "answer_offsets", "finish", "rewards", "version")
# Optional: a trajectory's file (imported traces, docs/agents.md) flags each answer token 1 if
# the model wrote it, 0 if the environment did (a tool result, a user turn: context, no target).
# Without it every answer token is the model's.
SPAN_ARRAY = "answer_model"
# A header's "logprobs": "sampler" (default) stores pi_old's log-probs of the answer tokens;
# "none" stores zeros, and the run takes pi_old's log-probs by rescoring (`fill_logprobs`).
NO_LOGPROBS = "none"
KEY_SALT = 2_000_003  # round r samples with fold_in(key(seed), KEY_SALT + r)


class OfflineFileError(UserError):
  """An offline file that cannot be used: unreadable, corrupted, or not this run's."""


def _fail(path: str, why: str):
  raise OfflineFileError(f"offline file {path}: {why}")


# --- writing ------------------------------------------------------------------------------------


def digest(header_text: str, arrays: dict[str, np.ndarray]) -> str:
  """sha256 of the header's text and of every array's name, dtype, shape and bytes."""
  h = hashlib.sha256(header_text.encode())
  for name in sorted(arrays):
    a = np.ascontiguousarray(arrays[name])
    h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def expected_header(config, model_meta: dict) -> dict:
  """The header fields a file must share with the run that trains on it."""
  s = config.sampling
  return {"model": model_meta, "task": config.task.to_dict(),
          "sampling": {"temperature": float(s.temperature), "top_p": float(s.top_p),
                       "top_k": int(s.top_k), "max_prompt_len": int(s.max_prompt_len),
                       "max_new_tokens": int(s.max_new_tokens)},
          "group_size": int(config.rl.group_size),
          # trajectories sampled in an environment (config.env): its name, tools and limits
          **({"env": config.env.to_dict()} if config.env.name is not None else {})}


def arrays_of(rollout: Rollout, rewards: np.ndarray) -> dict[str, np.ndarray]:
  """A rollout's answers as the file's ragged arrays (`ARRAYS`; `SPAN_ARRAY` too for
  multi-turn trajectories)."""
  lengths = np.asarray(rollout.lengths, np.int64)
  keep = np.arange(rollout.answers.shape[1])[None, :] < lengths[:, None]  # [N, A]
  prompt_lengths = np.array([len(p) for p in rollout.prompts], np.int64)
  return {
      "prompt_tokens": np.concatenate([np.asarray(p, np.int32) for p in rollout.prompts]),
      "prompt_offsets": np.concatenate([[0], np.cumsum(prompt_lengths)]).astype(np.int64),
      "answer_tokens": rollout.answers[keep].astype(np.int32),  # row-major: answer after answer
      "answer_logprobs": rollout.logprobs[keep].astype(np.float32),
      "answer_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
      "finish": np.asarray(rollout.finish, np.int8),
      "rewards": np.asarray(rewards, np.float32),
      "version": np.asarray(rollout.versions, np.int32),
      # multi-turn trajectories (a sampler job's with config.env): 1 on the model's tokens
      **({} if rollout.model is None else {SPAN_ARRAY: rollout.model[keep].astype(np.int8)}),
  }


def write(path: str, header: dict, arrays: dict[str, np.ndarray]) -> None:
  """Writes the file aside and renames it into place: a reader never sees half a file."""
  header = {"format": FORMAT, **header}
  text = json.dumps(header, sort_keys=True)
  buf = io.BytesIO()  # a file object: np.savez adds no ".npz" to the name
  np.savez(buf, header=np.array(text), sha256=np.array(digest(text, arrays)), **arrays)
  storage.write_bytes(path, buf.getvalue())  # local: written aside and renamed; a bucket: one upload


def sample_round(config, sampler, weights, problems: list[Problem], *, round_index: int,
                 policy: dict, model_meta: dict) -> tuple[dict, dict, int]:
  """G answers to each of `problems`, sampled with `weights` (engine weights, `Sampler.load`),
  as (header, arrays, answer tokens generated). round_index: 0-based; fixes the sampling key.
  policy: what the header records of the weights (version, snapshot_step, source)."""
  key = jax.random.fold_in(jax.random.key(config.seed), KEY_SALT + round_index)
  scored = sampler.sample(weights, problems, group_size=config.rl.group_size, key=key)
  header = {**expected_header(config, model_meta), "policy": policy, "round": round_index + 1,
            "seed": int(config.seed),
            "problems": [dataclasses.asdict(p) for p in problems]}
  return header, arrays_of(scored.rollout, scored.rewards), int(scored.rollout.lengths.sum())


def round_one_problems(config, task) -> list[Problem]:
  """The training problems round 1 answers when the run (or `generate`) samples it."""
  return task.train_problems(np.random.default_rng([config.seed, 2]), config.rl.offline.problems)


# --- reading ------------------------------------------------------------------------------------


@dataclasses.dataclass
class OfflineData:
  """A read and verified offline file: its header and ragged arrays (`ARRAYS`)."""

  path: str
  header: dict
  arrays: dict[str, np.ndarray]
  sha256: str = ""  # of the header's text and the arrays (`digest`), checked when read

  @property
  def groups(self) -> int:
    return len(self.arrays["prompt_offsets"]) - 1

  @property
  def group_size(self) -> int:
    return int(self.header["group_size"])

  @property
  def problems(self) -> list[Problem]:
    return [Problem(**p) for p in self.header["problems"]]

  def rows(self, groups: np.ndarray, *, seq_len: int, pad_id: int, count_truncated: bool) -> Rows:
    """The rows of `groups` (indices into the file's groups, in that order), laid out as a
    rollout's (`logprobs.make_batch`); stamps: the file's versions, snapshot_step -1."""
    a, g = self.arrays, self.group_size
    po, ao = a["prompt_offsets"], a["answer_offsets"]
    answers = (np.asarray(groups)[:, None] * g + np.arange(g)[None, :]).reshape(-1)  # [n]
    lengths = (ao[answers + 1] - ao[answers]).astype(np.int32)
    width = max(int(lengths.max()), 1)
    tokens = np.full((len(answers), width), pad_id, np.int32)
    logprobs = np.zeros((len(answers), width), np.float32)
    for row, i in enumerate(answers):
      tokens[row, :lengths[row]] = a["answer_tokens"][ao[i]:ao[i + 1]]
      logprobs[row, :lengths[row]] = a["answer_logprobs"][ao[i]:ao[i + 1]]
    rollout = Rollout(prompts=[a["prompt_tokens"][po[p]:po[p + 1]].tolist() for p in groups],
                      group_size=g, answers=tokens, logprobs=logprobs, lengths=lengths,
                      finish=a["finish"][answers], versions=a["version"][answers])
    rows = make_batch(rollout, a["rewards"][answers], seq_len=seq_len, pad_id=pad_id,
                      count_truncated=count_truncated)
    if SPAN_ARRAY not in a:
      return rows
    model = np.zeros((len(answers), width), np.int8)  # [n, A] 1 on the model's tokens
    for row, i in enumerate(answers):
      model[row, :lengths[row]] = a[SPAN_ARRAY][ao[i]:ao[i + 1]]
    prompt_lengths = np.repeat(po[np.asarray(groups) + 1] - po[np.asarray(groups)], g)  # [n]
    return only_model_targets(rows, model, prompt_lengths)

  @property
  def has_logprobs(self) -> bool:
    """Whether the file stores pi_old's log-probs (else the run rescores them: `fill_logprobs`)."""
    return self.header.get("logprobs", "sampler") != NO_LOGPROBS


def read(path: str) -> OfflineData:
  """Reads and checks a file on its own: it opens, its digest holds, its arrays agree with
  each other and with its header. `OfflineFileError` (naming the file) otherwise."""
  try:
    data = storage.read_bytes(path)
  except (FileNotFoundError, IsADirectoryError):
    _fail(path, "no such file")
  try:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
      members = {name: z[name] for name in z.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
    _fail(path, f"unreadable: truncated, corrupted or not an .npz file ({type(e).__name__}: {e})")
  missing = [n for n in ("header", "sha256", *ARRAYS) if n not in members]
  if missing:
    _fail(path, f"not an offline file: no {', '.join(missing)}")
  text, arrays = str(members["header"]), {n: members[n] for n in (*ARRAYS, SPAN_ARRAY) if n in members}
  if digest(text, arrays) != str(members["sha256"]):
    _fail(path, "checksum mismatch: the file is corrupted or was edited")
  try:
    header = json.loads(text)
  except json.JSONDecodeError as e:
    _fail(path, f"unreadable header ({e})")
  if header.get("format") != FORMAT:
    _fail(path, f"format {header.get('format')!r}, expected {FORMAT!r}")
  data = OfflineData(path, header, arrays, str(members["sha256"]))
  _check_shapes(data)
  return data


INTEGER_ARRAYS = ("prompt_tokens", "prompt_offsets", "answer_tokens", "answer_offsets", "finish", "version")


def _check_shapes(data: OfflineData) -> None:
  a, path, h = data.arrays, data.path, data.header
  flat = [k for k in ARRAYS if a[k].ndim != 1 or a[k].dtype.kind not in "iuf"]
  if flat:
    _fail(path, f"{', '.join(flat)}: not a 1-D array of numbers")
  floats = [k for k in INTEGER_ARRAYS if a[k].dtype.kind not in "iu"]
  if floats:  # token ids 3.7, offsets 2.5: no sampler writes them
    _fail(path, f"{', '.join(floats)}: not an array of integers ({', '.join(str(a[k].dtype) for k in floats)})")
  if not (isinstance(h.get("problems"), list) and isinstance(h.get("group_size"), int)
          and not isinstance(h.get("group_size"), bool) and h["group_size"] >= 1):
    _fail(path, "its header has no list of problems or no group_size >= 1")
  n = data.groups * data.group_size
  ok = (len(data.header["problems"]) == data.groups and data.groups > 0
        and all(len(a[k]) == n for k in ("finish", "rewards", "version"))
        and len(a["answer_offsets"]) == n + 1
        and a["answer_offsets"][0] == 0 and a["prompt_offsets"][0] == 0
        and a["answer_offsets"][-1] == len(a["answer_tokens"]) == len(a["answer_logprobs"])
        and a["prompt_offsets"][-1] == len(a["prompt_tokens"])
        and (np.diff(a["answer_offsets"]) >= 1).all() and (np.diff(a["prompt_offsets"]) >= 1).all())
  if not ok:
    _fail(path, f"its arrays disagree with its header ({data.groups} groups of {data.group_size})")
  if SPAN_ARRAY in a:
    spans = a[SPAN_ARRAY]
    if spans.ndim != 1 or spans.dtype.kind not in "iu" or len(spans) != len(a["answer_tokens"]):
      _fail(path, f"{SPAN_ARRAY}: not one integer flag per answer token")
    if not np.isin(spans, (0, 1)).all():
      _fail(path, f"{SPAN_ARRAY}: a flag that is not 0 (environment) or 1 (model)")


def check_matches(data: OfflineData, config, model_meta: dict) -> None:
  """Refuses a file written for another model, task, sequence length, sampling or group size."""
  want, have = expected_header(config, model_meta), data.header

  def differing(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b), key=str)
    return ", ".join(f"{k}={b.get(k)!r} (run: {a.get(k)!r})" for k in keys if a.get(k) != b.get(k))

  if have.get("model") != want["model"]:
    _fail(data.path, f"written for another model: {differing(want['model'], have.get('model') or {})}")
  if have.get("task") != want["task"]:
    _fail(data.path, f"written for another task: task.{differing(want['task'], have.get('task') or {})}")
  s, h = want["sampling"], have.get("sampling") or {}
  lengths = ("max_prompt_len", "max_new_tokens")
  if any(h.get(k) != s[k] for k in lengths):
    _fail(data.path, f"written with sequence length {h.get('max_prompt_len')} + {h.get('max_new_tokens')} "
          f"(sampling.max_prompt_len + max_new_tokens); this run's is {s['max_prompt_len']} + "
          f"{s['max_new_tokens']}")
  if any(h.get(k) != v for k, v in s.items()):
    _fail(data.path, f"sampled with other settings: sampling.{differing(s, h)}")
  if have.get("group_size") != want["group_size"]:
    _fail(data.path, f"groups of {have.get('group_size')} answers; this run's rl.group_size="
          f"{want['group_size']}")
  if "env" in want and have.get("env") != want["env"]:
    _fail(data.path, "sampled " + (f"in another environment: env.{differing(want['env'], have['env'])}"
                                   if have.get("env") else "without an environment (single answers or imported "
                                   f"traces); this run samples in env.name={want['env']['name']!r}"))
  _check_values(data, vocab_size=int(want["model"]["vocab_size"]), max_prompt_len=s["max_prompt_len"],
                max_new_tokens=s["max_new_tokens"])


LOGPROB_SLACK = 1e-4  # a log-prob above 0 by more than this is not one (float rounding aside)
# A sampled token has a positive probability under a float softmax: at least float64's smallest
# positive number, e^-744.4 (float32's: e^-103.3). A finite log-prob below this (e.g. -1e9, a
# masking constant) was not the sampler's log-prob of a token it sampled.
LOGPROB_FLOOR = -745.0
FINISH_CODES = (FINISH_EOS, FINISH_LENGTH, FINISH_STOP)


def _check_values(data: OfflineData, *, vocab_size: int, max_prompt_len: int, max_new_tokens: int) -> None:
  """Every row's values: token ids in [0, vocab), prompts and answers within the run's lengths,
  log-probs finite and <= 0, rewards finite; the first bad one is named (group and answer)."""
  a, g = data.arrays, data.group_size

  def first_bad(ok: np.ndarray, offsets: np.ndarray | None = None):
    """The row (answer or group) of the first False in `ok` (per element of a ragged array)."""
    bad = np.flatnonzero(~ok)
    if not len(bad):
      return None
    return int(bad[0]) if offsets is None else int(np.searchsorted(offsets, bad[0], side="right") - 1)

  def answer(i: int) -> str:
    return f"answer {i} (group {i // g}, answer {i % g} of it)"

  checks = [
      (first_bad((a["answer_tokens"] >= 0) & (a["answer_tokens"] < vocab_size), a["answer_offsets"]),
       answer, f"a token id outside [0, {vocab_size}) (model.vocab_size)"),
      (first_bad(np.diff(a["answer_offsets"]) <= max_new_tokens), answer,
       f"longer than sampling.max_new_tokens={max_new_tokens}"),
      (first_bad(np.isfinite(a["answer_logprobs"]), a["answer_offsets"]), answer, "a log-prob that is not finite"),
      (first_bad(a["answer_logprobs"] <= LOGPROB_SLACK, a["answer_offsets"]), answer, "a log-prob above 0"),
      (first_bad(a["answer_logprobs"] >= LOGPROB_FLOOR, a["answer_offsets"]), answer,
       f"a log-prob below {LOGPROB_FLOOR:g} (no float softmax gives a sampled token less)"),
      (first_bad(np.isin(a["finish"], FINISH_CODES)), answer,
       f"a finish code outside {sorted(FINISH_CODES)} (EOS, length, stop sequence)"),
      (first_bad(np.isfinite(a["rewards"])), answer, "a reward that is not finite"),
      (first_bad((a["prompt_tokens"] >= 0) & (a["prompt_tokens"] < vocab_size), a["prompt_offsets"]),
       lambda p: f"group {p}'s prompt", f"a token id outside [0, {vocab_size}) (model.vocab_size)"),
      (first_bad(np.diff(a["prompt_offsets"]) <= max_prompt_len), lambda p: f"group {p}'s prompt",
       f"longer than sampling.max_prompt_len={max_prompt_len}"),
  ]
  for row, name, why in checks:
    if row is not None:
      _fail(data.path, f"{name(row)}: {why}")


def check_problems(data: OfflineData, tokenizer) -> None:
  """The header's problems are problems (prompt, answer, id) and each group's prompt tokens are
  its problem's prompt as the sampler encodes it: the answers were sampled for them."""
  po, tokens = data.arrays["prompt_offsets"], data.arrays["prompt_tokens"]
  for p, problem in enumerate(data.header["problems"]):
    try:
      prompt = Problem(**problem).prompt
    except TypeError as e:
      _fail(data.path, f"header problem {p} is not a problem (prompt, answer, id): {e}")
    if tokens[po[p]:po[p + 1]].tolist() != list(tokenizer.encode(prompt, add_bos=True)):
      _fail(data.path, f"group {p}'s prompt tokens are not its header problem's prompt "
            f"({prompt[:60]!r}) as this run's tokenizer encodes it")


def logprob_kernel(config, graphdef):
  """Jitted `(params, tokens [n, T]) -> [n, T-1]`: the trainer's log-prob kernel under the
  engine's sampling settings (`--dry_run=compile` compiles it too: oapl_jax/aot.py)."""
  sampling = SamplingParams.from_config(config.sampling)
  return jax.jit(lambda p, t: token_logprobs(nnx.merge(graphdef, p), t, sampling,
                                             tile=config.train.logprob_tile,
                                             attn_block=config.train.attn_block)[0],
                 compiler_options=compiler_options(config.model.exact_rounding))


def logprob_fn(config, graphdef, mesh):
  """`(params, tokens [n, T]) -> [n, T-1]` log-probs by the trainer's kernel (`logprob_kernel`),
  one row per call (one compile), on the trainer's mesh (multi-host: a collective; every process
  passes the same rows and gets all of them)."""
  kernel = logprob_kernel(config, graphdef)
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # multi-host: alike on every process

  def logprobs(params, tokens: np.ndarray) -> np.ndarray:
    with jax.set_mesh(mesh):
      return np.concatenate([distributed.fetch(kernel(params, jax.device_put(tokens[i:i + 1], whole)))
                             for i in range(len(tokens))])

  return logprobs


def check_logprobs(data: OfflineData, config, recompute, params, *, seq_len: int, pad_id: int,
                   what: str) -> float:
  """Rescores `rl.offline.check_rows` rows of `data` (drawn from the seed) with `params` through
  `recompute` (`logprob_fn`) and refuses the file if the mean |stored - recomputed| per answer
  token exceeds `rl.offline.logprob_tol`. what: how the message names `params`. Returns the mean."""
  off = config.rl.offline
  rng = np.random.default_rng([config.seed, 4, int(data.header.get("round", 0))])
  n = data.groups * data.group_size
  answers = np.sort(rng.choice(n, size=min(off.check_rows, n), replace=False))
  groups = np.unique(answers // data.group_size)
  rows = data.rows(groups, seq_len=seq_len, pad_id=pad_id, count_truncated=True)  # every answer token
  rows = rows.select(np.searchsorted(groups, answers // data.group_size) * data.group_size
                     + answers % data.group_size)
  mask = rows.mask > 0
  diff = np.abs(recompute(params, rows.tokens) - rows.sampler_logprobs)[mask]
  mean = float(diff.mean())
  if not mean <= off.logprob_tol:
    policy = data.header.get("policy", {})
    _fail(data.path, f"its log-probs are not those of {what}: mean |stored - recomputed| = {mean:.3g} per "
          f"token over {int(mask.sum())} tokens of {len(answers)} rows (rl.offline.logprob_tol="
          f"{off.logprob_tol}); it names its sampler as {policy.get('source', '?')!r}")
  return mean


def fill_logprobs(data: OfflineData, recompute, params, *, seq_len: int, pad_id: int) -> int:
  """A file stored without log-probs (`has_logprobs` False: imported traces of another
  sampler): sets its answer log-probs to `params`' (the run's pi_old) rescoring through
  `recompute` (`logprob_fn`), on the model's tokens (0 on the environment's), so that pi_old is
  the policy the run starts the round from. One group at a time. Returns the tokens rescored."""
  a, g = data.arrays, data.group_size
  po, ao = a["prompt_offsets"], a["answer_offsets"]
  filled = np.zeros_like(a["answer_logprobs"])
  flags = a.get(SPAN_ARRAY, np.ones(len(a["answer_tokens"]), np.int8))
  for group in range(data.groups):
    rows = data.rows(np.array([group]), seq_len=seq_len, pad_id=pad_id, count_truncated=True)
    lp = recompute(params, rows.tokens)  # [g, T-1]
    p = int(po[group + 1] - po[group])
    for j in range(g):
      i = group * g + j
      n = int(ao[i + 1] - ao[i])
      filled[ao[i]:ao[i + 1]] = lp[j, p - 1:p - 1 + n] * flags[ao[i]:ao[i + 1]]
  data.arrays = {**a, "answer_logprobs": filled.astype(np.float32)}
  return int(flags.sum())


# --- the schedule of the offline phase ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Steps of the offline phase: `rounds` x `epochs` passes of `groups // per_step` steps."""

  groups: int  # groups in a round's file
  per_step: int  # rl.groups_per_step
  epochs: int
  rounds: int

  @property
  def steps_per_epoch(self) -> int:
    return self.groups // self.per_step

  @property
  def round_steps(self) -> int:
    return self.epochs * self.steps_per_epoch

  @property
  def steps(self) -> int:
    return self.rounds * self.round_steps

  def batch(self, seed: int, step: int) -> tuple[int, np.ndarray]:
    """(round index, the file's groups trained on) of offline step `step` (< `steps`)."""
    round_index, k = divmod(step, self.round_steps)
    epoch, b = divmod(k, self.steps_per_epoch)
    order = np.random.default_rng([seed, 3, round_index, epoch]).permutation(self.groups)
    return round_index, order[b * self.per_step:(b + 1) * self.per_step]
