"""RMSNorm numerics shared by tests/unit/models/test_norms.py and tests/e2e/test_norms.py: random cases,
outputs and gradients of a norm, the relative error against the eager reference, and the check of
the fused Triton kernels (``check_kernel``: in-process on a GPU, and on CPU tensors in a process
started with ``TRITON_INTERPRET=1``, with this folder on ``PYTHONPATH``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from torchtitan.models.common.norms.rmsnorm import FusedRMSNorm, RMSNorm, rms_norm

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Autouse in the modules that import it: the norms compute on one CPU thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Bound on max|actual - expected| / max|expected| against the eager reference in the same dtype:
# a couple of units in the last place of the dtype (the implementations differ in reduction order
# and in whether an intermediate is rounded to the storage dtype).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


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
    from torchtitan.models.common.norms.fused import fused_rms_norm, uses_triton

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
