#!/usr/bin/env bash
# N local processes of one multi-host run, on 127.0.0.1: the code path of a pod, on one machine.
#
#   bash launch/local_multihost.sh N CONFIG [overrides...]
#   bash launch/local_multihost.sh 2 configs/tiny.py --workdir=/tmp/oapl_mh
#   DEVICES=4 bash launch/local_multihost.sh 2 configs/tiny.py:smoke --workdir=/tmp/oapl_mh8
#
# Each process runs `python -m oapl_jax.main --config=$CONFIG [overrides...]` with
# --config.distributed.{coordinator_address,num_processes,process_id} set (a free port on
# 127.0.0.1) and DEVICES CPU devices of its own (default 1; JAX_NUM_CPU_DEVICES), and one engine
# replica each: --config.sampling.engines=N (the replicas over all processes; an override of
# sampling.engines given here wins, and must be a multiple of N). Process 0's
# output is shown here and kept, with every other process's, in LOG_DIR/process_<i>.log
# (default: <workdir>/logs; ./logs for a gs:// workdir). Waits for all; if one fails, the others are stopped and the exit
# status is the failed one's. SIGTERM / SIGINT are passed to every process (they stop at the
# same step with a checkpoint; run the same command again to resume).
set -uo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: bash launch/local_multihost.sh N CONFIG [overrides...]" >&2
  exit 2
fi
N=$1
CONFIG=$2
shift 2
if ! [[ $N =~ ^[1-9][0-9]*$ ]]; then
  echo "error: N=$N: the number of processes must be a positive integer" >&2
  exit 2
fi
DEVICES=${DEVICES:-1}
PYTHON=${PYTHON:-python}

WORKDIR=""
for arg in "$@"; do
  case $arg in --workdir=*) WORKDIR=${arg#--workdir=} ;; esac
done
case $WORKDIR in
  *://*) LOG_DIR=${LOG_DIR:-logs} ;;  # a bucket workdir: the logs stay on this disk
  *) LOG_DIR=${LOG_DIR:-${WORKDIR:-.}/logs} ;;
esac
mkdir -p "$LOG_DIR"

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ADDRESS=127.0.0.1:$PORT
echo "local_multihost: $N processes x $DEVICES CPU devices, coordinator $ADDRESS, logs in $LOG_DIR"

pids=()
for ((i = 0; i < N; i++)); do
  cmd=(env JAX_NUM_CPU_DEVICES="$DEVICES" JAX_PLATFORMS=cpu "$PYTHON" -u -m oapl_jax.main
       --config="$CONFIG" --config.sampling.engines="$N" "$@"
       --config.distributed.coordinator_address="$ADDRESS"
       --config.distributed.num_processes="$N" --config.distributed.process_id="$i")
  if ((i == 0)); then
    "${cmd[@]}" > >(tee "$LOG_DIR/process_$i.log") 2>&1 &
  else
    "${cmd[@]}" > "$LOG_DIR/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

forward() {
  for pid in "${pids[@]}"; do kill -s "$1" "$pid" 2>/dev/null; done
}
stopping=0  # a signal was passed on: every process stops at the same step; wait for all
trap 'stopping=1; forward TERM' TERM
trap 'stopping=1; forward INT' INT

status=0
remaining=$N
while ((remaining > 0)); do
  done_pid=""
  wait -n -p done_pid "${pids[@]}" 2>/dev/null
  rc=$?
  if [[ -z ${done_pid:-} ]]; then
    if ((rc == 127)); then  # no process left to wait for
      break
    fi
    continue  # interrupted by a trapped signal: keep waiting
  fi
  remaining=$((remaining - 1))
  if ((rc != 0 && status == 0)); then
    status=$rc
    if ((stopping)); then
      continue
    fi
    for ((i = 0; i < N; i++)); do
      if [[ ${pids[$i]} == "$done_pid" ]]; then
        echo "local_multihost: process $i exited with status $rc (log: $LOG_DIR/process_$i.log); stopping the others" >&2
        tail -n 3 "$LOG_DIR/process_$i.log" >&2
      fi
    done
    forward TERM
    sleep 5
    forward KILL
  fi
done
exit $status
