#!/usr/bin/env bash
# The full lag study of docs/lag_study.md: OAPL (tiny betas), OAPL (paper betas) and GRPO+IS
# (token TIS) at L = 1, 10, 50, 100, seeds 0-2, on configs/tiny.py; then the report.
# About an hour on 2 CPU cores; resumable (finished runs are skipped).
# Usage: bash launch/lag_study.sh [OUT_DIR]
set -euo pipefail
out=${1:-/tmp/oapl_lag_study}
python -m oapl_jax.studies.lag_study --out="$out" --report=docs/lag_study.md \
  --lags 1 10 50 100 --seeds 0 1 2
