"""Packed rows vs padded rows: the train step on long-tailed answer lengths (CPU), and PyTorch.

One process times our train step on packed rows (`train.packing`, oapl_jax/rl/packing.py)
against the same step on padded rows, side by side: the repetitions alternate between the
sides and the two length distributions, so all see the same machine load.

    python benchmarks/packed_step.py [--reps 5] [--torch]   # the comparison (~4 min on idle 2 cores*)
    python benchmarks/packed_step.py --sweep [--torch]      # settings: --sweep-accum, --sweep-packed
    python benchmarks/packed_step.py --quick [--torch]      # tiny shapes (the test)

(*) estimated from the CPU seconds measured on a loaded machine (docs/performance.md, "Packed
rows"): about 56 CPU seconds a repetition with --torch, plus the two compiles.

Model: benchmarks/train_step.py's tiny Qwen3 (vocab 1024, hidden 256, 4 layers, 4 query / 2 KV
heads of 64, MLP 768, QK-norm, tied embeddings, float32), `nnx.Rngs(0)`, written with `to_hf`
to a temporary folder and read back by every side. OAPL loss (beta1 1, beta2 0.1) in sampler
mode (`rl.old_logprobs="sampler"`: one forward pass, no snapshot scoring), AdamW with
gradient-norm clipping (lr 1e-6), the attention and log-prob settings at the config defaults
(`train.logprob_tile` 512, `train.remat` none; `train.attn_block` per side, below).

A step's answers: `--groups` 8 groups of G = 8 (64 answers), each group sharing one
`--prompt` 32-token prompt, answer lengths drawn per distribution:
* pareto: as benchmarks/window_rollouts.py draws them, clip((pareto(1.2) + 1) * 12, 1, 256)
  (12..256 tokens, mean ~37);
* even: uniform over 1..256.
Padded rows are seq_len = 32 + 256 = 288 tokens. Token ids, sampler log-probs and rewards are
random; one draw per distribution (`--seed`), the same answers for every side.

Sides (one timed step = `TrainStep.batch_of(rows)` on the host (the packing, under
`train.packing`) + the step call (placement, the jitted step, params and AdamW state donated)
until its metrics are ready; one untimed warm-up step per side first, the compile):
* padded: `train.packing=False`, `train.grad_accum` = `--accum` (default 1: one micro-batch of
  all 64 rows x 288), `train.attn_block` = `--attn-block` (default: the config's 512; at 288
  tokens one block);
* packed: `train.packing=True`, `train.pack_rows` = `--pack-rows` (1), `train.pack_budget` =
  `--pack-budget-x` (8) x seq_len (2,304 tokens), `train.attn_block` = `--pack-attn-block`
  (128): the fastest of the settings measured on these 2 cores (docs/performance.md, "Packed
  rows"); the compiled step holds 8 micro-batches of 1 row, the answers fill 2 (pareto) or 5
  (even), the rest are skipped;
* torch (`--torch`, in this process): transformers' Qwen3 (`AutoModelForCausalLM`, float32,
  `attn_implementation="sdpa"`, `use_cache=False`), log-softmax, the same OAPL loss,
  `clip_grad_norm_`, `torch.optim.AdamW`, `OMP_WAIT_POLICY=PASSIVE`, on the same answers,
  three layouts: "packed" (first-fit decreasing into rows of `--torch-budget` tokens,
  `position_ids` restarting at 0 per answer and no attention mask: transformers then builds the
  block-diagonal causal mask itself, `masking_utils.find_packed_sequence_indices`), "bucketed"
  (answers sorted by length, batches of at most `--torch-bucket` tokens, each padded to its
  longest: plain causal attention) and "padded" (all 64 answers padded to the longest).

Figures per distribution and side: the median step seconds of `--reps` alternating
repetitions, real tokens/s (prompt + answer of every answer: the same count for every side),
the ratio packed / padded (and packed / the fastest torch layout), the layout (`batch_of`'s
pad_fraction, micro_batches, rows_filled; torch: the positions it computes), the host share of
the step (`batch_of`: the packing), and the warm-up step's loss (the same weights and answers:
equal across sides to float32 rounding).

`--sweep` times every padded `--sweep-accum` setting and packed `--sweep-packed` setting
(ROWSxBUDGET: `train.pack_rows` x `train.pack_budget` in multiples of seq_len), each at every
`--sweep-attn` block, with `--sweep-reps` alternating repetitions; with `--torch
--sweep-torch` also the torch layouts at three budgets each. `--quick`: a 1-layer model of
width 64 (vocab 128), 2 groups, 8-token prompts, answers up to 24 tokens, packed rows of
2 x seq_len, one repetition (the test). Text lines per distribution, then one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import train_step as ts  # noqa: E402  (the model, the AdamW settings, the OAPL betas)

GROUP = ts.GROUP
MODEL = dict(ts.MODEL)  # --quick: QUICK_MODEL
QUICK_MODEL = dict(vocab_size=128, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=32, mlp_dim=128)
DISTRIBUTIONS = ("pareto", "even")
_SETTLE = 0.2  # seconds of idleness before each repetition


# --- the answers ------------------------------------------------------------------------------

def answer_lengths(dist: str, n: int, max_answer: int, seed: int):
  """`[n]` answer lengths: "pareto" (window_rollouts.py's draw, its scale 12 x max/256) or
  "even" (uniform over 1..max_answer)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  if dist == "pareto":
    scale = 12 * max_answer / 256
    return np.clip((rng.pareto(1.2, n) + 1) * scale, 1, max_answer).astype(int)
  if dist == "even":
    return rng.integers(1, max_answer + 1, n)
  raise ValueError(f"distribution {dist!r} is not one of {DISTRIBUTIONS}")


def rows_of(lengths, prompt: int, seq: int, seed: int):
  """Padded `Rows` of answers of `lengths` after a `prompt`-token prompt shared by each group
  of G (prompt, answer, then pad id 0), answer targets in the mask, sampler log-probs, 0/1
  rewards."""
  import numpy as np
  from oapl_jax.rl.buffer import Rows
  rng = np.random.default_rng(seed)
  n, vocab = len(lengths), MODEL["vocab_size"]
  tokens = np.zeros((n, seq), np.int32)
  mask = np.zeros((n, seq - 1), np.float32)
  sampler = np.zeros((n, seq - 1), np.float32)
  for g in range(0, n, GROUP):
    tokens[g:g + GROUP, :prompt] = rng.integers(3, vocab, prompt)
  for i, a in enumerate(lengths):
    tokens[i, prompt:prompt + a] = rng.integers(3, vocab, a)
    mask[i, prompt - 1:prompt - 1 + a] = 1.0
    sampler[i, prompt - 1:prompt - 1 + a] = -rng.uniform(5.0, 9.0, a)
  return Rows(tokens=tokens, mask=mask, sampler_logprobs=sampler,
              rewards=rng.integers(0, 2, n).astype(np.float32),
              answer_lengths=np.asarray(lengths), version=np.zeros(n, np.int32),
              snapshot_step=np.zeros(n, np.int32))


def real_tokens(rows) -> int:
  """Prompt + answer tokens of every answer (what a step trains on)."""
  from oapl_jax.rl import packing
  return int(packing.used_lengths(rows).sum())


def _timed(fn) -> dict:
  """fn()'s output, its wall seconds and its CPU seconds (this process, all threads: on a
  shared machine the work done, whatever share of the cores the process gets)."""
  time.sleep(_SETTLE)
  t0, c0 = time.perf_counter(), time.process_time()
  out = fn()
  return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, **out}


# --- our step, padded or packed -----------------------------------------------------------------

def config_of(args, *, accum: int = 1, pack_rows: int | None = None, pack_budget: int = 0,
              attn_block: int = 0):
  """The run config of a side: padded (`pack_rows` None) or packed; attn_block 0: the config's."""
  from oapl_jax import config as config_lib
  c = config_lib.defaults("tiny_addition")
  c.model.update(MODEL, qk_norm=True, tie_embeddings=True, param_dtype="float32", dtype="float32")
  c.rl.loss, c.rl.group_size, c.rl.groups_per_step = "oapl", GROUP, args.groups
  c.rl.old_logprobs, c.rl.beta1, c.rl.beta2 = "sampler", ts.BETA1, ts.BETA2
  c.sampling.max_prompt_len, c.sampling.max_new_tokens = args.prompt, args.max_answer
  c.sampling.temperature = 1.0
  c.train.lr, c.train.b1, c.train.b2, c.train.eps = ts.LR, ts.B1, ts.B2, ts.EPS
  c.train.weight_decay, c.train.grad_clip, c.train.warmup_ratio = ts.WD, ts.CLIP, 0.0
  c.train.min_lr_ratio = 1.0
  c.train.grad_accum = accum
  if attn_block:
    c.train.attn_block = attn_block
  if pack_rows is not None:
    c.train.packing, c.train.pack_rows, c.train.pack_budget = True, pack_rows, pack_budget
  return c


class Ours:
  """One compiled train step (`make_train_step`) and its own params / AdamW state."""

  def __init__(self, name: str, config, graphdef, params0):
    from oapl_jax.rl.step import make_optimizer, make_train_step
    from oapl_jax.sampling import SamplingParams
    self.name, self.config = name, config
    self.step = make_train_step(config, graphdef, make_optimizer(config.train, 1000),
                                SamplingParams(temperature=1.0))
    self.params = self.step.place_params(params0)
    self.opt = self.step.init_opt_state(self.params)
    self.snapshot = self.step.snapshot_of(self.params)

  def rep(self, rows) -> dict:
    import jax

    def run():
      t0 = time.perf_counter()
      batch, layout = self.step.batch_of(rows)
      host = time.perf_counter() - t0
      self.params, self.opt, m = self.step(self.params, self.opt, self.snapshot, batch)
      loss = float(jax.block_until_ready(m["loss"]))
      return {"loss": loss, "grad_norm": float(m["grad_norm"]), "host_s": host, **layout}
    out = _timed(run)
    t = self.config.sampling.max_prompt_len + self.config.sampling.max_new_tokens
    if self.step.packing is None:
      computed = len(rows) * t
    else:
      _, r, s = self.step.packing
      computed = out["micro_batches"] * r * s
    out["computed"] = computed
    out["real_tokens"] = int(round((1.0 - out["pad_fraction"]) * computed))
    return out


def packed_name(rows: int, budget_x: int) -> str:
  return f"packed r{rows} b{budget_x}x"


# --- PyTorch / transformers ---------------------------------------------------------------------

class Torch:
  """transformers' Qwen3 on the same answers, laid out three ways (`LAYOUTS`); one model and
  AdamW per layout, all from the same weights."""

  LAYOUTS = ("packed", "bucketed", "padded")

  def __init__(self, hf_dir: str, layouts):
    import torch
    import transformers
    self.torch = torch
    self.models = {}
    for name in layouts:
      model = transformers.AutoModelForCausalLM.from_pretrained(
          hf_dir, dtype=torch.float32, attn_implementation="sdpa")
      model.train()
      opt = torch.optim.AdamW(model.parameters(), lr=ts.LR, betas=(ts.B1, ts.B2), eps=ts.EPS,
                              weight_decay=ts.WD)
      self.models[name] = (model, opt)
    self.info = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads(), "attn_implementation": "sdpa",
                 "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}

  @staticmethod
  def placement(layout: str, lengths, budget: int):
    """[(rows, width, [(answer, row, start)], restart)]: the chunks (one forward pass each) of
    answers of `lengths` (prompt + answer tokens) under `layout`; restart: positions restart
    at 0 per answer (packed rows)."""
    import numpy as np
    from oapl_jax.rl import packing
    n = len(lengths)
    if layout == "padded":
      return [(n, int(lengths.max()), [(i, i, 0) for i in range(n)], False)]
    if layout == "bucketed":  # longest first; a chunk holds rows x its longest <= budget
      chunks, cur = [], []
      for i in np.argsort(-lengths, kind="stable"):
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
          chunks.append(cur)
          cur = []
        cur.append(int(i))
      chunks.append(cur)
      return [(len(c), int(lengths[c[0]]), [(i, r, 0) for r, i in enumerate(c)], False) for c in chunks]
    if layout == "packed":
      row, start = packing.first_fit_decreasing(np.asarray(lengths), budget, n)
      used = int(row.max()) + 1
      width = int(max(start[i] + lengths[i] for i in range(n)))
      return [(used, width, [(i, int(row[i]), int(start[i])) for i in range(n)], True)]
    raise ValueError(layout)

  def batch(self, layout: str, rows, budget: int) -> dict:
    """Tensors of `rows` under `layout`: per chunk, input ids and positions `[n, L]`, and per
    target (position j predicts token j + 1) its answer, mask and sampler log-prob `[n, L-1]`."""
    import numpy as np
    from oapl_jax.rl import packing
    torch = self.torch
    lengths = packing.used_lengths(rows)
    chunks = []
    for n, width, places, restart in self.placement(layout, lengths, budget):
      ids = np.zeros((n, width), np.int64)
      pos = np.tile(np.arange(width), (n, 1))
      answer = np.zeros((n, width - 1), np.int64)
      mask = np.zeros((n, width - 1), np.float32)
      old = np.zeros((n, width - 1), np.float32)
      fill = np.zeros(n, np.int64)
      for i, r, a in places:
        m = int(lengths[i])
        ids[r, a:a + m] = rows.tokens[i, :m]
        pos[r, a:a + m] = np.arange(m)
        answer[r, a:a + m - 1] = i
        mask[r, a:a + m - 1] = rows.mask[i, :m - 1]
        old[r, a:a + m - 1] = rows.sampler_logprobs[i, :m - 1]
        fill[r] = max(fill[r], a + m)
      for r in range(n):  # padding after a packed row's last answer: a segment of its own
        pos[r, fill[r]:] = np.arange(width - fill[r])
      chunks.append({"ids": torch.from_numpy(ids), "answer": torch.from_numpy(answer),
                     "pos": torch.from_numpy(pos) if restart else None,
                     "mask": torch.from_numpy(mask), "old": torch.from_numpy(old)})
    return {"chunks": chunks, "rewards": torch.from_numpy(rows.rewards), "n": len(rows),
            "computed": sum(c["ids"].numel() for c in chunks),
            "real_tokens": int(lengths.sum()), "rows": sum(c["ids"].shape[0] for c in chunks)}

  def _loss(self, model, b):
    torch = self.torch
    ell = torch.zeros(b["n"])
    for c in b["chunks"]:
      logits = model(input_ids=c["ids"], position_ids=c["pos"], use_cache=False).logits  # [n, L, V]
      logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, c["ids"][:, 1:, None])[..., 0]
      ell = ell.index_add(0, c["answer"].reshape(-1), ((logp - c["old"]) * c["mask"]).reshape(-1))
    rewards = b["rewards"].reshape(-1, GROUP)
    v_hat = ts.BETA1 * (torch.logsumexp(rewards / ts.BETA1, 1) - torch.log(torch.tensor(float(GROUP))))
    adv = (rewards - v_hat[:, None]).reshape(-1)
    return ((ts.BETA2 * ell - adv) ** 2).mean()

  def rep(self, layout: str, rows, budget: int) -> dict:
    torch = self.torch
    model, opt = self.models[layout]

    def run():
      t0 = time.perf_counter()
      b = self.batch(layout, rows, budget)
      host = time.perf_counter() - t0
      loss = self._loss(model, b)
      loss.backward()
      norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ts.CLIP)
      opt.step()
      opt.zero_grad(set_to_none=True)
      return {"loss": float(loss), "grad_norm": float(norm), "host_s": host,
              "computed": b["computed"], "real_tokens": b["real_tokens"], "rows": b["rows"],
              "pad_fraction": 1.0 - b["real_tokens"] / b["computed"]}
    return _timed(run)


# --- the driver -------------------------------------------------------------------------------

def summarize(reps: list[dict]) -> dict:
  first, timed = reps[0], reps[1:]  # the warm-up (compile), then the timed repetitions
  sec = statistics.median(r["seconds"] for r in timed)
  cpu = statistics.median(r["cpu_s"] for r in timed)
  keep = ("pad_fraction", "micro_batches", "rows_filled", "computed", "real_tokens", "rows")
  return {"seconds": sec, "seconds_all": [round(r["seconds"], 4) for r in timed],
          "tokens_per_s": first["real_tokens"] / sec, "cpu_s": cpu,
          "cpu_s_all": [round(r["cpu_s"], 4) for r in timed],
          "tokens_per_cpu_s": first["real_tokens"] / cpu,
          "host_s": statistics.median(r["host_s"] for r in timed),
          "warmup_loss": first["loss"], "warmup_s": first["seconds"],
          **{k: first[k] for k in keep if k in first}}


def run_sides(sides: dict, batches: dict, reps: int) -> dict:
  """{dist: {side: summary}}: one warm-up repetition per side and distribution, then `reps`
  repetitions alternating over sides and distributions. sides: name -> rep(rows) callable."""
  out = {d: {n: [] for n in sides} for d in batches}
  for i in range(reps + 1):
    for n, rep in sides.items():
      for d, rows in batches.items():
        out[d][n].append(rep(rows))
        print(f"[{'warm-up' if i == 0 else f'rep {i}'}] {n} {d}: {out[d][n][-1]['seconds']:.3f} s "
              f"{out[d][n][-1]['cpu_s']:.3f} cpu-s "
              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
  return {d: {n: summarize(rs) for n, rs in by.items()} for d, by in out.items()}


def build(args):
  """(graphdef, params0, hf_dir): the tiny Qwen3, written as a Hugging Face folder and read back."""
  from flax import nnx
  from oapl_jax.models import ModelConfig, Transformer, from_hf, to_hf
  hf_dir = tempfile.mkdtemp(prefix="packed_step_hf_")
  cfg = ModelConfig(**MODEL, qk_norm=True, tie_embeddings=True, param_dtype="float32", dtype="float32")
  to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), hf_dir)
  graphdef, params0 = nnx.split(from_hf(hf_dir), nnx.Param)
  return graphdef, params0, hf_dir


def our_sides(args, graphdef, params0, padded: list[tuple[int, int]],
              packed: list[tuple[int, int, int]]) -> dict:
  """{name: rep}: padded sides (grad_accum, attn_block), packed (pack_rows, pack_budget /
  seq_len, attn_block); attn_block 0: the config's, else named "@block"."""
  seq = args.prompt + args.max_answer
  sides = {}
  for accum, attn in padded:
    name = f"padded a{accum}" + (f" @{attn}" if attn else "")
    sides[name] = Ours(name, config_of(args, accum=accum, attn_block=attn), graphdef, params0).rep
  for rows, x, attn in packed:
    name = packed_name(rows, x) + (f" @{attn}" if attn else "")
    sides[name] = Ours(name, config_of(args, pack_rows=rows, pack_budget=x * seq, attn_block=attn),
                       graphdef, params0).rep
  return sides


def settings(spec: str) -> list[tuple[int, ...]]:
  """"1,4@128" -> [(1, 0), (4, 128)]; "1x8@128,2x4" -> [(1, 8, 128), (2, 4, 0)]."""
  out = []
  for item in spec.split(","):
    main, _, attn = item.partition("@")
    out.append((*(int(v) for v in main.split("x")), int(attn or 0)))
  return out


def torch_sides(args, hf_dir: str, settings: list[tuple[str, int]]) -> tuple[dict, dict]:
  """({f"torch {layout} {budget}": rep}, info) for (layout, budget) settings."""
  layouts = sorted({l for l, _ in settings})
  side = Torch(hf_dir, layouts)
  sides = {}
  for layout, budget in settings:
    name = f"torch {layout}" + ("" if layout == "padded" else f" {budget}")
    sides[name] = (lambda l, bud: lambda rows: side.rep(l, rows, bud))(layout, budget)
  return sides, side.info


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--groups", type=int, default=8, help="groups of G = 8 answers per step")
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--max-answer", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--accum", type=int, default=1, help="the padded side's train.grad_accum")
  parser.add_argument("--pack-rows", type=int, default=1, help="the packed side's train.pack_rows")
  parser.add_argument("--pack-budget-x", type=int, default=8,
                      help="the packed side's train.pack_budget, in multiples of seq_len")
  parser.add_argument("--attn-block", type=int, default=0, help="the padded side's train.attn_block (0: the config's)")
  parser.add_argument("--pack-attn-block", type=int, default=128, help="the packed side's train.attn_block (0: the config's)")
  parser.add_argument("--torch", action="store_true", help="add the PyTorch side (in this process)")
  parser.add_argument("--torch-layouts", default="packed,bucketed,padded")
  parser.add_argument("--torch-budget", type=int, default=576, help="torch packed rows' tokens")
  parser.add_argument("--torch-bucket", type=int, default=2048, help="torch buckets' tokens")
  parser.add_argument("--sweep", action="store_true", help="time every setting of --sweep-*")
  parser.add_argument("--sweep-reps", type=int, default=2)
  parser.add_argument("--sweep-torch", action="store_true", help="with --sweep --torch: torch at several budgets")
  parser.add_argument("--sweep-accum", default="1,2,4,1@128",
                      help="padded settings ACCUM[@ATTN_BLOCK]: train.grad_accum, train.attn_block")
  parser.add_argument("--sweep-packed", default="1x2,1x4,2x2,1x8,2x4,4x2,1x8@128,2x4@128",
                      help="packed settings ROWSxBUDGET[@ATTN_BLOCK]: train.pack_rows x train.pack_budget "
                           "/ seq_len, train.attn_block")
  parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 repetition (the test)")
  args = parser.parse_args()
  if args.quick:
    args.groups, args.prompt, args.max_answer, args.reps, args.sweep_reps = 2, 8, 24, 1, 1
    args.sweep_accum, args.sweep_packed = "1,2", "1x1,1x2@8"
    args.torch_budget, args.torch_bucket, args.pack_budget_x = 64, 128, 2
    MODEL.update(QUICK_MODEL)
  if args.torch:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch's OpenMP starts

  seq = args.prompt + args.max_answer
  n = args.groups * GROUP
  batches, lengths = {}, {}
  for i, d in enumerate(DISTRIBUTIONS):
    lengths[d] = answer_lengths(d, n, args.max_answer, args.seed + i)
    batches[d] = rows_of(lengths[d], args.prompt, seq, args.seed + i)
  graphdef, params0, hf_dir = build(args)
  if args.sweep:
    padded, packed = settings(args.sweep_accum), settings(args.sweep_packed)
    torch_settings = [("packed", args.torch_budget), ("bucketed", args.torch_bucket), ("padded", 0)]
    if args.sweep_torch:
      torch_settings = [("packed", x * seq) for x in (1, 2, 4)] + \
          [("bucketed", b) for b in (args.torch_bucket // 2, args.torch_bucket, args.torch_bucket * 2)] + \
          [("padded", 0)]
    reps = args.sweep_reps
  else:
    padded = [(args.accum, args.attn_block)]
    packed = [(args.pack_rows, args.pack_budget_x, args.pack_attn_block)]
    torch_settings = [("packed", args.torch_budget), ("bucketed", args.torch_bucket), ("padded", 0)]
    reps = args.reps
  torch_settings = [t for t in torch_settings if t[0] in args.torch_layouts.split(",")]
  load = os.getloadavg()
  t0 = time.perf_counter()
  sides = our_sides(args, graphdef, params0, padded, packed)
  info = None
  if args.torch:
    more, info = torch_sides(args, hf_dir, torch_settings)
    sides.update(more)
  figures = run_sides(sides, batches, reps)

  result = {"config": {"model": MODEL, "answers": n, "group": GROUP, "prompt": args.prompt,
                       "max_answer": args.max_answer, "seq_len": seq, "reps": reps,
                       "sweep": args.sweep, "quick": args.quick, "cpus": os.cpu_count(),
                       "loadavg_start": load, "loadavg_end": os.getloadavg(),
                       "wall_s": time.perf_counter() - t0, "torch": info,
                       "attn_block_default": config_of(args).train.attn_block},
            "lengths": {d: {"mean": float(l.mean()), "max": int(l.max()), "min": int(l.min()),
                            "real_tokens": real_tokens(batches[d])} for d, l in lengths.items()},
            "figures": figures, "ratios": {}}
  for d, by in figures.items():
    best_padded = max((k for k in by if k.startswith("padded")), key=lambda k: by[k]["tokens_per_s"])
    best_packed = max((k for k in by if k.startswith("packed")), key=lambda k: by[k]["tokens_per_s"])
    ratios = {"packed/padded": by[best_packed]["tokens_per_s"] / by[best_padded]["tokens_per_s"],
              "packed/padded cpu": by[best_packed]["tokens_per_cpu_s"] / by[best_padded]["tokens_per_cpu_s"],
              "best_padded": best_padded, "best_packed": best_packed}
    torches = [k for k in by if k.startswith("torch")]
    if torches:
      best_torch = max(torches, key=lambda k: by[k]["tokens_per_s"])
      ratios.update(best_torch=best_torch, **{
          "packed/torch": by[best_packed]["tokens_per_s"] / by[best_torch]["tokens_per_s"],
          "packed/torch cpu": by[best_packed]["tokens_per_cpu_s"] / by[best_torch]["tokens_per_cpu_s"]})
    result["ratios"][d] = ratios
    lens = result["lengths"][d]
    print(f"{d}: {n} answers, answer mean {lens['mean']:.1f} max {lens['max']}, "
          f"{lens['real_tokens']} real tokens (prompt + answer)", flush=True)
    for k, f in sorted(by.items(), key=lambda kv: -kv[1]["tokens_per_s"]):
      layout = f"pad {f['pad_fraction']:.2f}" + (f", {f['micro_batches']} micro" if "micro_batches" in f else "") \
          + (f", {f['rows_filled']} rows" if "rows_filled" in f else "") + (f", {f['rows']} rows" if "rows" in f else "")
      print(f"  {k:22s} {f['seconds']:7.3f} s  {f['tokens_per_s']:8.0f} tok/s  "
            f"{f['cpu_s']:7.3f} cpu-s  {f['tokens_per_cpu_s']:7.0f} tok/cpu-s  "
            f"({layout}; host {f['host_s'] * 1e3:.1f} ms; warm-up loss {f['warmup_loss']:.6f})", flush=True)
    print(f"  packed/padded {ratios['packed/padded']:.2f}x wall, {ratios['packed/padded cpu']:.2f}x cpu "
          f"({best_packed} vs {best_padded})"
          + (f"; packed/torch {ratios['packed/torch']:.2f}x wall, {ratios['packed/torch cpu']:.2f}x cpu "
             f"(vs {ratios['best_torch']})" if torches else ""),
          flush=True)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
