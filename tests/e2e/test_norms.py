"""RMSNorm implementations (model.norm_type) where processes start: compiled_rmsnorm against the
eager reference and in the model (``torch.compile`` runs the C++ compiler on CPU), the fused
Triton kernel on a GPU (ptxas), under Triton's interpreter and compiled for CUDA without a GPU
(subprocesses), the CPU refusal through ``python -m torchtitan.preflight``, the fused norm under
tensor (sequence) parallel (torchrun, tests/helpers/norms_tp_worker.py), and benchmarks/rmsnorm.py.
The in-process checks are in tests/unit/models/test_norms.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from norm_checks import (
    HAS_TRITON,
    KERNEL_CASES,
    TOL,
    check_kernel,
    module_values_and_grads,
    one_cpu_thread,  # noqa: F401  (autouse fixture)
    random_case,
    rel_err,
)
from repo_paths import DEBUG_TOML, HELPERS, ROOT

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.models.common.norms.rmsnorm import CompiledRMSNorm, RMSNorm
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer

DEBUG_VOCAB = 2256


# --------------------------------------------------------------------------------------------
# compiled_rmsnorm == rmsnorm (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_matches_eager(dtype):
    eps = 1e-5
    for shape in [(4, 7, 96), (3, 96)]:
        x, weight, dy = random_case(shape, dtype)
        ref = module_values_and_grads(RMSNorm(96, eps), x, weight, dy)
        got = module_values_and_grads(CompiledRMSNorm(96, eps), x, weight, dy)
        for name, a, b in zip(("output", "grad x", "grad weight"), got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert rel_err(a, b) <= TOL[dtype], (shape, name, rel_err(a, b))


# --------------------------------------------------------------------------------------------
# fused_rmsnorm: the Triton kernel against rmsnorm (GPU, and CPU under TRITON_INTERPRET=1)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON),
    reason="needs a CUDA GPU" if not torch.cuda.is_available() else "needs triton",
)
def test_fused_kernel_on_gpu():
    for line in check_kernel("cuda"):
        print(line)


@pytest.mark.skipif(
    not HAS_TRITON,
    reason="triton is not installed here (kept out of the main venv on purpose); run this file "
    "in a venv with triton to check the kernel under TRITON_INTERPRET=1, see docs/norms.md",
)
def test_fused_kernel_under_triton_interpreter():
    """The same check on CPU tensors through Triton's interpreter; a subprocess, because the
    interpreter is chosen from the environment when triton compiles the kernels."""
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HELPERS)])
    )
    code = "import norm_checks; print('\\n'.join(norm_checks.check_kernel('cpu')))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert len(out.stdout.strip().splitlines()) == len(KERNEL_CASES)
    print(out.stdout)


# Compiled ahead of time for these GPUs (no GPU needed: Triton's CUDA backend and ptxas), with the
# launch parameters the launchers use for Llama widths.
CUDA_TARGETS = (80, 90)
COMPILE_FOR_CUDA = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torchtitan.models.common.norms import fused_kernels as K

n = 0
for arch in {archs}:
    for width in (2048, 4096, 5120, 16384):
        block, warps = K._block_and_warps(width)
        for x, w in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp32", "fp32")):
            y = "fp32" if "fp32" in (x, w) else x
            fwd = dict(X="*" + x, W="*" + w, Y="*" + y, RSTD="*fp32", N="i32", eps="fp32")
            bwd = dict(DY="*" + y, X="*" + x, W="*" + w, RSTD="*fp32", DX="*" + x,
                       DW_PARTIAL="*fp32", M="i32", N="i32", rows_per_program="i32")
            for fn, sig in ((K._rms_norm_fwd_kernel, fwd), (K._rms_norm_bwd_kernel, bwd)):
                src = ASTSource(fn=fn, signature=dict(sig, BLOCK_N="constexpr"),
                                constexprs={{"BLOCK_N": block}})
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options={{"num_warps": warps}})
                assert "cubin" in compiled.asm
                n += 1
print(n, "kernels compiled")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (with its CUDA backend and ptxas)")
def test_fused_kernels_compile_for_cuda():
    """Without a GPU, the kernels still go through Triton's whole CUDA pipeline down to a cubin
    (sm_80 and sm_90), for every dtype combination and a few Llama widths."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    code = COMPILE_FOR_CUDA.format(archs=CUDA_TARGETS)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert out.stdout.split()[0] == str(len(CUDA_TARGETS) * 4 * 4 * 2)


# --------------------------------------------------------------------------------------------
# preflight on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine reports")
def test_fused_rmsnorm_refused_on_cpu():
    from torchtitan.train.plan import plan_job

    expected = (
        "command line: --model.norm_type: fused_rmsnorm needs a CUDA GPU (Triton); use rmsnorm or "
        "compiled_rmsnorm on cpu"
    )
    cfg = parse_args(["--job.config_file", DEBUG_TOML, "--model.norm_type", "fused_rmsnorm"])
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=1)
    assert str(e.value) == expected
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            "--job.config_file",
            DEBUG_TOML,
            "--model.norm_type",
            "fused_rmsnorm",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"error: {expected}"], out.stderr


# --------------------------------------------------------------------------------------------
# the model: the same logits with every norm type
# --------------------------------------------------------------------------------------------


def build(norm_type: str, seed: int = 0) -> Transformer:
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=DEBUG_VOCAB, norm_type=norm_type
    )
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_model_logits_identical_across_norm_types():
    """Same weights (one state dict loads into every variant: same names and shapes), same
    logits. On CPU the fused variant runs its PyTorch path, so it is bit-identical too."""
    tokens = torch.randint(0, DEBUG_VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = build("rmsnorm")
    state = reference.state_dict()
    with torch.no_grad():
        expected = reference(tokens)
    for norm_type in ("compiled_rmsnorm", "fused_rmsnorm"):
        model = build(norm_type, seed=123)  # different init, then the reference's weights
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("norm")}
        assert kinds == {"CompiledRMSNorm" if norm_type == "compiled_rmsnorm" else "FusedRMSNorm"}
        assert model.state_dict().keys() == state.keys()
        model.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits = model(tokens)
        if norm_type == "fused_rmsnorm":
            assert torch.equal(logits, expected)
        else:  # torch.compile may reorder the float32 mean
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# tensor parallel (sequence-parallel norms get DTensors): 2 CPU processes over gloo
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fused_and_compiled_under_tensor_parallel():
    """Under TP=2 the debug model with fused_rmsnorm (its PyTorch path on CPU: the DTensor
    handling is the same as on a GPU) and with compiled_rmsnorm, eager and inside compiled
    blocks, matches one process with rmsnorm: logits and every gradient, norm weights included
    (whose gradients have the same placements as with rmsnorm)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HELPERS / "norms_tp_worker.py"),
        "--compiled-blocks",
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    results = [line.split() for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    variants = [
        f"{n}{b}" for n in ("fused_rmsnorm", "compiled_rmsnorm") for b in ("", "+compiled_blocks")
    ]
    assert sorted(r[1] for r in results) == sorted(variants), out.stdout
    for _, variant, logits_err, grad_err in results:
        assert float(logits_err) < 1e-5 and float(grad_err) < 1e-5, (variant, out.stdout)


# --------------------------------------------------------------------------------------------
# benchmarks/rmsnorm.py
# --------------------------------------------------------------------------------------------


def test_benchmark_script_json():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "rmsnorm.py"),
        "--shapes",
        "16x96",
        "--dtypes",
        "float32,bfloat16",
        "--impls",
        "rmsnorm",
        "--device",
        "cpu",
        "--min-run-time",
        "0.01",
        "--json",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [(r["implementation"], r["shape"], r["dtype"]) for r in rows] == [
        ("rmsnorm", [16, 96], "float32"),
        ("rmsnorm", [16, 96], "bfloat16"),
    ]
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["forward_gbps"] > 0
    if not torch.cuda.is_available():
        cmd = [sys.executable, str(ROOT / "benchmarks" / "rmsnorm.py"), "--impls", "fused_rmsnorm"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
