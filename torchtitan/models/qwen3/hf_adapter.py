"""Qwen3 weights in the layout of Hugging Face ``transformers`` (``Qwen3ForCausalLM``), and back.

Names: ``tok_embeddings`` <-> ``model.embed_tokens``, ``layers.N.attention.wq/wk/wv/wo`` <->
``model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj``, ``attention.q_norm/k_norm`` <->
``self_attn.q_norm/k_norm``, ``feed_forward.w1/w3/w2`` <-> ``mlp.gate_proj/up_proj/down_proj``,
``attention_norm`` / ``ffn_norm`` <-> ``input_layernorm`` / ``post_attention_layernorm``, ``norm``
<-> ``model.norm``, ``output`` <-> ``lm_head`` (absent when the embeddings are tied).

Tensors are not changed: this model rotates queries and keys in ``transformers``' half-split
layout, so (unlike Llama's adapter) no rows are permuted.
"""

from __future__ import annotations

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.hf_adapter import HFStateDictAdapter
from torchtitan.models.qwen3.model import Qwen3ModelArgs

__all__ = ["Qwen3StateDictAdapter"]


class Qwen3StateDictAdapter(HFStateDictAdapter):
    model_type = "qwen3"
    layer_names = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``Qwen3ForCausalLM`` with these hyper-parameters (the keys of the
        published Qwen3 configs)."""
        args = self.args
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **self.shared_config(
                intermediate_size=args.hidden_dim, dtype=dtype, bos_id=bos_id, eos_id=eos_id
            ),
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Qwen3ModelArgs:
        """Our hyper-parameters from a ``transformers`` Qwen3 ``config.json`` (the published
        files write ``rope_theta``; transformers 5 writes ``rope_parameters``)."""
        unsupported = []
        if config.get("attention_bias"):
            unsupported.append("attention_bias true")
        if config.get("use_sliding_window"):
            unsupported.append("use_sliding_window true")
        if config.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act {config['hidden_act']!r}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            unsupported.append(f"rope type {rope_type!r}")
        if unsupported:
            raise HFFormatError(
                "config.json: this Qwen3 model does not implement " + ", ".join(unsupported)
            )
        # A key the file leaves out takes transformers' Qwen3Config default, so that both read
        # the same model from it.
        try:
            dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            head_dim = config.get("head_dim", 128)
            return Qwen3ModelArgs(
                dim=dim,
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                head_dim=int(head_dim) if head_dim else dim // n_heads,
                hidden_dim=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                max_seq_len=int(config.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a Qwen3 config this model can build ({e!r})"
            ) from e
