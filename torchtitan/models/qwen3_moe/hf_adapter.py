"""Qwen3-MoE weights in the layout of Hugging Face ``transformers`` (``Qwen3MoeForCausalLM``), and
back.

As Qwen3's (``qwen3/hf_adapter.py``), plus the MoE layers: ``moe.router.gate`` <-> ``mlp.gate``,
and the stacked experts ``moe.experts.w1/w3/w2 [E, ...]`` <-> one tensor per expert,
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (the layout of the published safetensors,
which ``transformers`` 5 fuses when it loads them). The load-balancing ``moe.expert_bias`` has no
Hugging Face counterpart: an import starts it at zero, an export leaves it out.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3_moe.model import Qwen3MoeModelArgs

__all__ = ["Qwen3MoeStateDictAdapter"]

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    model_type = "qwen3_moe"
    not_in_hf = ("moe.expert_bias",)

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        n = args.moe.num_experts if args.moe is not None else 0  # a dense subclass: none
        self.layer_names = {
            **Qwen3StateDictAdapter.layer_names,
            "moe.router.gate.weight": "mlp.gate.weight",
            **{
                f"moe.experts.{ours}.{e}": f"mlp.experts.{e}.{theirs}.weight"
                for ours, theirs in _EXPERT_NAMES.items()
                for e in range(n)
            },
        }
        self.fused = {
            **Qwen3StateDictAdapter.fused,
            **{
                f"moe.experts.{w}": tuple(f"moe.experts.{w}.{e}" for e in range(n))
                for w in _EXPERT_NAMES
            },
        }

    def split_tensor(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if ".moe.experts." in name:
            return w.unbind(0)
        return super().split_tensor(name, w)

    def merge_tensors(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if ".moe.experts." in name:
            return torch.stack(parts)
        return super().merge_tensors(name, parts)

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``Qwen3MoeForCausalLM`` (the keys of the published configs)."""
        moe = self.args.moe
        config = super().hf_config(dtype=dtype, bos_id=bos_id, eos_id=eos_id)
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            moe_intermediate_size=moe.hidden_dim,
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            norm_topk_prob=moe.route_norm,
            decoder_sparse_step=moe.every,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=moe.aux_loss_coeff or 0.001,
        )
        return config

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Qwen3MoeModelArgs:
        """Our hyper-parameters from a ``transformers`` Qwen3-MoE ``config.json``."""
        if config.get("mlp_only_layers"):
            raise HFFormatError(
                "config.json: this Qwen3-MoE model does not implement mlp_only_layers "
                f"{config['mlp_only_layers']} (dense layers are every decoder_sparse_step-th only)"
            )
        dense = Qwen3StateDictAdapter.args_from_hf_config(config)
        config = {"num_experts": config.get("num_local_experts"), **config}  # transformers 5
        missing = [
            k
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
            if config.get(k) is None
        ]
        if missing:
            raise HFFormatError(f"config.json: a Qwen3-MoE config needs {', '.join(missing)}")
        try:
            moe = MoEArgs(
                num_experts=int(config["num_experts"]),
                top_k=int(config["num_experts_per_tok"]),
                hidden_dim=int(config["moe_intermediate_size"]),
                score_func="softmax",
                route_norm=bool(config.get("norm_topk_prob", False)),
                every=int(config.get("decoder_sparse_step", 1)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a Qwen3-MoE config this model can build ({e!r})"
            ) from e
        return Qwen3MoeModelArgs(**{**vars(dense), "moe": moe})
