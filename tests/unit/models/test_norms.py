"""RMSNorm implementations (model.norm_type), in-process and without compiling: the fused norm off
CUDA (its PyTorch path) against the eager reference, the configuration key and preflight, and the
norm factory. What compiles (``torch.compile`` starts the C++ compiler on CPU, Triton's CUDA
backend ptxas), runs under Triton's interpreter, under tensor parallel or runs the benchmark
script is in tests/e2e/test_norms.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from norm_checks import (
    TOL,
    one_cpu_thread,  # noqa: F401  (autouse fixture)
    random_case,
    rel_err,
    values_and_grads,
)
from repo_paths import DEBUG_TOML, TOKENIZER

from torchtitan.config.parse import parse_args
from torchtitan.config.schema import Model
from torchtitan.errors import ConfigError
from torchtitan.models.common.norms.rmsnorm import NORM_TYPES, RMSNorm, build_norm, rms_norm
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import ModelArgs

# --------------------------------------------------------------------------------------------
# fused_rmsnorm off CUDA: PyTorch operations, the same math as rmsnorm
# --------------------------------------------------------------------------------------------


def test_fused_off_cuda_computes_the_same_math():
    """Without CUDA or the interpreter the fused ops run PyTorch operations (the path used by
    the CPU tests of the wiring): same results, and shapes only on meta tensors."""
    from torchtitan.models.common.norms.fused import fused_rms_norm, uses_triton

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
    from torchtitan.train.plan import plan_job

    for norm_type in ("rmsnorm", "compiled_rmsnorm"):
        cfg = parse_args(["--job.config_file", DEBUG_TOML, "--model.norm_type", norm_type])
        assert plan_job(cfg, world_size=1).model_args.norm_type == norm_type
    # the flavor table itself is not modified
    assert llama3_configs["debugmodel"].norm_type == "rmsnorm"


# --------------------------------------------------------------------------------------------
# the norm factory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_factory_keeps_the_parameter(norm_type):
    norm = build_norm(norm_type, 64, 1e-6)
    assert isinstance(norm, RMSNorm) and norm.eps == 1e-6
    assert [(n, tuple(p.shape)) for n, p in norm.named_parameters()] == [("weight", (64,))]
    with torch.no_grad():
        norm.weight.mul_(3)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(64))
