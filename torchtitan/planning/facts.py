"""The counts the cost model reads, from the model's description on the meta device: parameters
(the blocks' and the rest), training FLOPs per token and the attention's part of them (the
same function MFU uses), the widths, and the mixture-of-experts blocks."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.planning.cost import ModelFacts


def model_facts(spec: Any, model_args: Any, seq_len: int, name: str) -> ModelFacts:
    """``spec``: the family's model spec; ``model_args`` with the job's vocabulary."""
    args = dataclasses.replace(model_args, max_seq_len=seq_len)
    with torch.device("meta"):
        model = spec.cls(args)
    count = spec.nparams_and_flops or get_nparams_and_flops
    nparams, flops = count(model, args, seq_len)
    _, flops_no_attention = count(model, args, 0)  # the attention term is linear in seq_len
    layers = list(model.layers.values() if hasattr(model.layers, "values") else model.layers)
    layer_params = sum(p.numel() for block in layers for p in block.parameters())
    moe_layers = sum(any(type(m).__name__ == "MoE" for m in block.modules()) for block in layers)
    experts = sum(
        p.numel()
        for m in model.modules()
        if type(m).__name__ == "MoE"
        for p in m.experts.parameters()
    )
    moe = getattr(args, "moe", None)
    hidden = moe.hidden_dim if moe is not None and moe_layers else _dense_hidden(layers[0])
    head_dim = getattr(args, "head_dim", args.dim // args.n_heads)
    n_kv = getattr(args, "n_kv_heads", None) or args.n_heads
    return ModelFacts(
        name=name,
        parameters=nparams,
        flops_per_token=flops,
        attention_flops_per_token=flops - flops_no_attention,
        n_layers=len(layers),
        dim=args.dim,
        hidden_dim=hidden,
        vocab_size=args.vocab_size,
        kv_width=n_kv * head_dim,
        layer_parameters=layer_params,
        outer_parameters=nparams - layer_params,
        output_flops_per_token=6 * args.dim * args.vocab_size,
        moe_layers=moe_layers,
        top_k=moe.top_k if moe is not None and moe_layers else 0,
        expert_parameters=experts,
    )


def _dense_hidden(block: torch.nn.Module) -> int:
    """The widest linear's output width of a block's feed-forward (SwiGLU's hidden width)."""
    widths = [
        m.out_features
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and "attention" not in name
    ]
    return max(widths) if widths else 0
