#!/usr/bin/env bash
# The registered experiment of docs/reachable_targets.md (issue 41; oapl_jax/studies/reachable.py):
# OAPL with reachable targets (tied / per-token beta2) x lr 1e-4, 3e-4, 3e-5 x L = 100, 50 x
# seeds 0-2, 36 runs of 1000 steps, seed by seed. Two processes, one core each, running the same
# command: each skips the runs the other is making (exit 4 when only those are left: started
# again a minute later). Resumable: finished runs (under OUT or committed) are skipped, and
# SIGTERM / SIGINT stops both with a checkpoint. At the end the finished runs' small results are
# copied into docs/reachable_targets/results (to commit) and the report is rewritten.
#
# Usage: bash launch/reachable_targets.sh [--dry-run] [OUT_DIR] [EXTRA FLAGS...]
#   e.g. bash launch/reachable_targets.sh /tmp/oapl_reach --seeds 0
set -euo pipefail
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-/tmp/oapl_reach}
shift || true
cmd=(python -m oapl_jax.studies.reachable --out="$out" --results=docs/reachable_targets/results "$@")
source "$(dirname "$0")/halves.sh"  # pin_a / pin_b, half, two_halves
if [[ -n "$dry" ]]; then
  echo "${pin_a[*]} ${cmd[*]} --report=$out/half_a.md &"
  echo "${pin_b[*]} ${cmd[*]} --report=$out/half_b.md &"
  echo "${cmd[*]} --save-results && ${cmd[*]} --report-only"
  exit 0
fi
# each half writes its report into OUT (from a copy of the registered one, which holds the prediction)
mkdir -p "$out"
cp docs/reachable_targets.md "$out/half_a.md"; cp docs/reachable_targets.md "$out/half_b.md"
run_half() { local pin; pin_of "$1"; half "${pin[@]}" "${cmd[@]}" --report="$out/half_$1.md"; }
status=0
two_halves run_half || status=$?
"${cmd[@]}" --save-results
"${cmd[@]}" --report-only
exit $status
