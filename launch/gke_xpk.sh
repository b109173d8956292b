#!/usr/bin/env bash
# Run oapl_jax on a TPU slice of a GKE cluster through xpk (`pip install xpk`; a cluster made
# with `xpk cluster create --tpu-type=...`): one workload whose pods, one per TPU VM host, each
# install this checkout and run the same command. JAX finds the other hosts from the variables
# GKE sets (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID); the workdir is the bucket itself.
#
#   bash launch/gke_xpk.sh --cluster=my-cluster --workload=oapl-math --accelerator=v5p-64 \
#       --bucket=gs://my-bucket --run=runs/math_l50 --dry-run \
#       -- --config.model.path=/gcs/ckpt/Qwen3-4B-Thinking-2507
#
# What every pod runs (the arguments after `--` are appended):
#
#   python -m oapl_jax.main --config=configs/math.py --workdir=gs://my-bucket/runs/math_l50 \
#       --config.checkpoint.lock_wait_s=420
#
# A preempted or failed pod makes JobSet restart the whole workload (up to --max-restarts
# times); the restarted run resumes from its checkpoints in the bucket. It starts before the
# old run's lock lease (checkpoint.lock_lease_s, 300 s) has run out, so it waits for it
# (checkpoint.lock_wait_s, lease + 120 s) instead of refusing. Weights and data: a path on
# the pods (a GCS FUSE CSI volume of your cluster, or baked into --base-image).
# The code reward's sandbox (bubblewrap) needs unprivileged user namespaces in the pod: not
# tested on GKE. Not yet tested on a real cluster (none is reachable from here): the dry run is.
#
# Sampler workloads (remote mode, docs/remote.md): --samplers=N also creates N workloads
# (WORKLOAD-s1 .. -sN) on --sampler-tpu-type slices of the cluster, each pod running
# `python -m oapl_jax.sample` with the same config, workdir and overrides plus the
# --sampler-set ones; the trainer gets --config.rl.mode=remote --config.rl.window_rollouts=1.
# --delete deletes them too.
#
# Options (defaults in brackets):
#   --cluster NAME          GKE cluster made by xpk (required unless --dry-run)
#   --workload NAME         workload name [oapl]
#   --accelerator TYPE      TPU type of the cluster's slices, e.g. v5p-64 [v5p-64]
#   --zone ZONE, --project PROJECT   [xpk's / gcloud's default]
#   --bucket gs://BUCKET    bucket holding the workdir (required unless --dry-run)
#   --run PATH              the workdir inside the bucket [runs/oapl]
#   --samplers N            sampler workloads beside the trainer's (remote mode) [0]
#   --sampler-tpu-type TYPE their TPU type [v6e-8]
#   --sampler-set OVERRIDE  a setting of the sampler jobs only (repeatable)
#   --config SPEC           config file and arg [configs/math.py]
#   --base-image IMAGE      image the pods start from (Python >= 3.11) [python:3.12-slim]
#   --max-restarts N        JobSet restarts after a failure or preemption [10]
#   --delete                delete the workload; --dry-run prints the command instead of running it
set -euo pipefail

cluster="" workload=oapl accelerator=v5p-64 zone="" project="" bucket="" run=runs/oapl
config=configs/math.py base_image=python:3.12-slim max_restarts=10 dry_run=0 delete=0 lease_s=300
samplers=0 sampler_type=v6e-8
overrides=() sampler_overrides=()
while (($#)); do
  case "$1" in
    --cluster=*) cluster=${1#*=} ;; --workload=*) workload=${1#*=} ;;
    --accelerator=*) accelerator=${1#*=} ;; --zone=*) zone=${1#*=} ;;
    --project=*) project=${1#*=} ;; --bucket=*) bucket=${1#*=} ;; --run=*) run=${1#*=} ;;
    --config=*) config=${1#*=} ;; --base-image=*) base_image=${1#*=} ;;
    --max-restarts=*) max_restarts=${1#*=} ;; --dry-run) dry_run=1 ;; --delete) delete=1 ;;
    --samplers=*) samplers=${1#*=} ;; --sampler-tpu-type=*) sampler_type=${1#*=} ;;
    --sampler-set=*) sampler_overrides+=("${1#*=}") ;;
    --) shift; overrides=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gke_xpk.sh: unknown option $1 (--help lists them; setting overrides go after --)" >&2; exit 2 ;;
  esac
  shift
done
for arg in "${overrides[@]}"; do  # the lease the lock wait is sized to
  case "$arg" in --config.checkpoint.lock_lease_s=*) lease_s=${arg#*=} ;; esac
done
if [[ -z "$cluster" || -z "$bucket" ]]; then
  ((dry_run)) || { echo "gke_xpk.sh: --cluster=NAME and --bucket=gs://BUCKET are required" >&2; exit 2; }
  cluster=${cluster:-CLUSTER} bucket=${bucket:-gs://BUCKET}
fi
[[ "$bucket" == gs://* ]] || { echo "gke_xpk.sh: --bucket=$bucket: give a gs:// URL" >&2; exit 2; }
[[ -f "${config%%:*}" ]] || { echo "gke_xpk.sh: --config=$config: no such file" >&2; exit 2; }
[[ "$lease_s" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "gke_xpk.sh: lock_lease_s=$lease_s: give seconds" >&2; exit 2; }
[[ "$samplers" =~ ^[0-9]+$ ]] || { echo "gke_xpk.sh: --samplers=$samplers: give a count" >&2; exit 2; }
((samplers == 0)) || overrides=(--config.rl.mode=remote --config.rl.window_rollouts=1 "${overrides[@]}")

where=(--cluster="$cluster")
[[ -n "$zone" ]] && where+=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
jax_version=$(python3 -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)
wait_s=$(python3 -c "print(int(float('$lease_s')) + 120)")

say() { printf '+ %s\n' "$*"; }
do_() {  # print the command; run it unless --dry-run
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  say "${out[*]}"
  ((dry_run)) || "$@"
}

if ((delete)); then
  do_ xpk workload delete --workload="$workload" "${where[@]}"
  for ((i = 1; i <= samplers; i++)); do do_ xpk workload delete --workload="$workload-s$i" "${where[@]}"; done
  exit 0
fi

run_cmd=(python -m oapl_jax.main --config="$config" --workdir="$bucket/$run"
         --config.checkpoint.lock_wait_s="$wait_s" "${overrides[@]}")
setup="(command -v bwrap >/dev/null || (apt-get update -q && apt-get install -y -q bubblewrap)) && pip install -q -e '.[tpu]' 'jax[tpu]==$jax_version'"
do_ xpk workload create --workload="$workload" "${where[@]}" --tpu-type="$accelerator" \
    --num-slices=1 --base-docker-image="$base_image" --script-dir=. \
    --max-restarts="$max_restarts" --command="$setup && $(printf '%q ' "${run_cmd[@]}")"
sampler_cmd=(python -m oapl_jax.sample --config="$config" --workdir="$bucket/$run" "${overrides[@]}" "${sampler_overrides[@]}")
for ((i = 1; i <= samplers; i++)); do  # one sampler job per pod (per host)
  do_ xpk workload create --workload="$workload-s$i" "${where[@]}" --tpu-type="$sampler_type" \
      --num-slices=1 --base-docker-image="$base_image" --script-dir=. \
      --max-restarts="$max_restarts" --command="$setup && $(printf '%q ' "${sampler_cmd[@]}")"
done
say "# follow it: xpk workload list ${where[*]} --filter-by-job=$workload; kubectl logs -f on its pods"
say "# its metrics: gcloud storage cat $bucket/$run/metrics.jsonl"
