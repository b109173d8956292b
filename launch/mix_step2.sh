#!/usr/bin/env bash
# Step 2 of the mixed-task study (issue 62) on the committed bases (docs/mix_study.md, "Step 2 on
# the committed bases"): every run starts from docs/mix_study/paired_check/base_models
# (`--bases`: read, never built, on any machine) and the references are rerun from the same
# bases. The runs at L = 200 are committed already (docs/mix_study/paired_check/runs: skipped);
# this makes the rest, 39 runs of 1000 steps (42 with S2-7), in stages of the registered order:
# S2-5 / S2-6 at L = 100 (GRPO+IS at lr 3e-4, the asynchronous GRPO+TIS, GRPO+IS at the search's
# lr 1e-3), S2-1 at L = 100 (OAPL beta1 = 1, its control, tied OAPL), L = 50 (all but GRPO+IS at
# lr 1e-3), L = 10 (GRPO+IS at lr 3e-4, the asynchronous GRPO+TIS); then S2-7, registered after
# S2-1's reading: OAPL beta1 = 1, beta2 = 0.1 at lr 3e-4, L = 100; seeds 0-2 in each stage. The
# searched methods take the committed search's choices (--search: every search run is found done,
# none rerun).
#
# Two processes, one core each, go through the same stages: each skips the runs the other is
# making and goes on to the next stage; both go round again (a minute later) until every stage is
# done. Resumable: finished runs (under OUT or committed) are skipped, an unfinished one resumes
# from its checkpoints, and SIGTERM / SIGINT stops both with a checkpoint. At the end the finished
# runs' small results are copied into docs/mix_study/paired_check (to commit) and the step's report
# is written to OUT/step2.md (its reading goes into docs/mix_study.md by hand).
# Cost: about 20-30 minutes per run with two side by side on a 2-core CPU (about 10 hours in all).
#
# Usage: bash launch/mix_step2.sh [--dry-run] [OUT_DIR]
set -uo pipefail
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-/tmp/oapl_mix_step2}
results=docs/mix_study/paired_check
study=(python -m oapl_jax.studies.lag_study --study=mix --out="$out" --results="$results"
       --bases="$results/base_models" --seeds 0 1 2)
stages=(
  "--lags 100 --methods grpo_tis_lr3e-4"
  "--lags 100 --methods grpo_tis_async grpo_tis --search"
  "--lags 100 --methods oapl_b1 oapl_b1_len"
  "--lags 100 --methods oapl_tied --search"
  "--lags 50 --methods grpo_tis_lr3e-4 oapl_b1 oapl_b1_len"
  "--lags 50 --methods grpo_tis_async oapl_tied --search"
  "--lags 10 --methods grpo_tis_lr3e-4"
  "--lags 10 --methods grpo_tis_async --search"
  "--lags 100 --methods oapl_b1_lr3e-4"
)
methods=(oapl_tied grpo_tis_async oapl_b1 oapl_b1_len grpo_tis grpo_tis_lr3e-4 oapl_b1_lr3e-4)
report=("${study[@]}" --methods "${methods[@]}" --lags 200 100 50 10
        --method-lags oapl_tied=200,100,50 oapl_b1=200,100,50 oapl_b1_len=200,100,50 grpo_tis=200,100
                      oapl_b1_lr3e-4=100
        --report="$out/step2.md" --launcher=launch/mix_step2.sh)
if [[ -n "$dry" ]]; then
  for s in "${stages[@]}"; do echo "${study[*]} $s --report=$out/half_<a|b>.md"; done
  echo "${report[*]} --save-results"
  echo "${report[*]} --report-only"
  exit 0
fi

source "$(dirname "$0")/halves.sh"  # pin_a / pin_b, two_halves
# stages_of HALF (a or b): every stage in order on the half's core, round again while some runs
# were the other half's
stages_of() {
  local rc left child="" pin
  pin_of "$1"
  trap '[[ -n "$child" ]] && kill -TERM "$child" 2> /dev/null; wait; exit 143' TERM INT
  while true; do
    left=0
    for s in "${stages[@]}"; do
      read -ra args <<< "$s"
      "${pin[@]}" "${study[@]}" "${args[@]}" --report="$out/half_$1.md" & child=$!
      wait "$child"; rc=$?
      case $rc in 0) ;; 4) left=1 ;; *) return $rc ;; esac
    done
    [[ $left -eq 0 ]] && return 0
    sleep 60 & wait $!
  done
}
mkdir -p "$out"
status=0
two_halves stages_of || status=$?
"${report[@]}" --save-results  # whatever finished, also after a stop
if [[ $status -ne 0 ]]; then
  echo "a half exited with $status; run the same command again to go on" >&2
  exit $status
fi
echo "bash launch/mix_step2.sh $out" > "$out/study_command.txt"
"${report[@]}" --report-only
