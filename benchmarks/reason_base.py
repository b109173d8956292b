"""Calibrates the base of configs/reason.py (or mix.py): warm-up, then pass@k (k <= 256), maj@k,
diversity; for configs/mix.py pass@1 per operation too.

    python benchmarks/reason_base.py                                  # the config's base
    python benchmarks/reason_base.py --set warmup.digit_noise=0.6 --set warmup.steps=2000 \
        --samples 256 --problems 64 --cache /tmp/reason_bases

Prints the warm-up's time and loss and the held-out figures of the base (the same evaluation a
run does before training), so the noise / steps giving pass@1 ~0.05-0.3 with pass@256 < 1 can
be chosen. `--cache` keeps each base (warmup.cache_dir), so a second call only evaluates.
"""

from __future__ import annotations

import argparse
import ast
import json
import tempfile
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="reason.py")
  p.add_argument("--set", action="append", default=[], help="setting=value (a Python literal)")
  p.add_argument("--samples", type=int, default=None, help="eval.samples_per_problem")
  p.add_argument("--problems", type=int, default=None, help="task.num_eval")
  p.add_argument("--cache", default=None, help="warmup.cache_dir")
  args = p.parse_args(argv)

  from oapl_jax import config as config_lib
  from oapl_jax import warmup
  from oapl_jax.rl.loop import Run
  from oapl_jax.placement import seq_len
  from oapl_jax.studies.definitions import set_dotted

  c = config_lib.repo_config(args.config)
  for item in args.set:
    key, _, value = item.partition("=")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    set_dotted(c, key, value)
  if args.samples:
    c.eval.samples_per_problem = args.samples
  if args.problems:
    c.task.num_eval = args.problems
  c.warmup.cache_dir = args.cache
  c.log.progress = False
  with tempfile.TemporaryDirectory() as workdir:
    r = Run(c, workdir)
    t0 = time.perf_counter()
    params, info = warmup.base_model(c, r.graphdef, r.params, r.sampler.task, r.sampler.tokenizer,
                                     seq_len=seq_len(c))
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = r.evaluate(params, "base")
    eval_s = time.perf_counter() - t0
    problems = r.sampler.task.eval_problems()
    r.close()
  correct = out.pop("correct_per_problem", None)
  if hasattr(r.sampler.task, "operations"):  # chain_mix: pass@1 of each operation's problems
    from oapl_jax.tasks.chain_mix import parse  # noqa: PLC0415
    n = c.eval.samples_per_problem
    out["pass@1_per_operation"] = {op: sum(k for p, k in zip(problems, correct) if parse(p)[1] == op)
                                   / (n * sum(parse(p)[1] == op for p in problems))
                                   for op in r.sampler.task.operations}
  out = {k: v for k, v in out.items() if not isinstance(v, list)}
  print(json.dumps({"settings": args.set, "warmup": info, "warmup_seconds": warm_s,
                    "eval_seconds": eval_s, **out}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
