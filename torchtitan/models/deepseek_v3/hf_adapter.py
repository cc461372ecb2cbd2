"""DeepSeek-V3 weights in the layout of Hugging Face ``transformers`` (``DeepseekV3ForCausalLM``),
and back.

Names: ``attention.wq`` or ``wq_a``/``q_norm``/``wq_b`` <-> ``self_attn.q_proj`` or
``q_a_proj``/``q_a_layernorm``/``q_b_proj``; ``wkv_a``/``kv_norm``/``wkv_b``/``wo`` <->
``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj``/``o_proj``; dense layers'
``feed_forward.w1/w3/w2`` <-> ``mlp.gate_proj/up_proj/down_proj``; MoE layers' ``moe.router.gate``
<-> ``mlp.gate``, ``moe.expert_bias`` <-> ``mlp.gate.e_score_correction_bias`` (the published
checkpoints keep the bias: it routes), the stacked experts ``moe.experts.w1/w3/w2 [E, ...]`` <->
one tensor per expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (the safetensors
layout, which ``transformers`` 5 fuses when it loads them), ``moe.shared_experts`` <->
``mlp.shared_experts``.

Multi-token-prediction depths are the layers after the main ones, as DeepSeek's checkpoints
hold them (``model.layers.61`` of DeepSeek-V3): ``mtp_layers.N.enorm/hnorm/eh_proj`` keep their
names, ``mtp_layers.N.norm`` <-> ``shared_head.norm``, ``mtp_layers.N.block.*`` as a block's;
the depth's copies of the embedding and head (``embed_tokens``, ``shared_head.head``) are written
on export and not read on import (the model shares its own). ``DeepseekV3ForCausalLM`` itself
skips those layers; ``transformers``' MTP drafting reads them.

Tensors are not changed: the rotary channels are interleaved pairs here as in DeepSeek's weights
(``rope_interleave``).
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.hf_adapter import HFStateDictAdapter
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs

__all__ = ["DeepSeekV3StateDictAdapter"]

_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}


class DeepSeekV3StateDictAdapter(HFStateDictAdapter):
    model_type = "deepseek_v3"

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        n = args.moe.num_experts
        self.layer_names = {
            "attention_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            **{f"attention.{o}.weight": f"self_attn.{t}.weight" for o, t in _ATTENTION.items()},
            **{f"feed_forward.{o}.weight": f"mlp.{t}.weight" for o, t in _MLP.items()},
            **{
                f"moe.shared_experts.{o}.weight": f"mlp.shared_experts.{t}.weight"
                for o, t in _MLP.items()
            },
            "moe.router.gate.weight": "mlp.gate.weight",
            "moe.expert_bias": "mlp.gate.e_score_correction_bias",
            **{
                f"moe.experts.{o}.{e}": f"mlp.experts.{e}.{t}.weight"
                for o, t in _MLP.items()
                for e in range(n)
            },
        }
        self.fused = {
            f"moe.experts.{w}": tuple(f"moe.experts.{w}.{e}" for e in range(n)) for w in _MLP
        }

    def split_tensor(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return w.unbind(0)

    def merge_tensors(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts)

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``DeepseekV3ForCausalLM`` (the keys of the published configs)."""
        a, moe = self.args, self.args.moe
        config = self.shared_config(
            intermediate_size=a.hidden_dim, dtype=dtype, bos_id=bos_id, eos_id=eos_id
        )
        del config["head_dim"]  # transformers derives it (the rotary width)
        rope_scaling = None
        if a.rope_factor > 1:
            rope_scaling = {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": a.rope_factor,
                "original_max_position_embeddings": a.rope_original_seq_len,
                "beta_fast": a.rope_beta_fast,
                "beta_slow": a.rope_beta_slow,
                "mscale": a.rope_mscale,
                "mscale_all_dim": a.rope_mscale,
            }
        config.update(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            q_lora_rank=a.q_lora_rank or None,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            moe_intermediate_size=moe.hidden_dim,
            n_routed_experts=moe.num_experts,
            n_shared_experts=moe.shared_hidden_dim // moe.hidden_dim,
            num_experts_per_tok=moe.top_k,
            n_group=moe.num_groups,
            topk_group=moe.topk_groups,
            first_k_dense_replace=moe.first_dense,
            moe_layer_freq=1,
            norm_topk_prob=moe.route_norm,
            routed_scaling_factor=moe.route_scale,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            rope_scaling=rope_scaling,
            rope_interleave=True,
            num_nextn_predict_layers=a.num_mtp_layers,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
        )
        return config

    @classmethod
    def args_from_hf_config(cls, config: dict) -> DeepSeekV3ModelArgs:
        """Our hyper-parameters from a ``transformers`` DeepSeek-V3 ``config.json`` (the published
        files write ``rope_scaling``; transformers 5 writes ``rope_parameters``)."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        unsupported = []
        if config.get("attention_bias"):
            unsupported.append("attention_bias true")
        if config.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act {config['hidden_act']!r}")
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            unsupported.append(f"scoring_func {config['scoring_func']!r}")
        if config.get("moe_layer_freq", 1) != 1:
            unsupported.append(f"moe_layer_freq {config['moe_layer_freq']}")
        if not config.get("rope_interleave", True):
            unsupported.append("rope_interleave false")
        if rope_type not in ("default", "yarn"):
            unsupported.append(f"rope type {rope_type!r}")
        if rope_type == "yarn" and rope.get("mscale", 1.0) != rope.get("mscale_all_dim", 1.0):
            unsupported.append("YaRN mscale != mscale_all_dim")
        if unsupported:
            raise HFFormatError(
                "config.json: this DeepSeek-V3 model does not implement " + ", ".join(unsupported)
            )
        try:
            experts_dim = int(config["moe_intermediate_size"])
            moe = MoEArgs(
                num_experts=int(config.get("n_routed_experts") or config["num_local_experts"]),
                top_k=int(config["num_experts_per_tok"]),
                hidden_dim=experts_dim,
                score_func="sigmoid",
                route_norm=bool(config.get("norm_topk_prob", True)),
                route_scale=float(config.get("routed_scaling_factor", 1.0)),
                shared_hidden_dim=experts_dim * int(config.get("n_shared_experts") or 0),
                num_groups=int(config.get("n_group") or 1),
                topk_groups=int(config.get("topk_group") or 1),
                first_dense=int(config.get("first_k_dense_replace", 0)),
                load_balance_coeff=1e-3,
            )
            yarn = rope_type == "yarn"
            return DeepSeekV3ModelArgs(
                dim=int(config["hidden_size"]),
                n_layers=int(config["num_hidden_layers"]),
                n_heads=int(config["num_attention_heads"]),
                hidden_dim=int(config["intermediate_size"]),
                q_lora_rank=int(config.get("q_lora_rank") or 0),
                kv_lora_rank=int(config["kv_lora_rank"]),
                qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                v_head_dim=int(config["v_head_dim"]),
                vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_factor=float(rope["factor"]) if yarn else 1.0,
                rope_original_seq_len=int(rope.get("original_max_position_embeddings", 4096)),
                rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                rope_mscale=float(rope.get("mscale_all_dim") or 1.0) if yarn else 1.0,
                max_seq_len=int(config.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                moe=moe,
                num_mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a DeepSeek-V3 config this model can build ({e!r})"
            ) from e
