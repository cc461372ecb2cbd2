"""Float8 training of linear layers through torchao (``model.converters = ["float8"]``).

The converter swaps ``nn.Linear`` modules for torchao's ``Float8Linear`` on the meta-device model,
before any parallelism is applied, so that FSDP2 can all-gather the float8 weights when
``float8.enable_fsdp_float8_all_gather`` is set, and tensor parallel can give those linears
torchao's float8 styles (:func:`tp_styles`, used by ``distributed.tensor_parallel.apply_tp``). The matmuls
need float8 tensor cores: CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell). On CPU,
torch builds whose ``torch._scaled_mm`` has a CPU kernel (2.13 does) run the same code very
slowly, which is enough to check numerics at toy sizes without a GPU. Requirements are checked by preflight, before any process starts, so an
unsupported machine or a missing ``torchao`` ends with one clear line.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn as nn

from torchtitan.config.schema import Float8
from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import ConfigError
from torchtitan.observability.log import logger

CONVERTERS = ("float8",)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def check_converters(converters: list[str], f8: Float8, device_type: str) -> None:
    """Raise ConfigError unless every ``model.converters`` entry can run on ``device_type``
    (this machine's, or the CUDA target a job is checked for from a machine without a GPU).

    Any ``tp`` degree works: tensor parallel takes torchao's float8 styles with the tensorwise
    recipe and the plain ones with rowwise recipes (``distributed.tensor_parallel.apply_tp``).
    """
    for name in converters:
        if name not in CONVERTERS:
            raise ConfigError(
                f"model.converters: unknown converter '{name}'; valid: {', '.join(CONVERTERS)}"
            )
    if "float8" not in converters:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "model.converters: float8 needs torchao, which is not installed: pip install torchao"
        )
    if device_type == "cuda" and torch.cuda.is_available() and not f8.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"model.converters: float8 needs CUDA compute capability >= 8.9; this GPU has "
                f"{major}.{minor}: remove 'float8' from model.converters"
            )
    elif device_type != "cuda" and not f8.emulate and not cpu_float8_matmul_works():
        raise ConfigError(
            f"model.converters: float8 needs a CUDA GPU with compute capability >= 8.9 (e.g. H100) "
            f"or a torch whose CPU build has float8 matmuls (torch._scaled_mm); this {device_type} "
            f"with torch {torch.__version__} has neither: remove 'float8' from model.converters "
            f"or set float8.emulate"
        )
    if f8.recipe_name != "tensorwise" and f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather: needs float8.recipe_name = 'tensorwise' "
            f"(got '{f8.recipe_name}')"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp: needs "
            "float8.enable_fsdp_float8_all_gather = true"
        )


def tensorwise_tp(converters: list[str], f8: Float8) -> bool:
    """Whether tensor parallel should use torchao's float8 styles (float8 all-gathers).

    Only with the tensorwise recipe: its one dynamic scale per tensor is what torchao's float8 TP
    styles compute across the shards. Rowwise recipes keep the plain TP styles, so activations
    are all-gathered in high precision and each ``Float8Linear`` casts its own DTensor inputs.
    """
    return "float8" in converters and f8.recipe_name == "tensorwise"


def is_float8_linear(module: nn.Module) -> bool:
    """A linear that the converter swapped (``filter_fqns`` and odd sizes stay ``nn.Linear``)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def tp_styles():
    """torchao's float8 versions of ``(ColwiseParallel, RowwiseParallel, PrepareModuleInput)``.

    Each casts its input to float8 with a tensorwise scale before the redistribution, so the
    sequence-parallel all-gathers move float8 bytes; the prepare style casts a block input once
    for all the linears that read it (attention's wqkv, the feed-forward's w1/w3).
    """
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    _gather_cpu_float8_as_bytes()
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _gather_cpu_float8_as_bytes() -> None:
    """Let gloo all-gather float8 activations: it has no float8 dtypes ("Invalid scalar type").

    torchao all-gathers a float8 tensor's data as is, which NCCL can do. For CPU tensors this
    wraps torchao's handler so that the same bytes travel as ``uint8`` and are viewed back as
    float8: the gathered values are bit-identical, only the dtype gloo sees differs. CUDA tensors
    go to torchao's handler unchanged. (FSDP2's float8 all-gather already sends bytes.)
    """
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    ops = (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops.c10d_functional.all_gather_into_tensor.default,
    )
    for op in ops:
        torchao_gather = float8_ops.FLOAT8_OPS_TABLE.get(op)
        if torchao_gather is None or getattr(torchao_gather, "gathers_cpu_bytes", False):
            continue

        def gather(aten_op, args, kwargs=None, torchao_gather=torchao_gather):
            t = args[0]
            if t._data.device.type != "cpu":
                return torchao_gather(aten_op, args, kwargs)
            data = aten_op(t._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
            return Float8TrainingTensor(
                data.view(t._data.dtype),
                t._scale,
                t._orig_dtype,
                t._linear_mm_config,
                t._gemm_input_role,
            )

        gather.gathers_cpu_bytes = True
        float8_ops.FLOAT8_OPS_TABLE[op] = gather


def cpu_float8_matmul_works() -> bool:
    """Whether this torch's CPU build runs ``torch._scaled_mm`` on float8 inputs (2.13 does).

    On CPU float8 training is slower than float32, but it runs the same torchao code, so the
    numerics (loss behaviour, FSDP float8 all-gather) can be checked without a GPU.
    """
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    return True


def _float8_config(f8: Float8):
    from torchao.float8 import Float8LinearConfig

    if f8.recipe_name == "tensorwise":
        return Float8LinearConfig(
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather, emulate=f8.emulate
        )
    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(f8.recipe_name), emulate=f8.emulate
    )


def apply_converters(model: nn.Module, converters: list[str], f8: Float8) -> None:
    """Swap modules in place as ``model.converters`` asks (checked earlier by preflight)."""
    if "float8" not in converters:
        return
    from torchao.float8 import convert_to_float8_training

    skip = set(f8.filter_fqns)

    def keep(module: nn.Module, fqn: str) -> bool:
        # float8 matmuls need both dimensions divisible by 16; the output layer stays high precision
        if not isinstance(module, nn.Linear) or fqn in skip:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=_float8_config(f8), module_filter_fn=keep)
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    logger.info(
        f"Float8 training ({f8.recipe_name} scaling) on {n} linear layers; "
        f"skipped: {', '.join(sorted(skip)) or 'none'}"
    )
    if f8.emulate:
        logger.info(
            "Float8 matmuls emulated in high precision (float8.emulate): casts and scales "
            "as on a GPU, the matmul itself in float32"
        )
    elif dist_utils.device_type != "cuda":
        logger.warning(
            "Float8 on CPU runs torch's CPU float8 matmul (no faster than float32 here): use it "
            "to check a config's numerics at small sizes (see docs/performance.md), not to train"
        )


def after_optimizer_step(model_parts: list[nn.Module], converters: list[str], f8: Float8) -> None:
    """With float8 FSDP all-gather, compute the next step's weight scales in one fused pass."""
    if "float8" in converters and f8.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
