"""Llama 2 and Llama 3 (3.1, 3.2): one implementation, two registered families."""

from __future__ import annotations

from torchtitan.datasets import build_hf_dataloader
from torchtitan.datasets.hf_tokenizer import write_tokenizer_files
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import split_model
from torchtitan.lr_scheduling import build_lr_scheduler
from torchtitan.models.common.loss import cross_entropy_loss
from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
from torchtitan.models.llama.model import ModelArgs, Transformer, get_nparams_and_flops
from torchtitan.models.llama.parallelize import parallelize_llama
from torchtitan.optimizer import build_optimizer
from torchtitan.train_spec import TrainSpec, register_train_spec

__all__ = ["ModelArgs", "Transformer"]


for _name, _flavors in (("llama2", llama2_configs), ("llama3", llama3_configs)):
    register_train_spec(
        TrainSpec(
            name=_name,
            cls=Transformer,
            flavors=_flavors,
            parallelize_fn=parallelize_llama,
            build_tokenizer_fn=build_tokenizer,
            build_dataloader_fn=build_hf_dataloader,
            loss_fn=cross_entropy_loss,
            build_optimizer_fn=build_optimizer,
            build_lr_scheduler_fn=build_lr_scheduler,
            nparams_and_flops_fn=get_nparams_and_flops,
            pipelining_fn=split_model,
            state_dict_adapter=LlamaStateDictAdapter,
            export_tokenizer_fn=write_tokenizer_files,
        )
    )
