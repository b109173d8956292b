# Sourced by the study launchers (study_halves.sh, reachable_targets.sh, mix_step2.sh), which run
# two processes of one study command side by side, one per core ("halves": each skips the runs
# the other is making).
#
# pin_a / pin_b: the prefix that keeps half a on core 0 and half b on core 1 (`taskset -c N`;
# empty without taskset or with one core). A second core buys little inside one XLA process on CPU.
pin_a=() pin_b=()
if command -v taskset > /dev/null && [[ "$(nproc)" -ge 2 ]]; then
  pin_a=(taskset -c 0) pin_b=(taskset -c 1)
fi
# pin_of HALF: sets `pin` to that half's prefix (pin_a for a, pin_b for b)
pin_of() { if [[ $1 == b ]]; then pin=("${pin_b[@]}"); else pin=("${pin_a[@]}"); fi; }

# half CMD...: runs CMD, started again a minute later while it exits with 4 (runs left that the
# other half is making); a SIGTERM / SIGINT is passed on to its python process, which
# checkpoints and stops.
half() {
  local rc child=""
  trap '[[ -n "$child" ]] && kill -TERM "$child" 2> /dev/null; wait; exit 143' TERM INT
  while true; do
    "$@" & child=$!
    wait "$child" && return 0 || rc=$?
    [[ $rc -eq 4 ]] || return $rc
    sleep 60 & wait $!
  done
}

# two_halves FN: runs `FN a` and, HALVES_GAP_S seconds later (30: the first takes the first run),
# `FN b` side by side and waits for both; a SIGTERM / SIGINT stops both (each passes it on to its process) and exits
# 143. Returns the last non-zero exit status of the two (0 when both finished).
two_halves() {
  local p status=0
  _halves_pids=()
  trap 'kill -TERM "${_halves_pids[@]}" 2> /dev/null || true; wait; exit 143' TERM INT
  "$1" a & _halves_pids+=($!)
  sleep "${HALVES_GAP_S:-30}" & wait $!
  "$1" b & _halves_pids+=($!)
  for p in "${_halves_pids[@]}"; do wait "$p" || status=$?; done
  trap - TERM INT
  return $status
}
