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
# Two processes, one core each (a second core buys little inside one XLA process on CPU), both
# running the same command: each skips the runs the other is making, so they share the search
# and then the study's runs, in order. A process that runs out of runs while the other still
# makes its last ones (the last runs at L = 100, whose scores pick the L = 50 runs; the search's
# last runs; the study's) exits with code 4 and is started again a minute later, until they are
# done. Resumable: finished runs (under OUT_DIR or committed) are skipped, and Ctrl-C / SIGTERM
# stops both with a checkpoint of the runs in progress; run the same command again to go on.
#
# Usage: bash launch/reasoning_study.sh [--dry-run] [OUT_DIR] [EXTRA LAG_STUDY FLAGS...]
#   --dry-run  prints the commands instead of running them
#   e.g. bash launch/reasoning_study.sh /tmp/oapl_reason_study --budget-minutes=120
set -euo pipefail
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-/tmp/oapl_reason_study}
shift || true
results=docs/reasoning_study/results  # committed small results (from the repository root)
study=(python -m oapl_jax.studies.lag_study --study=reason --out="$out" --results="$results" \
  --methods oapl grpo_tis --lags 1 10 50 100 --search)
# pin each half to a core where there are two or more
pin_a=() pin_b=()
if command -v taskset > /dev/null && [[ "$(nproc)" -ge 2 ]]; then
  pin_a=(taskset -c 0) pin_b=(taskset -c 1)
fi
# both halves take every seed, in order (the runs of a seed before the next seed's); each writes a
# report in OUT; the last steps copy the results and write the study's
a=("${pin_a[@]}" "${study[@]}" --report="$out/half_a.md" --seeds 0 1 2 3 4 "$@")
b=("${pin_b[@]}" "${study[@]}" --report="$out/half_b.md" --seeds 0 1 2 3 4 "$@")
full=("${study[@]}" --report=docs/reasoning_study.md --seeds 0 1 2 3 4 "$@")
if [[ -n "$dry" ]]; then
  echo "# each again while it exits with 4 (the other process is making the runs left):"
  echo "${a[*]} &"
  echo "${b[*]} &"
  echo "${full[*]} --save-results"
  echo "${full[*]} --report-only"
  exit 0
fi
source "$(dirname "$0")/halves.sh"  # half CMD...: CMD again while it exits with 4
pids=()
trap 'kill -TERM "${pids[@]}" 2> /dev/null || true; wait; exit 143' TERM INT
half "${a[@]}" & pids+=($!)
sleep 30  # the first half takes the first search run; the second starts on the next
half "${b[@]}" & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
"${full[@]}" --save-results  # whatever finished, also after a stop
if [[ $status -ne 0 ]]; then
  echo "a half of the study exited with $status; run the same command again to go on" >&2
  exit $status
fi
# the report quotes the command that made it: this one, not a half's
echo "bash launch/reasoning_study.sh $out${*:+ $*}" > "$out/study_command.txt"
"${full[@]}" --report-only
