#!/usr/bin/env bash
# The reasoning study of docs/reasoning_study.md: OAPL and GRPO+IS (token TIS) at
# L = 1, 10, 50, 100, seeds 0-4, on configs/reason.py, each method's lr picked first by a sweep
# on seed 100; then the report. About 3 hours of a 2-core CPU machine.
#
# Two processes, one core each (a second core buys little inside one XLA process on CPU):
# the first runs the sweep and seeds 0 1 2, the second starts once the sweep has chosen the
# learning rates and runs seeds 3 4. Resumable: finished runs are skipped, and Ctrl-C / SIGTERM
# stops both with a checkpoint of the runs in progress; run the same command again to go on.
#
# Usage: bash launch/reasoning_study.sh [--dry-run] [OUT_DIR] [EXTRA LAG_STUDY FLAGS...]
#   --dry-run  prints the commands instead of running them
#   e.g. bash launch/reasoning_study.sh /tmp/oapl_reason_study
set -euo pipefail
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-/tmp/oapl_reason_study}
shift || true
study=(python -m oapl_jax.studies.lag_study --study=reason --out="$out" \
  --methods oapl grpo_tis --lags 1 10 50 100 --sweep-lrs 1e-4 3e-4 1e-3)
# pin each half to a core where there are two or more
pin_a=() pin_b=()
if command -v taskset > /dev/null && [[ "$(nproc)" -ge 2 ]]; then
  pin_a=(taskset -c 0) pin_b=(taskset -c 1)
fi
# each half writes a report of its own runs in OUT; the last step writes the study's
a=("${pin_a[@]}" "${study[@]}" --report="$out/half_a.md" --seeds 0 1 2 "$@")
b=("${pin_b[@]}" "${study[@]}" --report="$out/half_b.md" --seeds 3 4 "$@")
full=("${study[@]}" --report=docs/reasoning_study.md --seeds 0 1 2 3 4 "$@")
if [[ -n "$dry" ]]; then
  echo "${a[*]} &"
  echo "# once $out/sweep/chosen.json exists:"
  echo "${b[*]}"
  echo "${full[*]} --report-only"
  exit 0
fi
pids=()
trap 'kill -TERM "${pids[@]}" 2> /dev/null || true; wait; exit 143' TERM INT
"${a[@]}" & pids+=($!)
while [[ ! -f "$out/sweep/chosen.json" ]] && kill -0 "${pids[0]}" 2> /dev/null; do sleep 10; done
"${b[@]}" & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
if [[ $status -ne 0 ]]; then
  echo "a half of the study exited with $status; run the same command again to go on" >&2
  exit $status
fi
# the report quotes the command that made it: this one, not a half's
echo "bash launch/reasoning_study.sh $out${*:+ $*}" > "$out/study_command.txt"
"${full[@]}" --report-only
