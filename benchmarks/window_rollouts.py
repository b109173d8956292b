"""One wave per step vs a window's answers in one continuous batch (issue 42, point 2), on CPU.

The workload of a sync pod run (configs/math.py: each engine gets 4 prompts x G = 8 = 32
answers per step, 32 slots): a step's answers fill the slots exactly, so sampling one step at a
time is one wave with no refill, as long as its longest answer. Answer lengths are long-tailed:
forced by per-answer budgets from a Pareto distribution (shape 1.2, x 12, clipped to 1..256), as
benchmarks/sampler.py's continuous-batching workload. The engine and model are sampler.py's
(a tiny Qwen3, 4 layers, width 256, float32, 32 slots).

Compared at equal engine and slots, k steps' answers each (the same budgets, drawn per step):
* one wave per step: k `rollout` calls of 4 prompts x 8;
* window: one `rollout` call of 4k prompts x 8, slots refilled as answers finish.
Figures, medians over `--reps` repetitions alternating between the two (one machine load):
answers/s, slot utilisation (answer tokens produced / decode slot-steps computed), and the
trainer's idle fraction in a sync loop, where the trainer waits while the engine samples: with a
train step of T seconds, idle = S / (S + T), S the sampling seconds per step (a window's time / k).
T defaults to a third of the one-wave sampling time per step (sampling = 75% of a one-wave step,
the middle of the 73-82% the compiled programs' roofline gives configs/math.py on v5p-64:
docs/performance.md); `--train-seconds` sets it.

    python benchmarks/window_rollouts.py [--k 16] [--reps 5] [--train-seconds T]
    python benchmarks/window_rollouts.py --k 10 --prompts-per-step 32   # configs/code.py's shape

`--prompts-per-step 32` gives configs/code.py's shape (256 answers per step on 32 slots: 8 waves,
refilled within the step, but each step ends in a drain). Prints one JSON object. This measures
the engine side; the loop's `rl.window_rollouts` makes these same calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GROUP, SLOTS, MAX_ANSWER, PROMPT_LEN = 8, 32, 256, 32
PROMPTS_PER_STEP = 4  # --prompts-per-step


def budgets(k: int, seed: int):
  """[k, prompts per step * 8] answer budgets: long-tailed, 1..256 tokens."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return np.clip((rng.pareto(1.2, (k, PROMPTS_PER_STEP * GROUP)) + 1) * 12, 1, MAX_ANSWER).astype(int)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--k", type=int, default=16, help="steps per window")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--train-seconds", type=float, default=None)
  p.add_argument("--prompts-per-step", type=int, default=4, help="x 8 answers per step")
  args = p.parse_args()
  global PROMPTS_PER_STEP  # noqa: PLW0603 (budgets() and the report read it)
  PROMPTS_PER_STEP = args.prompts_per_step
  import jax
  import numpy as np
  from flax import nnx
  from oapl_jax.models import Transformer
  from oapl_jax.sampling import Engine, SamplingParams, rollout
  from sampler import _engine_settings, model_config, prompts

  graphdef, params = nnx.split(Transformer(model_config(), rngs=nnx.Rngs(0)), nnx.Param)
  engine = Engine(graphdef, model_config(), SamplingParams(temperature=1.0), max_slots=SLOTS,
                  max_prefill_length=PROMPT_LEN, max_len=PROMPT_LEN + MAX_ANSWER,
                  **_engine_settings(max_prefill_batch=8))
  weights = engine.load_params(params)
  k = args.k
  work = prompts(k * PROMPTS_PER_STEP, 8, PROMPT_LEN, seed=1)

  # rollout's budgets are per prompt, so each answer is its own prompt (group_size 1), the G
  # answers of a group repeating its prompt: the same slots, prefills of a group's copies aside
  def one_wave(rep: int):
    lim = budgets(k, rep)
    live = steps = 0
    for s in range(k):
      ls = list(lim[s])
      ps = [work[s * PROMPTS_PER_STEP + i // GROUP] for i in range(len(ls))]
      ro = rollout(engine, weights, ps, group_size=1, max_new_tokens=MAX_ANSWER, eos_id=-1, pad_id=0,
                   key=jax.random.key(rep * 1000 + s), answer_limits=ls)
      assert (ro.lengths == np.asarray(ls)).all()
      live, steps = live + ro.stats["live_slot_steps"], steps + ro.stats["slot_steps"]
    return int(lim.sum()), live / steps

  def window(rep: int):
    lim = budgets(k, rep).reshape(-1)
    ps = [work[i // GROUP] for i in range(len(lim))]
    ro = rollout(engine, weights, ps, group_size=1, max_new_tokens=MAX_ANSWER, eos_id=-1, pad_id=0,
                 key=jax.random.key(rep), answer_limits=list(lim))
    assert (ro.lengths == lim).all()
    return int(lim.sum()), ro.slot_utilisation

  sides = {"one_wave_per_step": one_wave, "window": window}
  for fn in sides.values():  # compile every shape both use
    fn(0)
  seconds = {name: [] for name in sides}
  util = {name: [] for name in sides}
  for rep in range(1, args.reps + 1):
    for name, fn in sides.items():
      t0 = time.perf_counter()
      tokens, u = fn(rep)
      seconds[name].append(time.perf_counter() - t0)
      util[name].append(u)
  answers = k * PROMPTS_PER_STEP * GROUP
  med = {name: statistics.median(v) for name, v in seconds.items()}
  train = args.train_seconds if args.train_seconds is not None else med["one_wave_per_step"] / k / 3
  out = {"steps_per_window": k, "answers_per_step": PROMPTS_PER_STEP * GROUP, "slots": SLOTS,
         "answer_length_mean": float(budgets(k, 1).mean()), "answer_length_max": MAX_ANSWER,
         "reps": args.reps, "train_seconds_per_step": train}
  for name in sides:
    s = med[name] / k
    out[name] = {"seconds_per_step": s, "answers_per_s": answers / med[name],
                 "slot_utilisation": statistics.median(util[name]), "trainer_idle": s / (s + train)}
  w, o = out["window"], out["one_wave_per_step"]
  out["ratio_window_over_one_wave"] = {"answers_per_s": w["answers_per_s"] / o["answers_per_s"],
                                       "slot_utilisation": w["slot_utilisation"] / o["slot_utilisation"],
                                       "trainer_idle": w["trainer_idle"] / o["trainer_idle"]}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
