#!/usr/bin/env bash
# The reasoning study of docs/reasoning_study.md (issue 30): first the joint settings search on
# seed 100 (OAPL over beta1 x beta2 x lr, GRPO+IS over its PPO clip x lr, 18 settings each):
# every setting at L = 100, then each method's 6 best there (search.SCREEN_TOP_K, the same for
# both) at L = 50, 48 runs of 1000 steps (not 72: the other 12 settings per method do not run at
# L = 50); then OAPL and GRPO+IS with the chosen settings at L = 1, 10, 50, 100, seeds 0-4, 1000
# steps each (10 refreshes at L = 100; 128,000 answers per run), seed by seed: every run of
# seeds 0, 1, 2 starts before any of seeds 3 and 4 (when the first seed-3 run starts, at most one
# seed-2 run is still going), so 3 seeds are done first; then the finished runs' small results
# are copied into docs/reasoning_study/results (committed: a later checkout counts them as
# finished) and the report is written.
# Estimated: the search 48 x ~19 min (the median of 25 finished search runs) = ~16 core-hours;
# the study's 40 runs ~17-20 core-hours (not measured yet); over two cores, in resumable pieces.
#
# Two processes share the runs (launch/study_halves.sh): a process that runs out of runs while
# the other still makes its last ones (the last runs at L = 100, whose scores pick the L = 50
# runs; the search's last runs; the study's) exits with code 4 and is started again a minute
# later, until they are done. Resumable: finished runs (under OUT_DIR or committed) are skipped,
# and Ctrl-C / SIGTERM stops both with a checkpoint of the runs in progress; run the same command
# again to go on.
#
# Each half runs (with its own --report; --dry-run prints both):
#   python -m oapl_jax.studies.lag_study --study=reason --methods oapl grpo_tis --lags 1 10 50 100 --search \
#       --out=/tmp/oapl_reason_study --results=docs/reasoning_study/results --seeds 0 1 2 3 4
# Usage: bash launch/reasoning_study.sh [--dry-run] [OUT_DIR] [EXTRA LAG_STUDY FLAGS...]
#   --dry-run  prints the commands instead of running them
#   e.g. bash launch/reasoning_study.sh /tmp/oapl_reason_study --budget-minutes=120
set -euo pipefail
out=/tmp/oapl_reason_study results=docs/reasoning_study/results  # the default runs' folder; the committed small results
flags=(--study=reason --methods oapl grpo_tis --lags 1 10 50 100 --search)
seeds=(0 1 2 3 4) report=docs/reasoning_study.md name=reasoning_study.sh
source "$(dirname "$0")/study_halves.sh"
