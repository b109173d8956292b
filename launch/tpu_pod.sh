#!/usr/bin/env bash
# Run oapl_jax on a Cloud TPU VM pod slice: create the slice, copy this checkout to every
# worker, install it, mount the bucket read-only for the weights and data, and start the same
# command on all workers at once (jax.distributed finds the other workers by itself on TPU VMs).
#
#   bash launch/tpu_pod.sh --name=oapl-math --zone=us-east5-a --accelerator=v5p-64 \
#       --bucket=gs://my-bucket --run=runs/math_l50 --dry-run \
#       -- --config.model.path=/mnt/bucket/ckpt/Qwen3-4B-Thinking-2507 \
#          --config.task.train_path=/mnt/bucket/data/deepscaler.jsonl \
#          --config.task.eval_path=/mnt/bucket/data/aime2025.jsonl
#
# What each worker runs (the arguments after `--` are appended):
#
#   python -m oapl_jax.main --config=configs/math.py --workdir=gs://my-bucket/runs/math_l50 \
#       --config.model.path=/mnt/bucket/ckpt/Qwen3-4B-Thinking-2507 \
#       --config.task.train_path=/mnt/bucket/data/deepscaler.jsonl \
#       --config.task.eval_path=/mnt/bucket/data/aime2025.jsonl
#
# The workdir is the bucket itself (gs://BUCKET/RUN): orbax writes the checkpoints there, and
# the small files (run.lock, metrics.jsonl, summary.json) are whole-object writes
# (oapl_jax/storage.py); TensorBoard's events go through tf.io.gfile. The gcsfuse mount is
# read-only, for the weights and data only (gcsfuse cannot rename the directories an orbax
# save finishes with). Checkpoints and metrics outlive the VMs; running the script again on a
# new slice resumes the run (the workdir lock is a lease, taken over once the old slice stops
# renewing it).
#
# Steps (each skipped with --skip-*): create (`gcloud compute tpus tpu-vm create`, or with
# --queued a queued resource, waited for until ACTIVE), copy (a tarball of the git checkout,
# `scp --worker=all`), install (a venv ~/oapl_venv on Python >= 3.11, Ubuntu's python3.11
# package if the image has no such Python; pip install -e '.[tpu]'; bubblewrap for
# the code reward's sandbox; gcsfuse from Google's apt repository), run (`ssh --worker=all`, in
# the background under nohup, log in ~/oapl_run.log). --watch then checks the slice every
# WATCH_SECONDS (600) until the run's summary.json exists, and re-creates, re-installs and
# restarts it (the run resumes) whenever the slice was preempted or is gone.
# --dry-run prints every command instead of running it; --delete deletes the slice.
#
# Sampler slices (remote mode, docs/remote.md): --samplers=N also creates N slices of
# --sampler-accelerator (NAME-s1 .. NAME-sN), installs the same checkout on them and starts
# `python -m oapl_jax.sample` with the same config, workdir and overrides on every worker of
# each (one sampler job per host), plus the --sampler-set overrides (the job's own engines,
# e.g. --sampler-set=--config.sampling.tensor=4); the trainer gets --config.rl.mode=remote
# --config.rl.window_rollouts=1 (before the overrides after --).
# Check a sampler slice's plan first (docs/remote.md): python -m oapl_jax.sample --config=configs/math.py
#   --config.rl.mode=remote --config.rl.window_rollouts=1 --config.mesh.topology=TYPE --dry_run
# --watch re-creates the trainer's slice only; --delete deletes the sampler slices too.
# The trainer of remote mode is one process today: give --accelerator a single-host slice
# (e.g. v5p-8); a multi-host trainer is refused at start (docs/remote.md, "What is not done yet").
# Options (defaults in brackets):
#   --name NAME            TPU VM name [oapl]
#   --zone ZONE            [us-east5-a]
#   --accelerator TYPE     slice type, e.g. v5p-64, v5litepod-64, v4-32 [v5p-64]
#   --version RUNTIME      TPU VM software version [v2-alpha-tpuv5]
#   --project PROJECT      gcloud project [gcloud's default]
#   --spot                 create a Spot slice (preemptible: the run resumes from its checkpoints)
#   --queued               create it as a queued resource (waits for capacity) [off]
#   --watch                re-create and resume the run after a preemption, until it finishes
#   --bucket gs://BUCKET   bucket holding the workdir, weights and data (required unless --dry-run)
#   --mount DIR            where the bucket is mounted read-only on the workers [/mnt/bucket]
#   --run PATH             the workdir inside the bucket [runs/oapl]
#   --config SPEC          config file and arg, e.g. configs/code.py [configs/math.py]
#   --python PYTHON        python (>= 3.11) for the workers' venv [the newest python3.1x there]
#   --samplers N           sampler slices beside the trainer's (remote mode) [0]
#   --sampler-accelerator TYPE   their slice type, e.g. v6e-8, v5litepod-8 [v6e-8]
#   --sampler-version RUNTIME  their TPU VM software [by generation: v2-alpha-tpuv6e, v2-alpha-tpuv5-lite, ...]
#   --sampler-set OVERRIDE a setting of the sampler jobs only (repeatable), e.g.
#                          --sampler-set=--config.sampling.max_slots=48
#   --skip-create, --skip-copy, --skip-install, --skip-run, --dry-run, --delete
set -euo pipefail

name=oapl zone=us-east5-a accelerator=v5p-64 version=v2-alpha-tpuv5 project="" spot=""
bucket="" mount=/mnt/bucket run=runs/oapl config=configs/math.py python=""
dry_run=0 skip_create=0 skip_copy=0 skip_install=0 skip_run=0 delete=0 queued=0 watch=0
samplers=0 sampler_accelerator=v6e-8 sampler_version=""
overrides=() sampler_overrides=()
while (($#)); do
  case "$1" in
    --name=*) name=${1#*=} ;; --zone=*) zone=${1#*=} ;; --accelerator=*) accelerator=${1#*=} ;;
    --version=*) version=${1#*=} ;; --project=*) project=${1#*=} ;; --bucket=*) bucket=${1#*=} ;;
    --mount=*) mount=${1#*=} ;; --run=*) run=${1#*=} ;; --config=*) config=${1#*=} ;;
    --python=*) python=${1#*=} ;; --spot) spot=--spot ;; --dry-run) dry_run=1 ;;
    --skip-create) skip_create=1 ;; --skip-copy) skip_copy=1 ;; --skip-install) skip_install=1 ;;
    --skip-run) skip_run=1 ;; --delete) delete=1 ;; --queued) queued=1 ;; --watch) watch=1 ;;
    --samplers=*) samplers=${1#*=} ;; --sampler-accelerator=*) sampler_accelerator=${1#*=} ;;
    --sampler-set=*) sampler_overrides+=("${1#*=}") ;; --sampler-version=*) sampler_version=${1#*=} ;;
    --) shift; overrides=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "tpu_pod.sh: unknown option $1 (--help lists them; setting overrides go after --)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$bucket" ]]; then
  ((dry_run)) || { echo "tpu_pod.sh: --bucket=gs://BUCKET is required (it holds the workdir)" >&2; exit 2; }
  bucket=gs://BUCKET
fi
[[ "$bucket" == gs://* ]] || { echo "tpu_pod.sh: --bucket=$bucket: give a gs:// URL" >&2; exit 2; }
[[ -f "${config%%:*}" ]] || { echo "tpu_pod.sh: --config=$config: no such file" >&2; exit 2; }
[[ "$samplers" =~ ^[0-9]+$ ]] || { echo "tpu_pod.sh: --samplers=$samplers: give a count" >&2; exit 2; }
((samplers == 0)) || overrides=(--config.rl.mode=remote --config.rl.window_rollouts=1 "${overrides[@]}")
if [[ -z "$sampler_version" ]]; then  # the TPU VM software of the sampler slices' generation
  case "$sampler_accelerator" in
    v6e-*) sampler_version=v2-alpha-tpuv6e ;; v5litepod-*|v5e-*) sampler_version=v2-alpha-tpuv5-lite ;;
    v4-*) sampler_version=tpu-ubuntu2204-base ;; *) sampler_version=$version ;;
  esac
fi

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
workdir="$bucket/$run"
tarball=/tmp/oapl_jax_src.tar.gz
jax_version=$(python3 -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)

say() { printf '+ %s\n' "$*"; }
quoted() {  # the words of a command as a shell would read them back (single quotes where needed)
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  printf '%s' "${out[*]}"
}
do_() {  # print the command; run it unless --dry-run
  say "$(quoted "$@")"
  ((dry_run)) || "$@"
}
on_all() {  # run a shell command on every worker of the slice
  do_ "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command="$1"
}

trainer_name=$name
sampler_names=()
for ((i = 1; i <= samplers; i++)); do sampler_names+=("$name-s$i"); done

if ((delete)); then
  for name in "$trainer_name" "${sampler_names[@]}"; do
    if ((queued)); then
      do_ gcloud compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet
    else
      do_ "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
    fi
  done
  exit 0
fi

create() {
  if ((queued)); then
    do_ gcloud compute tpus queued-resources create "$name" "${where[@]}" --node-id="$name" \
        --accelerator-type="$accelerator" --runtime-version="$version" $spot
    say "# wait until the queued resource is ACTIVE"
    ((dry_run)) || until [[ "$(gcloud compute tpus queued-resources describe "$name" "${where[@]}" \
        --format='value(state.state)')" == ACTIVE ]]; do sleep 60; done
  else
    do_ "${gcloud_tpu[@]}" create "$name" "${where[@]}" \
        --accelerator-type="$accelerator" --version="$version" $spot
  fi
}

copy() {
  do_ git archive --format=tar.gz --prefix=oapl_jax/ -o "$tarball" HEAD
  do_ "${gcloud_tpu[@]}" scp "$tarball" "$name:~/" "${where[@]}" --worker=all
  on_all "rm -rf ~/oapl_jax && tar xzf ~/$(basename "$tarball") -C ~"
}

# On every worker: a Python >= 3.11 (jax 0.10 needs it; older TPU VM images ship 3.10), a venv
# with this checkout and jax[tpu] of its JAX version, bubblewrap, and gcsfuse from Google's repo.
install() {
  local pick="py=${python:-}; for p in \$py python3.13 python3.12 python3.11; do command -v \$p >/dev/null && \$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' && py=\$p && break; done"
  local newer="sudo apt-get update -q && sudo apt-get install -y -q python3.11 python3.11-venv"
  local gcsfuse_repo="echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null && curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null"
  on_all "set -e; $pick; if ! \$py -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then $newer; py=python3.11; fi; \$py -m venv ~/oapl_venv && cd ~/oapl_jax && ~/oapl_venv/bin/pip install -q -e '.[tpu]' 'jax[tpu]==$jax_version'"
  on_all "set -e; command -v bwrap >/dev/null || (sudo apt-get update -q && sudo apt-get install -y -q bubblewrap); command -v gcsfuse >/dev/null || ($gcsfuse_repo && sudo apt-get update -q && sudo apt-get install -y -q gcsfuse)"
}

start() {  # $1: "trainer" (oapl_jax.main) or "sampler" (a sampler job per worker)
  on_all "sudo mkdir -p $mount && sudo chown \$USER $mount && (mountpoint -q $mount || gcsfuse --implicit-dirs -o ro ${bucket#gs://} $mount)"
  if [[ "${1:-trainer}" == sampler ]]; then
    cmd=(../oapl_venv/bin/python -m oapl_jax.sample --config="$config" --workdir="$workdir" "${overrides[@]}" "${sampler_overrides[@]}")
  else
    cmd=(../oapl_venv/bin/python -m oapl_jax.main --config="$config" --workdir="$workdir" "${overrides[@]}")
  fi
  on_all "cd ~/oapl_jax && nohup $(printf '%q ' "${cmd[@]}") > ~/oapl_run.log 2>&1 &"
  say "# follow it: ${gcloud_tpu[*]} ssh $name ${where[*]} --worker=0 --command='tail -f ~/oapl_run.log'"
  say "# its metrics: gcloud storage cat $workdir/metrics.jsonl"
}

for name in "$trainer_name" "${sampler_names[@]}"; do
  role=trainer slice_type=$accelerator slice_version=$version
  [[ "$name" == "$trainer_name" ]] || role=sampler slice_type=$sampler_accelerator slice_version=$sampler_version
  trainer_type=$accelerator trainer_version=$version accelerator=$slice_type version=$slice_version
  say "# $role slice $name ($accelerator)"
  ((skip_create)) || create
  ((skip_copy)) || copy
  ((skip_install)) || install
  ((skip_run)) || start "$role"
  accelerator=$trainer_type version=$trainer_version
done
name=$trainer_name

# --watch: until the run's summary.json exists, re-create the slice and resume after a preemption.
if ((watch)); then
  say "# watch: every ${WATCH_SECONDS:-600}s until $bucket/$run/summary.json exists; a slice that is preempted or gone is deleted, re-created, re-installed and restarted (the run resumes)"
  ((dry_run)) && exit 0
  until gcloud storage ls "$bucket/$run/summary.json" >/dev/null 2>&1; do
    sleep "${WATCH_SECONDS:-600}"
    state=$("${gcloud_tpu[@]}" describe "$name" "${where[@]}" --format='value(state)' 2>/dev/null || echo GONE)
    case "$state" in
      READY|CREATING|STARTING|RESTARTING) continue ;;
    esac
    echo "tpu_pod.sh: slice $name is $state: re-creating it and resuming the run" >&2
    if ((queued)); then
      gcloud compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet || true
    else
      "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet || true
    fi
    create && copy && install && start
  done
  say "# the run finished: $bucket/$run/summary.json"
fi
