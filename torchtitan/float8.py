"""Float8 training of linear layers through torchao (``model.converters = ["float8"]``).

The converter swaps ``nn.Linear`` modules for torchao's ``Float8Linear`` on the meta-device model,
before any parallelism is applied, so that FSDP2 can all-gather the float8 weights when
``float8.enable_fsdp_float8_all_gather`` is set. The matmuls need float8 tensor cores: CUDA compute
capability 8.9 or newer (Ada, Hopper, Blackwell). On CPU, torch builds whose ``torch._scaled_mm``
has a CPU kernel (2.13 does) run the same code very slowly, which is enough to check numerics at
toy sizes without a GPU. Requirements are checked by preflight, before any process starts, so an
unsupported machine or a missing ``torchao`` ends with one clear line.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

from torchtitan import utils
from torchtitan.config_manager import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.log import logger

CONVERTERS = ("float8",)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def check_converters(job_config: JobConfig, device_type: str, tp: int) -> None:
    """Raise ConfigError unless every ``model.converters`` entry can run on this machine."""
    for name in job_config.model.converters:
        if name not in CONVERTERS:
            raise ConfigError(
                f"model.converters: unknown converter '{name}'; valid: {', '.join(CONVERTERS)}"
            )
    if "float8" not in job_config.model.converters:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "model.converters: float8 needs torchao, which is not installed: pip install torchao"
        )
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"model.converters: float8 needs CUDA compute capability >= 8.9; this GPU has "
                f"{major}.{minor}: remove 'float8' from model.converters"
            )
    elif not cpu_float8_matmul_works():
        raise ConfigError(
            f"model.converters: float8 needs a CUDA GPU with compute capability >= 8.9 (e.g. H100) "
            f"or a torch whose CPU build has float8 matmuls (torch._scaled_mm); this {device_type} "
            f"with torch {torch.__version__} has neither: remove 'float8' from model.converters"
        )
    f8 = job_config.float8
    if tp > 1:
        raise ConfigError(
            "model.converters: float8 with parallelism.tensor_parallel_degree > 1 is not supported "
            "in this version; use float8 with FSDP/HSDP/PP, or drop it"
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


def _float8_config(job_config: JobConfig):
    from torchao.float8 import Float8LinearConfig

    f8 = job_config.float8
    if f8.recipe_name == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather)
    return Float8LinearConfig.from_recipe_name(f8.recipe_name)


def apply_converters(model: nn.Module, job_config: JobConfig) -> None:
    """Swap modules in place as ``model.converters`` asks (checked earlier by preflight)."""
    if "float8" not in job_config.model.converters:
        return
    from torchao.float8 import convert_to_float8_training

    skip = set(job_config.float8.filter_fqns)

    def keep(module: nn.Module, fqn: str) -> bool:
        # float8 matmuls need both dimensions divisible by 16; the output layer stays high precision
        if not isinstance(module, nn.Linear) or fqn in skip:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=_float8_config(job_config), module_filter_fn=keep)
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    logger.info(
        f"Float8 training ({job_config.float8.recipe_name} scaling) on {n} linear layers; "
        f"skipped: {', '.join(sorted(skip)) or 'none'}"
    )
    if utils.device_type != "cuda":
        logger.warning(
            "Float8 on CPU runs torch's reference float8 matmul (~0.1 GFLOP/s): use it to check "
            "a config's numerics at toy sizes (see docs/performance.md), not to train"
        )


def after_optimizer_step(model_parts: list[nn.Module], job_config: JobConfig) -> None:
    """With float8 FSDP all-gather, compute the next step's weight scales in one fused pass."""
    f8 = job_config.float8
    if "float8" in job_config.model.converters and f8.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
