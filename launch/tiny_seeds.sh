#!/usr/bin/env bash
# The acceptance runs of the embedded default: configs/tiny.py for three seeds, then a table
# of pass@1 before/after and train seconds. Usage: bash launch/tiny_seeds.sh [OUT_DIR] [SEEDS...]
set -euo pipefail
out=${1:-/tmp/oapl_tiny_seeds}
shift || true
seeds=${*:-0 1 2}
for s in $seeds; do
  python -m oapl_jax.main --config=configs/tiny.py --workdir="$out/seed$s" --config.seed="$s"
done
python - "$out" $seeds <<'PY'
import json, sys
out, seeds = sys.argv[1], sys.argv[2:]
print("seed  pass@1 before  pass@1 after  pass@16 before  pass@16 after  train_seconds")
for s in seeds:
    d = json.load(open(f"{out}/seed{s}/summary.json"))
    b, a = d["eval_before"], d["eval_after"]
    print(f"{s:>4}  {b['pass@1']:13.3f}  {a['pass@1']:12.3f}  {b['pass@16']:14.3f}  {a['pass@16']:13.3f}  {d['train_seconds']:13.1f}")
PY
