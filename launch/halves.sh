# Sourced by the study launchers (reasoning_study.sh, reachable_targets.sh), which run two
# processes of one study command side by side, one per core.
#
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
