# Sourced by the lag-study launchers (reasoning_study.sh, mix_study.sh) after they set:
#   name     the launcher (launch/NAME), quoted in the report as the command that made it
#   out      the default runs' folder (resumable); the launcher's first argument replaces it
#   results  the committed small results' folder
#   flags    the lag_study flags but --out, --results, --report and --seeds (an array)
#   seeds    the seeds, in order (an array): both halves take every seed, a seed's runs first
#   report   the study's report (docs/...md)
# and pass on the launcher's arguments ("$@": [--dry-run] [OUT_DIR] [EXTRA LAG_STUDY FLAGS...];
# --dry-run prints the commands instead of running them). Two processes of the same command, one core each
# (a second core buys little inside one XLA process on CPU): each skips the runs the other is
# making, so they share the search and then the study's runs, in order; each writes a report in
# OUT; at the end the finished runs' small results are copied into the results folder and the
# study's report is written.
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-$out}
shift || true
study=(python -m oapl_jax.studies.lag_study "${flags[@]}" --out="$out" --results="$results")
source "$(dirname "${BASH_SOURCE[0]}")/halves.sh"  # pin_a / pin_b, half, two_halves
a=("${pin_a[@]}" "${study[@]}" --report="$out/half_a.md" --seeds "${seeds[@]}" "$@")
b=("${pin_b[@]}" "${study[@]}" --report="$out/half_b.md" --seeds "${seeds[@]}" "$@")
full=("${study[@]}" --report="$report" --seeds "${seeds[@]}" "$@")
if [[ -n "$dry" ]]; then
  echo "# each again while it exits with 4 (the other process is making the runs left):"
  echo "${a[*]} &"
  echo "${b[*]} &"
  echo "${full[*]} --save-results"
  echo "${full[*]} --report-only"
  exit 0
fi
run_half() { if [[ $1 == a ]]; then half "${a[@]}"; else half "${b[@]}"; fi; }
status=0
two_halves run_half || status=$?
"${full[@]}" --save-results  # whatever finished, also after a stop
if [[ $status -ne 0 ]]; then
  echo "a half of the study exited with $status; run the same command again to go on" >&2
  exit $status
fi
# the report quotes the command that made it: the launcher's, not a half's
echo "bash launch/$name $out${*:+ $*}" > "$out/study_command.txt"
"${full[@]}" --report-only
