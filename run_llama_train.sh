#!/usr/bin/env bash
# Train: ./run_llama_train.sh [--section.key value ...]   (the same script on every node or pod)
#
# Where it runs is read from the environment, first match wins (docs/launching.md):
#   Kubeflow PyTorchJob / Run:ai, newer operators: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
#                PET_MASTER_PORT (and PET_NPROC_PER_NODE) -- torchrun's own variables
#   explicit multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500)
#   Kubeflow PyTorchJob, older operators: MASTER_ADDR, MASTER_PORT, WORLD_SIZE (= pods) and
#                RANK (= pod index: master 0, workers 1..)
#   otherwise: this machine alone (torchrun --standalone, a free port)
# Several nodes meet in torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT, hosted by node 0.
#
#   NGPU         processes per node (default: PET_NPROC_PER_NODE if a number, else the number of
#                GPUs, or 1 on a machine without one; on CPU each process is a gloo CPU worker)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     comma-separated local ranks whose output is shown (default: 0)
#   MAX_RESTARTS times torchrun restarts all workers after one fails (default: 0); with
#                checkpoint.enable they resume from the newest complete checkpoint
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun gives the workers to save and stop after a
#                stop signal before it kills them (default here: 300; torchrun's own: 30)
#   RDZV_ID      rendezvous id shared by the nodes of one job (default: SLURM_JOB_ID, else torchtitan)
#   PYTHON       Python interpreter (default: the active virtual environment's, else this
#                checkout's .venv if it has one, else python3)
#   OMP_NUM_THREADS  intra-op threads per process (default on a machine without GPUs: its cores
#                divided by NGPU, at least 1; with GPUs torchrun's 1)
#   DRY_RUN=1    print the resolved launch and torchrun command, and exit
#   MEMORY_CHECK preflight's memory check of a CUDA job: trace (default: the floor, then one step
#                traced on fake tensors), floor (the floor alone), off (launch a job the
#                prediction refuses)
#   FT_LIGHTHOUSE  replica groups (--fault_tolerance.enable): "start" runs torchft's lighthouse
#                here for as long as this script runs (port FT_LIGHTHOUSE_PORT, default 29510;
#                FT_MIN_REPLICAS groups per quorum, default 1), or the URL of a running one
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
fail() { echo "error: $*" >&2; exit 2; }
is_count() { [[ "$1" =~ ^[0-9]+$ ]]; }

if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  elif [ -x "$here/.venv/bin/python" ]; then
    PYTHON="$here/.venv/bin/python"
  else
    PYTHON=python3
    command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python
  fi
fi

# ---- where: nodes, this node's rank, the rendezvous address
launch=local nnodes=1 node_rank=0 addr="" port=""
if [ -n "${PET_NNODES:-}" ]; then
  launch="Kubeflow (PET_* variables)"
  nnodes=$PET_NNODES node_rank=${PET_NODE_RANK:-${RANK:-}}
  addr=${PET_MASTER_ADDR:-${MASTER_ADDR:-}} port=${PET_MASTER_PORT:-${MASTER_PORT:-23456}}
  what_nodes=PET_NNODES what_rank=PET_NODE_RANK what_addr=PET_MASTER_ADDR
elif [ -n "${NNODES:-}" ]; then
  launch="multi-node (NNODES)"
  nnodes=$NNODES node_rank=${NODE_RANK:-} addr=${MASTER_ADDR:-} port=${MASTER_PORT:-29500}
  what_nodes=NNODES what_rank=NODE_RANK what_addr=MASTER_ADDR
elif [ -n "${MASTER_ADDR:-}" ] && [ -n "${WORLD_SIZE:-}" ] && [ -n "${RANK:-}" ]; then
  launch="Kubeflow (WORLD_SIZE pods, RANK pod index)"
  nnodes=$WORLD_SIZE node_rank=$RANK addr=$MASTER_ADDR port=${MASTER_PORT:-23456}
  what_nodes=WORLD_SIZE what_rank=RANK what_addr=MASTER_ADDR
fi
if [ "$launch" != local ]; then
  is_count "$nnodes" && [ "$nnodes" -ge 1 ] ||
    fail "$what_nodes=$nnodes: the number of nodes must be a positive integer"
  is_count "$node_rank" && [ "$node_rank" -lt "$nnodes" ] ||
    fail "$what_rank=${node_rank:-<unset>}: this node's rank must be an integer in 0..$((nnodes - 1)) ($what_nodes=$nnodes)"
  [ "$nnodes" -eq 1 ] || [ -n "$addr" ] ||
    fail "$what_addr is not set: the nodes need node 0's address to meet"
  is_count "$port" && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] ||
    fail "MASTER_PORT=$port: must be a TCP port number (1..65535)"
fi

# ---- how many processes on this node
if [ -z "${NGPU:-}" ] && is_count "${PET_NPROC_PER_NODE:-}"; then
  NGPU=$PET_NPROC_PER_NODE
fi
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [ -z "${NGPU:-}" ]; then
  NGPU=$gpus
  [ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
fi
is_count "$NGPU" && [ "$NGPU" -ge 1 ] || fail "NGPU=$NGPU: processes per node must be a positive integer"
world_size=$((nnodes * NGPU))

CONFIG_FILE="${CONFIG_FILE:-$here/train_configs/debug_model.toml}"
LOG_RANK="${LOG_RANK:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# torchrun would set OMP_NUM_THREADS=1; CPU workers instead share the cores (a value you set wins).
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$gpus" -eq 0 ] 2>/dev/null; then
  cores=$(nproc 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

case " $* " in
  *" --help "* | *" -h "*) exec "$PYTHON" "$here/train.py" --help ;;
esac

if [ "$launch" = local ] || [ "$nnodes" -eq 1 ]; then
  where=(--standalone --nnodes=1)
  rendezvous="standalone (a free local port)"
else
  # c10d rendezvous: node 0 hosts the store (said outright: MASTER_ADDR may be a name that
  # torchrun cannot match to this machine, such as a Kubernetes service)
  where=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$addr:$port"
         --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-torchtitan}}"
         --rdzv-conf="is_host=$([ "$node_rank" -eq 0 ] && echo 1 || echo 0)")
  rendezvous="c10d at $addr:$port"
fi
# torchrun, acting on a stop signal once (torchtitan/resilience/torchrun.py says why)
cmd=("$PYTHON" -m torchtitan.resilience.torchrun "${where[@]}" --nproc-per-node="$NGPU"
     --max-restarts="$MAX_RESTARTS" --local-ranks-filter "$LOG_RANK" --role rank --tee 3
     "$here/train.py" --job.config_file "$CONFIG_FILE" "$@")
show_launch() {
  echo "launch: $launch: nnodes=$nnodes node_rank=$node_rank nproc_per_node=$NGPU world_size=$world_size rendezvous=$rendezvous"
  echo "+ ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }${cmd[*]}"
}
if [ "${DRY_RUN:-0}" != 0 ]; then
  show_launch
  exit 0
fi

# ---- torchft's lighthouse for replica groups (fault_tolerance, docs/reliability.md):
#      FT_LIGHTHOUSE=start runs one here for as long as this script runs; FT_LIGHTHOUSE=URL
#      points this group at a running one (as TORCHFT_LIGHTHOUSE does)
lighthouse_pid=""
if [ "${FT_LIGHTHOUSE:-}" = start ] && [ "$node_rank" -gt 0 ]; then
  # a group of several nodes: the lighthouse runs on its first node
  export TORCHFT_LIGHTHOUSE="http://$addr:${FT_LIGHTHOUSE_PORT:-29510}"
elif [ "${FT_LIGHTHOUSE:-}" = start ]; then
  lighthouse="$(dirname "$(command -v "$PYTHON")")/torchft_lighthouse"
  [ -x "$lighthouse" ] || lighthouse=torchft_lighthouse
  command -v "$lighthouse" >/dev/null 2>&1 ||
    fail "FT_LIGHTHOUSE=start: torchft_lighthouse not found beside $PYTHON or on PATH (pip install torchft)"
  lh_port=${FT_LIGHTHOUSE_PORT:-29510}
  is_count "$lh_port" || fail "FT_LIGHTHOUSE_PORT=$lh_port: must be a TCP port number"
  "$lighthouse" --min_replicas "${FT_MIN_REPLICAS:-1}" --bind "[::]:$lh_port" \
    >"$(dirname "$(mktemp -u)")/torchft-lighthouse-$lh_port.log" 2>&1 &
  lighthouse_pid=$!
  trap 'kill "$lighthouse_pid" 2>/dev/null' EXIT
  for _ in $(seq 100); do  # up within 10 s, or say why not
    (exec 3<>"/dev/tcp/127.0.0.1/$lh_port") 2>/dev/null && break
    kill -0 "$lighthouse_pid" 2>/dev/null ||
      fail "FT_LIGHTHOUSE=start: torchft_lighthouse exited (port $lh_port taken?); see $(dirname "$(mktemp -u)")/torchft-lighthouse-$lh_port.log"
    sleep 0.1
  done
  TORCHFT_LIGHTHOUSE="http://$(hostname):$lh_port"
  export TORCHFT_LIGHTHOUSE
  echo "launch: torchft lighthouse at $TORCHFT_LIGHTHOUSE (pid $lighthouse_pid, min_replicas ${FT_MIN_REPLICAS:-1})"
elif [ -n "${FT_LIGHTHOUSE:-}" ]; then
  export TORCHFT_LIGHTHOUSE=$FT_LIGHTHOUSE
fi

# Check the configuration once, before any worker starts: one clear line and exit code 2 if bad.
"$PYTHON" -m torchtitan.preflight --world-size "$world_size" --memory-check "${MEMORY_CHECK:-trace}" \
  --job.config_file "$CONFIG_FILE" "$@" || exit $?
export TORCHTITAN_CONFIG_CHECKED=1  # its warnings (old key names) are not repeated by the workers
show_launch

# Workers that stop on a user error (bad data, an unreachable dataset) write one line to this file;
# torchrun's own failure report (a Python traceback) is then replaced by that line and exit code.
TORCHTITAN_ERROR_FILE="$(mktemp "${TMPDIR:-/tmp}/torchtitan-error.XXXXXX")"
export TORCHTITAN_ERROR_FILE
trap 'rm -f "$TORCHTITAN_ERROR_FILE"; [ -z "$lighthouse_pid" ] || kill "$lighthouse_pid" 2>/dev/null' EXIT
# torchrun's own notes of a shutdown (a signal it passed on, a worker that exited non-zero): the
# launcher says what happened in one line at the end.
torchrun_note='^[EWI][0-9]{4} [0-9:.]+ [0-9]+ [^ ]+\] (Received [0-9]+ death signal|Sending process [0-9]+ closing signal|Unable to shutdown process|failed \(exitcode: )'
hide_report_after_user_error() {
  local line hiding=0
  while IFS= read -r line; do
    if [ "$hiding" = 0 ] && [ -s "$TORCHTITAN_ERROR_FILE" ] &&
       [ "$line" = "Traceback (most recent call last):" ]; then
      hiding=1
    fi
    # a failed worker's note stays unless that worker said what went wrong in one line
    if [[ "$line" =~ $torchrun_note ]] &&
       { [[ "$line" != *"failed (exitcode"* ]] || [ -s "$TORCHTITAN_ERROR_FILE" ]; }; then
      continue
    fi
    [ "$hiding" = 1 ] || printf '%s\n' "$line"
  done
}
# A stop signal (Kubernetes' SIGTERM, Slurm's --signal, a kill of this script) goes on to torchrun,
# which passes it to the workers: they save at the next agreed step and exit with code 160. torchrun
# waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for them before it kills them (docs/reliability.md).
# (torchrun's --signals-to-handle, read from PET_SIGNALS_TO_HANDLE, sets TORCHELASTIC_SIGNALS_TO_HANDLE)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2}
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
# Ctrl-C: torchrun runs in a session of its own (as it starts each worker), so a terminal's Ctrl-C
# reaches this script alone. The first is passed on once: torchrun gives SIGINT to every worker,
# they save at the next agreed step and exit with code 130. A second one ends them all at once.
# shellcheck disable=SC2329  # called from the INT trap
children_of() {  # the process ids whose parent is $1
  local parent=$1 stat rest ppid pid
  if command -v pgrep >/dev/null 2>&1; then pgrep -P "$parent"; return 0; fi
  for stat in /proc/[0-9]*/stat; do
    read -r rest <"$stat" 2>/dev/null || continue
    rest=${rest##*) }  # the fields after the command name (which may hold spaces)
    read -r _ ppid _ <<<"$rest"
    pid=${stat#/proc/}
    [ "$ppid" != "$parent" ] || echo "${pid%/stat}"
  done
}
interrupts=0
# shellcheck disable=SC2329  # the INT trap
on_ctrl_c() {
  signaled=1
  interrupts=$((interrupts + 1))
  if [ "$interrupts" = 1 ]; then
    kill -s INT "$trainer" 2>/dev/null
    return
  fi
  local worker
  for worker in $(children_of "$trainer"); do
    kill -s KILL -- "-$worker" 2>/dev/null  # each worker leads a session of its own
  done
  kill -s KILL -- "-$trainer" 2>/dev/null
  printf '130\tstopped by a second Ctrl-C: nothing more saved (the newest complete checkpoint, if any, stays)\n' >"$TORCHTITAN_ERROR_FILE"
}
set +e
exec {filter}> >(trap '' INT TERM USR1 USR2 HUP; hide_report_after_user_error >&2)
filter_pid=$!
"$PYTHON" -c 'import os, sys
try:
    os.setsid()
except OSError:
    pass
os.execvp(sys.argv[1], sys.argv[1:])' "${cmd[@]}" 2>&"$filter" &
trainer=$!
signaled=0
for sig in TERM USR1 USR2 HUP; do
  # shellcheck disable=SC2064  # $sig is meant to be expanded now
  trap "signaled=1; kill -s $sig $trainer 2>/dev/null" "$sig"
done
trap on_ctrl_c INT
while :; do
  signaled=0
  wait "$trainer" 2>/dev/null  # not the shell's note of a worker killed by a second Ctrl-C
  rc=$?
  [ "$signaled" = 1 ] || break  # wait was cut short by a signal: the trainer may still run
done
trap - TERM USR1 USR2 HUP INT
exec {filter}>&-
wait "$filter_pid" 2>/dev/null
set -e
if [ -s "$TORCHTITAN_ERROR_FILE" ]; then
  # the first rank's lines (one per problem), each once; after a collective timeout (code 4)
  # every rank's line: together they say who waited where
  # codes 160 (preempted, saved) and 130 (Ctrl-C) are not errors: the first rank's line as it is
  code=$(head -n 1 "$TORCHTITAN_ERROR_FILE" | cut -f 1)
  prefix=$(head -n 1 "$TORCHTITAN_ERROR_FILE" | cut -f 2- | grep -o '^rank [0-9]*: ' || true)
  [ "$code" != 4 ] || prefix=""
  label="error: "
  [ "$code" != 160 ] && [ "$code" != 130 ] || label=""
  cut -f 2- "$TORCHTITAN_ERROR_FILE" |
    awk -v p="$prefix" -v l="$label" 'substr($0, 1, length(p)) == p && !seen[$0]++ { print l $0 }' >&2
  exit "$code"
fi
exit "$rc"
