"""The train spec of a decoder family built on ``models/common``: the family gives what is its
own (model class, flavors, tensor-parallel plan, Hugging Face adapter), and the builders every
such family shares are filled in (tokenizers, the data loader, cross entropy, the optimizer and
LR schedule, FLOPs from the active parameters, the pipeline split, tokenizer files for an
export). A family that needs another loss or optimizer passes it by keyword."""

from __future__ import annotations

from typing import Any

from torchtitan.data import build_hf_dataloader
from torchtitan.data.hf_tokenizer import write_tokenizer_files
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed.pipeline import split_model
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.loss import cross_entropy_loss
from torchtitan.optim.lr_scheduling import build_lr_scheduler
from torchtitan.optim.optimizers import build_optimizer
from torchtitan.train.spec import TrainSpec, register_train_spec

__all__ = ["register_decoder_family"]


def register_decoder_family(
    name: str, cls: type, flavors: dict[str, Any], parallelize_fn: Any, adapter: type, **own: Any
) -> TrainSpec:
    """Register (and return) the family ``name``; ``own`` replaces any shared builder."""
    spec = TrainSpec(
        **{
            "name": name,
            "cls": cls,
            "flavors": flavors,
            "parallelize_fn": parallelize_fn,
            "state_dict_adapter": adapter,
            "build_tokenizer_fn": build_tokenizer,
            "build_dataloader_fn": build_hf_dataloader,
            "loss_fn": cross_entropy_loss,
            "build_optimizer_fn": build_optimizer,
            "build_lr_scheduler_fn": build_lr_scheduler,
            "nparams_and_flops_fn": get_nparams_and_flops,
            "pipelining_fn": split_model,
            "export_tokenizer_fn": write_tokenizer_files,
            **own,
        }
    )
    register_train_spec(spec)
    return spec
