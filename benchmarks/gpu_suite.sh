#!/usr/bin/env bash
# The GPU suite: what a session with one CUDA GPU runs first, in one go.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]
#
# Each part runs under its own time limit (seconds, from the environment: T_TESTS, T_BENCH) and
# writes OUT_DIR/<part>.log (default ./gpu_suite_out); a part that fails or runs out of time is
# reported and the next part still runs. The last lines are one summary row per part. Parts:
#   env         torch, CUDA and the device's name
#   gpu_tests   python -m pytest -m gpu tests/   (CUDA against the CPU path: norms, CP, MoE, masks)
#   ceilings    bf16 matmul TFLOP/s and copy GB/s (benchmarks/ceilings.py)
#   rmsnorm     the three RMSNorm implementations (benchmarks/rmsnorm.py)
#   model_step  our training step against the shortest hand-written model (benchmarks/model_step.py)
#   mla         MLA against GQA at equal parameters, and MTP's price per step (benchmarks/mla.py)
#   sink_window gpt-oss attention (sinks, 128-key window) against causal (benchmarks/sink_window.py)
# The longer tuning runs (1B/3B/8B throughput, float8) need the Llama 3 tokenizer and are listed in
# docs/performance.md ("On a GPU: commands to run").
set -u
out=${1:-gpu_suite_out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
summary=()

part() {  # part NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    local verdict=ok
    [ "$rc" -eq 124 ] && verdict="timed out after ${limit}s"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && verdict="failed (exit $rc)"
    summary+=("$(printf '%-11s %-26s %4ds' "$name" "$verdict" $((SECONDS - t0)))")
}

part env 60 python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA DEVICE')"
part gpu_tests "${T_TESTS:-240}" python -m pytest -m gpu tests/ -q -p no:cacheprovider
part ceilings "${T_BENCH:-120}" python benchmarks/ceilings.py
part rmsnorm "${T_BENCH:-120}" python benchmarks/rmsnorm.py --device cuda
part model_step "${T_BENCH:-120}" python benchmarks/model_step.py --device cuda
part mla "${T_BENCH:-120}" python benchmarks/mla.py --device cuda --batch 8 --seq 2048
part sink_window "${T_BENCH:-120}" python benchmarks/sink_window.py --heads 64 --kv-heads 8
part hybrid_attn "${T_BENCH:-120}" python benchmarks/hybrid_attention.py --device cuda

echo "== summary ($(date -u +%F), $(python -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null))"
printf '%s\n' "${summary[@]}"
