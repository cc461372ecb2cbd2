"""Llama 4 (text): Scout 17Bx16E and Maverick 17Bx128E, registered as the ``llama4`` family."""

from __future__ import annotations

from torchtitan.datasets import build_hf_dataloader
from torchtitan.datasets.hf_tokenizer import write_tokenizer_files
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import split_model
from torchtitan.lr_scheduling import build_lr_scheduler
from torchtitan.models.common.loss import cross_entropy_loss
from torchtitan.models.llama.parallelize import parallelize_llama
from torchtitan.models.llama4.flavors import llama4_configs
from torchtitan.models.llama4.hf_adapter import Llama4StateDictAdapter
from torchtitan.models.llama4.model import Llama4Model, Llama4ModelArgs, get_nparams_and_flops
from torchtitan.optimizer import build_optimizer
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["Llama4Model", "Llama4ModelArgs", "llama4_configs"]

register_train_spec(
    TrainSpec(
        name="llama4",
        cls=Llama4Model,
        flavors=llama4_configs,
        parallelize_fn=parallelize_llama,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_hf_dataloader,
        loss_fn=cross_entropy_loss,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        nparams_and_flops_fn=get_nparams_and_flops,
        pipelining_fn=split_model,
        state_dict_adapter=Llama4StateDictAdapter,
        export_tokenizer_fn=write_tokenizer_files,
    )
)
