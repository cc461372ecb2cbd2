#!/usr/bin/env bash
# The GPU suite: what a session with one CUDA GPU runs first, in one go, within a time budget.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]
#
# Each part runs under its own time limit and writes OUT_DIR/<part>.log (default ./gpu_suite_out);
# a part that fails or runs out of time is reported and the next part still runs. A part that
# cannot start before the suite's budget is spent (T_TOTAL seconds, default 510: with a part's
# 20 s to stop, under 9 minutes)
# is skipped, and each part's limit is cut to what is left. PARTS="a b ..." runs only those.
# The end: OUT_DIR/suite.json (every part's status, seconds and the JSON its benchmark printed) and
# a table of them with the issue's targets (benchmarks/gpu_suite_report.py).
#
# Parts, in order (the ones the planner's calibration needs first):
#   env          torch, CUDA and the device's name
#   tokenizer    a stand-in of the Llama 3 tokenizer's size (the device cannot download the real one)
#   ceilings     bf16 matmul TFLOP/s and copy GB/s (benchmarks/ceilings.py)
#   3b_bf16      Llama 3.2 3B, seq 8192, batch 1, selective AC, compiled (benchmarks/train_throughput.py)
#   3b_float8    the same with float8 (tensorwise) linears
#   1b_bs2       Llama 3.2 1B, seq 8192, batch 2, selective AC, compiled
#   gpu_tests    python -m pytest -m gpu tests/   (CUDA against the CPU path: norms, CP, MoE, masks)
#   moe_kernels  grouped mm against the per-expert loop, bf16, published sizes (benchmarks/moe.py)
#   model_step   our training step against the shortest hand-written model (benchmarks/model_step.py)
#   rmsnorm      the three RMSNorm implementations (benchmarks/rmsnorm.py)
#   3b_no_ac     3B batch 1 without activation checkpointing
#   3b_fused_norm  3B batch 1 with the Triton RMSNorm
#   3b_eager     3B batch 1 without compile
#   1b_bs4       1B batch 4
#   mla          MLA against GQA at equal parameters, and MTP's price per step (benchmarks/mla.py)
#   sink_window  gpt-oss attention (sinks, 128-key window) against causal (benchmarks/sink_window.py)
#   hybrid_attn  Qwen3-Next's linear attention against softmax (benchmarks/hybrid_attention.py)
# Limits (seconds): T_TESTS (gpu_tests, 200), T_TRAIN (each training part, 120), T_BENCH (the
# others, 90). A training setting the launcher's preflight predicts not to fit the GPU (3B without
# checkpointing and 1B at batch 4 on an 80 GB H100) stops there in one line, its part failed.
set -u
out=$(realpath -m "${1:-gpu_suite_out}")
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
# a training part stopped by its time limit: the launcher's workers stop within 10 s (not 300),
# so that the next part has the GPU to itself
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=10
budget=${T_TOTAL:-510}
start=$SECONDS
: >"$out/summary.tsv"
all=" env tokenizer ceilings 3b_bf16 3b_float8 1b_bs2 gpu_tests moe_kernels model_step rmsnorm 3b_no_ac 3b_fused_norm 3b_eager 1b_bs4 mla sink_window hybrid_attn "
for name in ${PARTS:-}; do
    [[ "$all" == *" $name "* ]] || { echo "error: PARTS: unknown part '$name'; parts:$all" >&2; exit 2; }
done

selected() {  # the tokenizer goes with every training part
    [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]] ||
        { [ "$1" = tokenizer ] && [[ " $PARTS " == *" 3b_"* || " $PARTS " == *" 1b_"* ]]; }
}

part() {  # part NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    selected "$name" || return 0
    rm -f "$out/$name.log"  # an earlier run's result is not this one's
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 15 ]; then
        printf '%s\t%s\t%d\n' "$name" "skipped (suite budget of ${budget}s spent)" 0 >>"$out/summary.tsv"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 20 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 20 "$out/$name.log"
    local verdict=ok
    [ "$rc" -eq 124 ] && verdict="timed out after ${limit}s"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && verdict="failed (exit $rc)"
    printf '%s\t%s\t%d\n' "$name" "$verdict" $((SECONDS - t0)) >>"$out/summary.tsv"
}

tokenizer="$out/llama3.model"
# one training setting: llama CONFIG "OVERRIDES" (14 steps, the last 6 timed; the offline corpus)
llama=("$PY" benchmarks/train_throughput.py --steps 14 --warmup 8 --json)
data=(-- --model.tokenizer_path "$tokenizer" --training.dataset python_docs --lr_scheduler.warmup_steps 4)
T_TRAIN=${T_TRAIN:-120}
T_BENCH=${T_BENCH:-90}

part env 60 "$PY" -c "import json, torch; print(json.dumps({'torch': torch.__version__, \
'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() \
else 'no CUDA device'}))"
part tokenizer 60 "$PY" -c "import sys; sys.path.insert(0, 'tests/helpers'); \
from pathlib import Path; from sized_tokenizers import llama3_sized_tiktoken; \
print(llama3_sized_tiktoken(Path(sys.argv[1])))" \
    "$tokenizer"
part ceilings "$T_BENCH" "$PY" benchmarks/ceilings.py --json
part 3b_bf16 "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_3b.toml \
    --setting "run=--training.local_batch_size 1" "${data[@]}"
part 3b_float8 "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_3b.toml \
    --setting "run=--training.local_batch_size 1 --model.converters float8" "${data[@]}"
part 1b_bs2 "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_1b.toml \
    --setting "run=--training.local_batch_size 2" "${data[@]}"
part gpu_tests "${T_TESTS:-200}" "$PY" -m pytest -m gpu tests/ -q -p no:cacheprovider
part moe_kernels "$T_BENCH" "$PY" benchmarks/moe.py kernels --device cuda --dtype bfloat16 \
    --sizes scout,qwen3-30b,many --json
part model_step "$T_BENCH" "$PY" benchmarks/model_step.py --device cuda --json
part rmsnorm "$T_BENCH" "$PY" benchmarks/rmsnorm.py --device cuda --json
part 3b_no_ac "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_3b.toml \
    --setting "run=--training.local_batch_size 1 --activation_checkpoint.mode none" "${data[@]}"
part 3b_fused_norm "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_3b.toml \
    --setting "run=--training.local_batch_size 1 --model.norm_type fused_rmsnorm" "${data[@]}"
part 3b_eager "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_3b.toml \
    --setting "run=--training.local_batch_size 1 --compile.enable false" "${data[@]}"
part 1b_bs4 "$T_TRAIN" "${llama[@]}" --config train_configs/llama3_2_1b.toml \
    --setting "run=--training.local_batch_size 4" "${data[@]}"
part mla "$T_BENCH" "$PY" benchmarks/mla.py --device cuda --batch 8 --seq 2048 --json
part sink_window "$T_BENCH" "$PY" benchmarks/sink_window.py --heads 64 --kv-heads 8 --json
part hybrid_attn "$T_BENCH" "$PY" benchmarks/hybrid_attention.py --device cuda --json

echo "== suite: $((SECONDS - start)) s in all"
"$PY" benchmarks/gpu_suite_report.py "$out"
