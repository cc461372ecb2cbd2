"""gpt-oss weights in the layout of Hugging Face ``transformers`` (``GptOssForCausalLM``), and back.

Names: ``layers.N.attention.wq/wk/wv/wo`` (weights and biases) <-> ``model.layers.N.self_attn.
q_proj/k_proj/v_proj/o_proj``, ``attention.sinks`` <-> ``self_attn.sinks``, ``moe.router.gate``
(weight and bias) <-> ``mlp.router``, the norms as Qwen3's, and the stacked experts:
``moe.experts.w1/w3 [E, I, D]`` <-> ``mlp.experts.gate_up_proj [E, D, 2I]`` (transposed, gate and
up **interleaved**: column ``2j`` is gate unit ``j``, ``2j + 1`` up unit ``j``), ``w1_bias/w3_bias [E, I]``
<-> ``gate_up_proj_bias [E, 2I]`` (interleaved), ``w2 [E, D, I]`` <-> ``down_proj [E, I, D]``,
``w2_bias`` <-> ``down_proj_bias``. The load-balancing ``moe.expert_bias`` has no counterpart (zero
on import, left out on export).

The published checkpoints store the two expert weights in MXFP4 (``gate_up_proj_blocks`` and
``_scales``, ...): ``checkpoint/hf_files.py`` dequantizes them to bfloat16 in this layout as it
reads the folder. An export writes bfloat16 (or the training dtype), without a
``quantization_config``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.hf_adapter import HFStateDictAdapter
from torchtitan.models.gpt_oss.model import (
    LAYER_TYPES,
    GptOssModelArgs,
    default_layer_types,
    gpt_oss_moe,
)
from torchtitan.observability.log import logger

__all__ = ["GptOssStateDictAdapter"]

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj(?:_bias)?)$")
# the halves of gate_up_proj (and its bias) between the conversion by name and the interleave
_HALVES = {
    "gate_up_proj": ("gate_proj_stacked", "up_proj_stacked"),
    "gate_up_proj_bias": ("gate_proj_bias_stacked", "up_proj_bias_stacked"),
}


class GptOssStateDictAdapter(HFStateDictAdapter):
    model_type = "gpt_oss"
    not_in_hf = ("moe.expert_bias",)
    layer_names = {
        **{
            f"attention.w{x}.{kind}": f"self_attn.{x}_proj.{kind}"
            for x in "qkvo"
            for kind in ("weight", "bias")
        },
        "attention.sinks": "self_attn.sinks",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
        "moe.experts.w1": "mlp.experts.gate_proj_stacked",
        "moe.experts.w3": "mlp.experts.up_proj_stacked",
        "moe.experts.w1_bias": "mlp.experts.gate_proj_bias_stacked",
        "moe.experts.w3_bias": "mlp.experts.up_proj_bias_stacked",
        "moe.experts.w2": "mlp.experts.down_proj",
        "moe.experts.w2_bias": "mlp.experts.down_proj_bias",
    }
    fused = {
        **HFStateDictAdapter.fused,
        "attention.wqkv.bias": ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias"),
    }

    def tensor_to_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2) if re.search(r"\.moe\.experts\.w\d$", name) else w

    tensor_from_hf = tensor_to_hf

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As the generic conversion, then each layer's gate and up halves interleaved into
        ``gate_up_proj`` (and its bias)."""
        out = super().to_hf(state)
        for fused, (gate_name, up_name) in _HALVES.items():
            for name in [n for n in out if n.endswith("." + gate_name)]:
                prefix = name[: -len(gate_name)]
                gate, up = out.pop(name), out.pop(prefix + up_name)
                out[prefix + fused] = torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
        return out

    def from_hf(
        self, hf_state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
    ) -> dict[str, torch.Tensor]:
        """Each ``gate_up_proj`` (and bias) cut into its gate (even) and up (odd) columns, then
        the generic conversion."""
        split: dict[str, torch.Tensor] = {}
        for name, w in hf_state.items():
            m = _EXPERTS.match(name)
            if m is None:
                split[name] = w
                continue
            gate_name, up_name = _HALVES[m.group(2)]
            split[m.group(1) + gate_name], split[m.group(1) + up_name] = w[..., 0::2], w[..., 1::2]
        return super().from_hf(split, expected)

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``GptOssForCausalLM`` (the keys of the published configs; the
        weights are not quantized, so no ``quantization_config``)."""
        a, moe = self.args, self.args.moe
        logger.info("gpt-oss export: expert weights in %s, not MXFP4", dtype)
        config = self.shared_config(
            intermediate_size=moe.hidden_dim, dtype=dtype, bos_id=bos_id, eos_id=eos_id
        )
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            **config,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "experts_per_token": moe.top_k,
            "swiglu_limit": moe.swiglu_limit,
            "sliding_window": a.sliding_window,
            "layer_types": list(a.kinds()),
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": a.rope_factor,
                "beta_fast": a.rope_beta_fast,
                "beta_slow": a.rope_beta_slow,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
                "truncate": a.rope_truncate,
            },
            "initial_context_length": a.rope_original_max_seq_len,
            "router_aux_loss_coef": moe.aux_loss_coeff or 0.9,
            "output_router_logits": False,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    @classmethod
    def args_from_hf_config(cls, config: dict) -> GptOssModelArgs:
        """Our hyper-parameters from a gpt-oss ``config.json`` (``rope_scaling`` and
        ``rope_theta`` as published, or transformers 5's ``rope_parameters``)."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        _refuse_unsupported(config, rope)
        try:
            n_experts = config.get("num_local_experts", config.get("num_experts"))
            top_k = config.get("num_experts_per_tok", config.get("experts_per_token"))
            moe = gpt_oss_moe(int(n_experts), int(top_k), int(config["intermediate_size"]))
            moe.swiglu_limit = float(config.get("swiglu_limit", 7.0))
            moe.swiglu_alpha = float(config.get("swiglu_alpha", 1.702))
            layer_types = config.get("layer_types")
            n_layers = int(config["num_hidden_layers"])
            if layer_types and tuple(layer_types) == default_layer_types(n_layers):
                layer_types = None  # the published alternation, which any n_layers keeps
            return GptOssModelArgs(
                dim=int(config["hidden_size"]),
                n_layers=n_layers,
                n_heads=int(config["num_attention_heads"]),
                n_kv_heads=int(config["num_key_value_heads"]),
                head_dim=int(config.get("head_dim", 64)),
                vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 150000.0),
                rope_factor=float(rope.get("factor", 32.0)),
                rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 4096)),
                rope_beta_fast=float(rope.get("beta_fast", 32.0)),
                rope_beta_slow=float(rope.get("beta_slow", 1.0)),
                # transformers reads a missing truncate as true (modeling_rope_utils)
                rope_truncate=bool(rope.get("truncate", True)),
                max_seq_len=int(config.get("max_position_embeddings", 131072)),
                sliding_window=int(config.get("sliding_window") or 128),
                layer_types=tuple(layer_types) if layer_types else None,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                moe=moe,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a gpt-oss config this model can build ({e!r})"
            ) from e


def _refuse_unsupported(config: dict, rope: dict[str, Any]) -> None:
    unsupported = []
    if config.get("attention_bias") is False:
        unsupported.append("attention_bias false")
    rope_type = rope.get("rope_type", rope.get("type", "yarn"))
    if rope_type != "yarn":
        unsupported.append(f"rope type {rope_type!r} (gpt-oss uses yarn)")
    bad_types = sorted(set(config.get("layer_types") or ()) - set(LAYER_TYPES))
    if bad_types:
        unsupported.append(f"layer_types {bad_types} (valid: {', '.join(LAYER_TYPES)})")
    if unsupported:
        raise HFFormatError(
            "config.json: this gpt-oss model does not implement " + ", ".join(unsupported)
        )
