#!/usr/bin/env bash
# The study on the mixed task (configs/mix.py; issue 41, point 5; docs/mix_study.md): first the
# settings search on seed 100, each method over its own axis x lr 3e-5, 1e-4, 3e-4, 1e-3
# (search.MIX_GRIDS: OAPL with tied betas over beta1 = beta2, GRPO+IS over its PPO clip, the
# asynchronous GRPO+TIS over its truncation cap; 12 points each): every point at L = 100, then each
# method's 6 best there at L = 50 (3 x 18 = 54 runs of 1000 steps); then the three methods with
# their chosen settings at L = 1, 10, 50, 100, 200, seeds 0-2 (45 runs), seed by seed; then the
# edge check (--beyond: GRPO+IS's choice, on its grid's largest lr, at lr 3e-3 on the search's
# seed and lags; 2 runs; its prediction is in docs/mix_study.md's notes); then the
# finished runs' small results are copied into docs/mix_study/results (to commit) and the report
# is written (docs/mix_study.md).
# Cost: 101 runs (54 search, 45 study, 2 edge check) of 12-18 core-minutes each plus a ~14-minute
# warm-up per seed: measured about 30 core-hours, 15 hours on a 2-core CPU (docs/mix_study.md,
# "Measured cost"): run it in resumable pieces (--budget-minutes), or on more cores.
#
# Two processes share the runs (launch/study_halves.sh); resumable: finished runs (under
# OUT_DIR or committed) are skipped, and Ctrl-C / SIGTERM stops both with a checkpoint of the
# runs in progress; run the same command again to go on.
#
# Each half runs (with its own --report; --dry-run prints both):
#   python -m oapl_jax.studies.lag_study --study=mix --methods oapl_tied grpo_tis grpo_tis_async \
#       --lags 1 10 50 100 200 --search --beyond grpo_tis:lr=0.003 --out=/tmp/oapl_mix_study \
#       --results=docs/mix_study/results --seeds 0 1 2
# Usage: bash launch/mix_study.sh [--dry-run] [OUT_DIR] [EXTRA LAG_STUDY FLAGS...]
#   --dry-run  prints the commands instead of running them
#   e.g. bash launch/mix_study.sh /tmp/oapl_mix_study --budget-minutes=120
set -euo pipefail
out=/tmp/oapl_mix_study results=docs/mix_study/results  # the default runs' folder; the committed small results
flags=(--study=mix --methods oapl_tied grpo_tis grpo_tis_async --lags 1 10 50 100 200 --search
       --beyond grpo_tis:lr=0.003)
seeds=(0 1 2) report=docs/mix_study.md name=mix_study.sh
source "$(dirname "$0")/study_halves.sh"
