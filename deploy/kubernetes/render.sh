#!/usr/bin/env bash
# Print torchtitan's Kubernetes manifests, filled in from the environment (docs/kubernetes.md):
#   PVC_NAME=tt-data ./deploy/kubernetes/render.sh pvc | kubectl apply -f -
#   IMAGE=registry.example.com/torchtitan:1 NNODES=4 PVC_NAME=tt-data \
#     ./deploy/kubernetes/render.sh [--section.key value ...] | kubectl apply -f -
# The first prints the PersistentVolumeClaim (pvc.yaml), the second the PyTorchJob
# (pytorchjob.yaml), whose pods hand the --section.key value overrides to the launcher.
#
# PyTorchJob variables [default]:
#   IMAGE          the training image built from the Dockerfile, in a registry the cluster can pull
#                  from (required)
#   JOB_NAME       [torchtitan] the PyTorchJob; its pods are JOB_NAME-master-0, JOB_NAME-worker-N
#   NNODES         [1] pods, one per node: a Master and NNODES-1 Workers
#   GPUS_PER_NODE  [8] GPUs each pod requests (nvidia.com/gpu) = training processes it starts (NGPU)
#   CONFIG_FILE    [train_configs/debug_model.toml] the TOML config, relative to /opt/torchtitan
#   PVC_NAME       [torchtitan-data] the PersistentVolumeClaim mounted at MOUNT_PATH in every pod
#   MOUNT_PATH     [/mnt/torchtitan]
#   DUMP_FOLDER    [MOUNT_PATH/JOB_NAME] passed as --job.dump_folder: checkpoints, TensorBoard logs
#   EFA            [0] 1: each pod requests EFA_DEVICES AWS Elastic Fabric Adapters
#                  (vpc.amazonaws.com/efa) and sets FI_PROVIDER=efa; the image then needs
#                  libfabric and the aws-ofi-nccl plugin (docs/kubernetes.md)
#   EFA_DEVICES    [1] EFA devices per pod: all of the node's (p4d.24xlarge: 4, p5.48xlarge: 32)
#   MAX_RESTARTS   [0] times torchrun restarts a pod's workers after one fails
#   GRACE_SECONDS  [330] the pods' terminationGracePeriodSeconds: after SIGTERM (a preemption, a
#                  drained node, kubectl delete) the workers save at the next step and exit with code
#                  160; torchrun gives them GRACE_SECONDS - 30 before it kills them, Kubernetes kills
#                  the pod at GRACE_SECONDS. Make it at least two steps plus one save plus 30
#                  (docs/reliability.md)
#   BACKOFF_LIMIT  [3] times the operator recreates killed pods (exit code 137, 143) before the job fails
#   MASTER_PORT    [23456] the rendezvous port on the Master pod
#   SHM_SIZE       [64Gi] the most memory /dev/shm (a memory-backed emptyDir) may hold
#   PULL_POLICY    [IfNotPresent] imagePullPolicy: Always, IfNotPresent or Never
#   FT_LIGHTHOUSE  [unset] replica groups (docs/reliability.md): the URL of torchft's lighthouse
#                  (http://HOST:29510), set in the pods; render one job per group, each with its
#                  own JOB_NAME and --fault_tolerance.replica_id=N among the overrides
# PersistentVolumeClaim variables: PVC_NAME, PVC_SIZE [1Ti], PVC_ACCESS_MODE [ReadWriteMany],
#   STORAGE_CLASS [empty: the cluster's default storage class]
#
# A bad value gives one line on stderr and exit code 2, and nothing on stdout.
# Needs bash, sed and envsubst (Debian/Ubuntu package gettext-base).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
fail() { echo "render.sh: $*" >&2; exit 2; }

# check NAME REGEX WHAT: the variable NAME must match REGEX, else fail saying what it must be.
check() {
  [[ "${!1}" =~ $2 ]] || fail "$1=${!1}: $3"
}

# A double-quoted YAML string holding $1 exactly; '$' is doubled because Kubernetes expands
# $(VAR) in a container's args and turns '$$' into '$'.
yaml_string() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//\$/\$\$}
  printf '"%s"' "$s"
}

# render TEMPLATE NAME...: the template without its full-line comments and marked lines left out
# (sed_drop), with the named variables filled in and nothing else touched.
render() {
  local template=$1 vars="" name
  shift
  for name in "$@"; do
    vars+="\${$name} "
  done
  export "${@?}"
  sed -E "${sed_drop[@]}" -e '/^#/d' -e 's/ +# (efa|workers|storageclass|ft)$//' "$template" |
    envsubst "$vars"
}

command -v envsubst >/dev/null 2>&1 ||
  fail "envsubst not found: install it (Debian/Ubuntu: apt-get install gettext-base)"

positive='^[1-9][0-9]{0,5}$'
count='^[0-9]{1,4}$'
quantity='^[1-9][0-9]{0,5}(Ki|Mi|Gi|Ti|Pi)$'
dns_subdomain='^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$'
abs_path='^/[A-Za-z0-9._/-]+$'

PVC_NAME=${PVC_NAME:-torchtitan-data}
check PVC_NAME "$dns_subdomain" "must be a Kubernetes object name (lowercase letters, digits, '-', '.')"
sed_drop=()

if [ "${1:-}" = pvc ]; then
  shift
  [ $# -eq 0 ] || fail "'pvc' takes no further arguments (got: $*)"
  PVC_SIZE=${PVC_SIZE:-1Ti}
  PVC_ACCESS_MODE=${PVC_ACCESS_MODE:-ReadWriteMany}
  STORAGE_CLASS=${STORAGE_CLASS:-}
  check PVC_SIZE "$quantity" "must be a size such as 500Gi or 2Ti"
  check PVC_ACCESS_MODE '^(ReadWriteMany|ReadWriteOnce|ReadWriteOncePod|ReadOnlyMany)$' \
    "must be ReadWriteMany, ReadWriteOnce, ReadWriteOncePod or ReadOnlyMany"
  [ -z "$STORAGE_CLASS" ] ||
    check STORAGE_CLASS "$dns_subdomain" "must be a storage class name (kubectl get storageclass)"
  [ -n "$STORAGE_CLASS" ] || sed_drop+=(-e '/# storageclass$/d')
  echo "# torchtitan PersistentVolumeClaim from deploy/kubernetes/render.sh"
  render "$here/pvc.yaml" PVC_NAME PVC_SIZE PVC_ACCESS_MODE STORAGE_CLASS
  exit 0
fi

[ $# -eq 0 ] || [[ "$1" == --* ]] ||
  fail "unexpected argument '$1': give 'pvc', or --section.key value overrides for the training"

[ -n "${IMAGE:-}" ] ||
  fail "IMAGE is not set: the training image in a registry the cluster pulls from (docs/kubernetes.md)"
JOB_NAME=${JOB_NAME:-torchtitan}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
MOUNT_PATH=${MOUNT_PATH:-/mnt/torchtitan}
DUMP_FOLDER=${DUMP_FOLDER:-$MOUNT_PATH/$JOB_NAME}
EFA=${EFA:-0}
EFA_DEVICES=${EFA_DEVICES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
GRACE_SECONDS=${GRACE_SECONDS:-330}
BACKOFF_LIMIT=${BACKOFF_LIMIT:-3}
MASTER_PORT=${MASTER_PORT:-23456}
SHM_SIZE=${SHM_SIZE:-64Gi}
PULL_POLICY=${PULL_POLICY:-IfNotPresent}
FT_LIGHTHOUSE=${FT_LIGHTHOUSE:-}

check IMAGE '^[A-Za-z0-9][A-Za-z0-9._/:@-]*$' "must be an image reference such as registry.example.com/torchtitan:1"
check JOB_NAME '^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$' \
  "must be 1-50 lowercase letters, digits or '-', starting with a letter and not ending with '-'"
check NNODES "$positive" "the number of nodes (pods) must be a positive integer"
check GPUS_PER_NODE "$positive" "GPUs per node must be a positive integer"
check CONFIG_FILE '^[A-Za-z0-9._/-]+\.toml$' "must be the path of a .toml config (letters, digits, '._/-')"
check MOUNT_PATH "$abs_path" "must be an absolute path (letters, digits, '._/-')"
check DUMP_FOLDER "$abs_path" "must be an absolute path (letters, digits, '._/-'), normally under MOUNT_PATH"
check EFA '^[01]$' "must be 0 or 1"
check EFA_DEVICES "$positive" "EFA devices per pod must be a positive integer"
check MAX_RESTARTS "$count" "must be a non-negative integer"
check GRACE_SECONDS "$positive" "must be a whole number of seconds, at least 60"
[ "$GRACE_SECONDS" -ge 60 ] || fail "GRACE_SECONDS=$GRACE_SECONDS: must be a whole number of seconds, at least 60"
check BACKOFF_LIMIT "$count" "must be a non-negative integer"
check MASTER_PORT '^[1-9][0-9]{0,4}$' "must be a TCP port number (1..65535)"
[ "$MASTER_PORT" -le 65535 ] || fail "MASTER_PORT=$MASTER_PORT: must be a TCP port number (1..65535)"
check SHM_SIZE "$quantity" "must be a size such as 16Gi"
check PULL_POLICY '^(Always|IfNotPresent|Never)$' "must be Always, IfNotPresent or Never"
[ -z "$FT_LIGHTHOUSE" ] || check FT_LIGHTHOUSE '^https?://[A-Za-z0-9.-]+:[0-9]{1,5}$' \
  "must be the lighthouse's URL, such as http://torchft-lighthouse:29510"

TRAIN_ARGS=""
for arg in --job.dump_folder "$DUMP_FOLDER" "$@"; do
  [[ "$arg" != *[[:cntrl:]]* ]] || fail "override $(printf '%q' "$arg"): control characters are not allowed"
  TRAIN_ARGS+="${TRAIN_ARGS:+, }$(yaml_string "$arg")"
done
WORKERS=$((NNODES - 1))
# shellcheck disable=SC2034  # used by render (envsubst)
SHUTDOWN_TIMEOUT=$((GRACE_SECONDS - 30))  # torchrun's wait for the workers to save and stop
[ "$EFA" = 1 ] || sed_drop+=(-e '/# efa$/d')
[ "$WORKERS" -gt 0 ] || sed_drop+=(-e '/# workers$/d')
[ -n "$FT_LIGHTHOUSE" ] || sed_drop+=(-e '/# ft$/d')

echo "# torchtitan PyTorchJob from deploy/kubernetes/render.sh: NNODES=$NNODES GPUS_PER_NODE=$GPUS_PER_NODE EFA=$EFA"
render "$here/pytorchjob.yaml" JOB_NAME IMAGE PULL_POLICY TRAIN_ARGS GPUS_PER_NODE CONFIG_FILE \
  MAX_RESTARTS BACKOFF_LIMIT MASTER_PORT EFA_DEVICES MOUNT_PATH SHM_SIZE PVC_NAME WORKERS \
  GRACE_SECONDS SHUTDOWN_TIMEOUT FT_LIGHTHOUSE
