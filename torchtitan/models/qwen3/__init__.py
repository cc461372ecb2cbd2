"""Qwen3 (dense): 0.6B to 32B, registered as the ``qwen3`` family."""

from __future__ import annotations

from torchtitan.datasets import build_hf_dataloader
from torchtitan.datasets.hf_tokenizer import write_tokenizer_files
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import split_model
from torchtitan.lr_scheduling import build_lr_scheduler
from torchtitan.models.common.loss import cross_entropy_loss
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3ModelArgs, get_nparams_and_flops
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.optimizer import build_optimizer
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "qwen3_configs"]

register_train_spec(
    TrainSpec(
        name="qwen3",
        cls=Qwen3Model,
        flavors=qwen3_configs,
        parallelize_fn=parallelize_qwen3,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_hf_dataloader,
        loss_fn=cross_entropy_loss,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        nparams_and_flops_fn=get_nparams_and_flops,
        pipelining_fn=split_model,
        state_dict_adapter=Qwen3StateDictAdapter,
        export_tokenizer_fn=write_tokenizer_files,
    )
)
