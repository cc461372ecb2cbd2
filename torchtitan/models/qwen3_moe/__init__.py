"""Qwen3-MoE: 30B-A3B and 235B-A22B, registered as the ``qwen3_moe`` family."""

from __future__ import annotations

from torchtitan.datasets import build_hf_dataloader
from torchtitan.datasets.hf_tokenizer import write_tokenizer_files
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import split_model
from torchtitan.lr_scheduling import build_lr_scheduler
from torchtitan.models.common.loss import cross_entropy_loss
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_configs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_moe.model import (
    Qwen3MoeModel,
    Qwen3MoeModelArgs,
    get_nparams_and_flops,
)
from torchtitan.optimizer import build_optimizer
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["Qwen3MoeModel", "Qwen3MoeModelArgs", "qwen3_moe_configs"]

register_train_spec(
    TrainSpec(
        name="qwen3_moe",
        cls=Qwen3MoeModel,
        flavors=qwen3_moe_configs,
        parallelize_fn=parallelize_qwen3,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_hf_dataloader,
        loss_fn=cross_entropy_loss,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        nparams_and_flops_fn=get_nparams_and_flops,
        pipelining_fn=split_model,
        state_dict_adapter=Qwen3MoeStateDictAdapter,
        export_tokenizer_fn=write_tokenizer_files,
    )
)
