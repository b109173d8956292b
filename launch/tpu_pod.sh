#!/usr/bin/env bash
# Run oapl_jax on a Cloud TPU VM pod slice: create the slice, copy this checkout to every
# worker, install it, mount the bucket that holds the workdir, and start the same command on
# all workers at once (jax.distributed finds the other workers by itself on TPU VMs).
#
#   bash launch/tpu_pod.sh --name=oapl-math --zone=us-east5-a --accelerator=v5p-64 \
#       --bucket=gs://my-bucket --run=runs/math_l50 --dry-run \
#       -- --config.model.path=/mnt/bucket/ckpt/Qwen3-4B-Thinking-2507 \
#          --config.task.train_path=/mnt/bucket/data/deepscaler.jsonl \
#          --config.task.eval_path=/mnt/bucket/data/aime2025.jsonl
#
# What each worker runs (the arguments after `--` are appended):
#
#   python -m oapl_jax.main --config=configs/math.py --workdir=/mnt/bucket/runs/math_l50 \
#       --config.model.path=/mnt/bucket/ckpt/Qwen3-4B-Thinking-2507 \
#       --config.task.train_path=/mnt/bucket/data/deepscaler.jsonl \
#       --config.task.eval_path=/mnt/bucket/data/aime2025.jsonl
#
# The workdir lives in the bucket, mounted with gcsfuse at the same path on every worker:
# a run writes its workdir through ordinary file calls (run.lock, metrics.jsonl, summary.json,
# orbax checkpoints), so a gs:// URL is not passed to it directly. Checkpoints and metrics
# outlive the VMs; running the script again on a new slice resumes the run.
#
# Steps (each skipped with --skip-*): create (`gcloud compute tpus tpu-vm create`), copy (a
# tarball of the git checkout, `scp --worker=all`), install (pip install -e . and
# gcsfuse; jax[tpu] of this checkout's JAX version), run (`ssh --worker=all`, in the background under nohup, log in ~/oapl_run.log).
# --dry-run prints every command instead of running it; --delete deletes the slice.
# Options (defaults in brackets):
#   --name NAME            TPU VM name [oapl]
#   --zone ZONE            [us-east5-a]
#   --accelerator TYPE     slice type, e.g. v5p-64, v5litepod-64, v4-32 [v5p-64]
#   --version RUNTIME      TPU VM software version [v2-alpha-tpuv5]
#   --project PROJECT      gcloud project [gcloud's default]
#   --spot                 create a Spot slice (preemptible: the run resumes from its checkpoints)
#   --bucket gs://BUCKET   bucket holding the workdir (required unless --dry-run)
#   --mount DIR            where the bucket is mounted on the workers [/mnt/bucket]
#   --run PATH             the workdir inside the bucket [runs/oapl]
#   --config SPEC          config file and arg, e.g. configs/code.py [configs/math.py]
#   --python PYTHON        python on the workers [python3]
#   --skip-create, --skip-copy, --skip-install, --skip-run, --dry-run, --delete
set -euo pipefail

name=oapl zone=us-east5-a accelerator=v5p-64 version=v2-alpha-tpuv5 project="" spot=""
bucket="" mount=/mnt/bucket run=runs/oapl config=configs/math.py python=python3
dry_run=0 skip_create=0 skip_copy=0 skip_install=0 skip_run=0 delete=0
overrides=()
while (($#)); do
  case "$1" in
    --name=*) name=${1#*=} ;; --zone=*) zone=${1#*=} ;; --accelerator=*) accelerator=${1#*=} ;;
    --version=*) version=${1#*=} ;; --project=*) project=${1#*=} ;; --bucket=*) bucket=${1#*=} ;;
    --mount=*) mount=${1#*=} ;; --run=*) run=${1#*=} ;; --config=*) config=${1#*=} ;;
    --python=*) python=${1#*=} ;; --spot) spot=--spot ;; --dry-run) dry_run=1 ;;
    --skip-create) skip_create=1 ;; --skip-copy) skip_copy=1 ;; --skip-install) skip_install=1 ;;
    --skip-run) skip_run=1 ;; --delete) delete=1 ;;
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

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
workdir="$mount/$run"
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

if ((delete)); then
  do_ "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
  exit 0
fi
((skip_create)) || do_ "${gcloud_tpu[@]}" create "$name" "${where[@]}" \
    --accelerator-type="$accelerator" --version="$version" $spot
if ! ((skip_copy)); then
  do_ git archive --format=tar.gz --prefix=oapl_jax/ -o "$tarball" HEAD
  do_ "${gcloud_tpu[@]}" scp "$tarball" "$name:~/" "${where[@]}" --worker=all
  on_all "rm -rf ~/oapl_jax && tar xzf ~/$(basename "$tarball") -C ~"
fi
if ! ((skip_install)); then
  on_all "cd ~/oapl_jax && $python -m pip install -q -e . 'jax[tpu]==$jax_version' && (command -v gcsfuse >/dev/null || (sudo apt-get update -q && sudo apt-get install -y -q gcsfuse || echo 'install gcsfuse: https://cloud.google.com/storage/docs/gcsfuse-install'))"
fi
if ! ((skip_run)); then
  on_all "sudo mkdir -p $mount && sudo chown \$USER $mount && (mountpoint -q $mount || gcsfuse --implicit-dirs ${bucket#gs://} $mount)"
  cmd=(python -m oapl_jax.main --config="$config" --workdir="$workdir" "${overrides[@]}")
  cmd[0]=$python
  on_all "cd ~/oapl_jax && nohup $(printf '%q ' "${cmd[@]}") > ~/oapl_run.log 2>&1 &"
  say "# follow it: ${gcloud_tpu[*]} ssh $name ${where[*]} --worker=0 --command='tail -f ~/oapl_run.log'"
  say "# its metrics: $workdir/metrics.jsonl (= $bucket/$run/metrics.jsonl)"
fi
