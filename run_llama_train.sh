#!/usr/bin/env bash
# Train on this machine: ./run_llama_train.sh [--section.key value ...]
#   NGPU         processes to start (default: the number of GPUs, or 1 on a machine without one;
#                on CPU each process is a CPU worker using gloo)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     comma-separated ranks whose output is shown (default: 0)
#   MAX_RESTARTS times torchrun restarts all workers after one fails (default: 0); with
#                checkpoint.enable they resume from the newest complete checkpoint
#   PYTHON       Python interpreter (default: the active virtual environment's, else this
#                checkout's .venv if it has one, else python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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
if [ -z "${NGPU:-}" ]; then
  NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE="${CONFIG_FILE:-$here/train_configs/debug_model.toml}"
LOG_RANK="${LOG_RANK:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# torchrun would set OMP_NUM_THREADS=1; CPU workers instead share the cores (a value you set wins).
if [ -z "${OMP_NUM_THREADS:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  cores=$(nproc 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

case " $* " in
  *" --help "* | *" -h "*) exec "$PYTHON" "$here/train.py" --help ;;
esac

# Check the configuration once, before any worker starts: one clear line and exit code 2 if bad.
"$PYTHON" -m torchtitan.preflight --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@" || exit $?

cmd=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NGPU"
     --max-restarts="$MAX_RESTARTS" --local-ranks-filter "$LOG_RANK" --role rank --tee 3
     "$here/train.py" --job.config_file "$CONFIG_FILE" "$@")
echo "+ ${cmd[*]}"

# Workers that stop on a user error (bad data, an unreachable dataset) write one line to this file;
# torchrun's own failure report (a Python traceback) is then replaced by that line and exit code.
TORCHTITAN_ERROR_FILE="$(mktemp "${TMPDIR:-/tmp}/torchtitan-error.XXXXXX")"
export TORCHTITAN_ERROR_FILE
trap 'rm -f "$TORCHTITAN_ERROR_FILE"' EXIT
hide_report_after_user_error() {
  local line hiding=0
  while IFS= read -r line; do
    if [ "$hiding" = 0 ] && [ -s "$TORCHTITAN_ERROR_FILE" ] &&
       [ "$line" = "Traceback (most recent call last):" ]; then
      hiding=1
    fi
    [ "$hiding" = 1 ] || printf '%s\n' "$line"
  done
}
set +e
exec 3>&1
"${cmd[@]}" 2>&1 1>&3 3>&- | hide_report_after_user_error >&2
rc=${PIPESTATUS[0]}
set -e
if [ -s "$TORCHTITAN_ERROR_FILE" ]; then
  IFS=$'\t' read -r code message <"$TORCHTITAN_ERROR_FILE"
  echo "error: $message" >&2
  exit "$code"
fi
exit "$rc"
