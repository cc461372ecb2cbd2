"""RMSNorm implementations (model.norm_type): compiled and fused against the eager reference,
the fused kernel on a GPU and under Triton's interpreter, preflight, model wiring, and the fused
norm under tensor (sequence) parallel."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.config_manager import Model, parse_args
from torchtitan.errors import ConfigError
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.norms import (
    NORM_TYPES,
    CompiledRMSNorm,
    FusedRMSNorm,
    RMSNorm,
    build_norm,
    rms_norm,
)

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")
TOKENIZER = str(ROOT / "tests" / "assets" / "tokenizer" / "tiktoken.model")
DEBUG_VOCAB = 2256
HAS_TRITON = importlib.util.find_spec("triton") is not None

# Bound on max|actual - expected| / max|expected| against the eager reference in the same dtype:
# a couple of units in the last place of the dtype (the implementations differ in reduction order
# and in whether an intermediate is rounded to the storage dtype).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual.double() - expected).abs().max() / scale).item()


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function in float64 throughout, without rounding in between."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def values_and_grads(norm_fn, x, weight, dy):
    """``norm_fn(x, weight)`` and the gradients of ``<norm_fn(x, weight), dy>`` wrt x, weight."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    y = norm_fn(x, weight)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


def random_case(shape, dtype, weight_dtype=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    dim = shape[-1]
    # a non-zero mean and an uneven scale per row, a weight that is not all ones
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 3 + 0.5
    weight = 1 + 0.2 * torch.randn(dim, generator=g)
    dy = torch.randn(shape, generator=g)
    out_dtype = torch.promote_types(dtype, weight_dtype or dtype)
    return x.to(device, dtype), weight.to(device, weight_dtype or dtype), dy.to(device, out_dtype)


# --------------------------------------------------------------------------------------------
# compiled_rmsnorm == rmsnorm (CPU)
# --------------------------------------------------------------------------------------------


def module_values_and_grads(module, x, weight, dy):
    """The same through a norm module holding ``weight`` as its own parameter."""
    module = module.to(weight.device, weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    module.weight.grad = None
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad


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

# (leading shape + width, input dtype, weight dtype): widths that are not powers of two, one row,
# 3-D inputs, a weight in float32 under a bf16 input (autocast without FSDP), fp16
KERNEL_CASES = [
    ((4, 7, 96), torch.float32, None),
    ((4, 7, 96), torch.bfloat16, None),
    ((4, 7, 96), torch.float16, None),
    ((37, 200), torch.bfloat16, None),
    ((1, 4096), torch.float32, None),
    ((2, 33, 130), torch.bfloat16, torch.float32),
    ((16, 1000), torch.float16, torch.float32),
    ((5, 3), torch.float32, None),
]


def check_kernel(device: str) -> list[str]:
    """Run every case through the fused autograd function (Triton kernels) and the reference;
    assert and return one line per case with the errors relative to the reference's scale."""
    from torchtitan.models.fused_rmsnorm import fused_rms_norm, uses_triton

    eps = 1e-5
    lines = []
    for shape, dtype, weight_dtype in KERNEL_CASES:
        x, weight, dy = random_case(shape, dtype, weight_dtype, device=device)
        assert uses_triton(x), f"the Triton kernels do not run on {device} tensors here"
        got = values_and_grads(lambda x, w: fused_rms_norm(x, w, eps), x, weight, dy)
        ref = values_and_grads(lambda x, w: rms_norm(x, w, eps), x, weight, dy)
        # float64 ground truth: the kernel must be no less accurate than the reference (+ slack)
        gold = values_and_grads(
            lambda x, w: exact_rms_norm(x, w, eps), x.double(), weight.double(), dy.double()
        )
        errs = []
        for name, a, b, g in zip(("output", "grad_x", "grad_w"), got, ref, gold):
            assert a.dtype == b.dtype and a.shape == b.shape, (shape, name, a.dtype, b.dtype)
            err, err_ref, err_kernel = rel_err(a, b), rel_err(b, g), rel_err(a, g)
            tol = TOL[dtype]  # the normalized rows are rounded to the input's dtype
            assert err <= tol, (shape, dtype, name, err, tol)
            assert err_kernel <= 2 * err_ref + 1e-6, (shape, dtype, name, err_kernel, err_ref)
            errs.append(f"{name} {err:.1e} (exact: {err_kernel:.1e} vs {err_ref:.1e})")
        lines.append(f"{tuple(shape)} {dtype} w={weight_dtype or dtype}: " + ", ".join(errs))
    # the module, with the model's own parameter
    x, weight, dy = random_case((2, 3, 96), torch.bfloat16, device=device, seed=1)
    got = module_values_and_grads(FusedRMSNorm(96), x, weight, dy)
    ref = module_values_and_grads(RMSNorm(96), x, weight, dy)
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= TOL[torch.bfloat16]
    return lines


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
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_norms; "
        "print('\\n'.join(test_norms.check_kernel('cpu')))"
    )
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
from torchtitan.models import fused_rmsnorm_kernels as K

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


def test_fused_off_cuda_computes_the_same_math():
    """Without CUDA or the interpreter the fused ops run PyTorch operations (the path used by
    the CPU tests of the wiring): same results, and shapes only on meta tensors."""
    from torchtitan.models.fused_rmsnorm import fused_rms_norm, uses_triton

    for dtype in (torch.float32, torch.bfloat16):
        x, weight, dy = random_case((4, 7, 96), dtype)
        if uses_triton(x):
            pytest.skip("TRITON_INTERPRET=1 is set: the kernel itself runs on CPU tensors")
        got = values_and_grads(lambda x, w: fused_rms_norm(x, w, 1e-5), x, weight, dy)
        ref = values_and_grads(lambda x, w: rms_norm(x, w, 1e-5), x, weight, dy)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and rel_err(a, b) <= TOL[dtype]
    x = torch.empty(2, 5, 96, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(96, device="meta", requires_grad=True)
    y = fused_rms_norm(x, weight, 1e-5)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad.shape == x.shape and weight.grad.shape == (96,)


# --------------------------------------------------------------------------------------------
# configuration and preflight
# --------------------------------------------------------------------------------------------


def test_config_key_and_model_args_agree():
    f = {f.name: f for f in dataclasses.fields(Model)}["norm_type"]
    assert f.default == "rmsnorm" and tuple(f.metadata["choices"]) == NORM_TYPES
    assert ModelArgs().norm_type == "rmsnorm"
    with pytest.raises(ValueError, match="norm_type 'layernorm' is not one of"):
        ModelArgs(norm_type="layernorm")


def test_bad_norm_type_is_one_line():
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.tokenizer_path", TOKENIZER, "--model.norm_type", "layernorm"])
    assert str(e.value) == (
        "command line: --model.norm_type: 'layernorm' is not one of: rmsnorm, compiled_rmsnorm, "
        "fused_rmsnorm"
    )


def test_preflight_passes_norm_type_to_model_args():
    from torchtitan.job_plan import plan_job

    for norm_type in ("rmsnorm", "compiled_rmsnorm"):
        cfg = parse_args(["--job.config_file", DEBUG_TOML, "--model.norm_type", norm_type])
        assert plan_job(cfg, world_size=1).model_args.norm_type == norm_type
    # the flavor table itself is not modified
    assert llama3_configs["debugmodel"].norm_type == "rmsnorm"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine reports")
def test_fused_rmsnorm_refused_on_cpu():
    from torchtitan.job_plan import plan_job

    expected = (
        "command line: --model.norm_type: fused_rmsnorm needs a CUDA GPU (Triton); use rmsnorm or "
        "compiled_rmsnorm on cpu"
    )
    cfg = parse_args(["--job.config_file", DEBUG_TOML, "--model.norm_type", "fused_rmsnorm"])
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=1)
    assert str(e.value) == expected
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", "--job.config_file", DEBUG_TOML,
         "--model.norm_type", "fused_rmsnorm"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"error: {expected}"], out.stderr


# --------------------------------------------------------------------------------------------
# the model
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


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_factory_keeps_the_parameter(norm_type):
    norm = build_norm(norm_type, 64, 1e-6)
    assert isinstance(norm, RMSNorm) and norm.eps == 1e-6
    assert [(n, tuple(p.shape)) for n, p in norm.named_parameters()] == [("weight", (64,))]
    with torch.no_grad():
        norm.weight.mul_(3)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(64))


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "norms_tp_worker.py"), "--compiled-blocks"]  # fmt: skip
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
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "rmsnorm.py"), "--shapes", "16x96",
           "--dtypes", "float32,bfloat16", "--impls", "rmsnorm", "--device", "cpu",
           "--min-run-time", "0.01", "--json"]  # fmt: skip
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
