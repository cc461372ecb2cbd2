"""Llama weights in the layout of Hugging Face ``transformers`` (``LlamaForCausalLM``), and back.

Names: ``tok_embeddings`` <-> ``model.embed_tokens``, ``layers.N.attention.wq/wk/wv/wo`` <->
``model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj``, ``feed_forward.w1/w3/w2`` <->
``mlp.gate_proj/up_proj/down_proj``, ``attention_norm`` / ``ffn_norm`` <->
``input_layernorm`` / ``post_attention_layernorm``, ``norm`` <-> ``model.norm``, ``output`` <->
``lm_head`` (absent when the embeddings are tied).

Rotary layout: this model (like Meta's reference) rotates adjacent channel pairs ``(2i, 2i+1)`` of
each head; ``transformers`` rotates ``(i, i + head_dim / 2)``. The rows of ``wq`` and ``wk`` are
therefore permuted within each head on the way out, and back on the way in (the permutation of
``transformers``' own ``convert_llama_weights_to_hf.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.hf_adapter import HFStateDictAdapter
from torchtitan.models.llama.model import ModelArgs


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from pairs ``(2i, 2i+1)`` to halves ``(i, i + d/2)``."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaStateDictAdapter(HFStateDictAdapter):
    model_type = "llama"
    layer_names = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }

    def _permute(self, name: str, w: torch.Tensor, fn) -> torch.Tensor:
        if name.endswith("attention.wq.weight"):
            return fn(w, self.args.n_heads)
        if name.endswith("attention.wk.weight"):
            return fn(w, self.args.n_kv_heads)
        return w

    def tensor_to_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return self._permute(name, w, _to_half_split)

    def tensor_from_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return self._permute(name, w, _to_interleaved)

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``LlamaForCausalLM`` with these hyper-parameters."""
        args = self.args
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **self.shared_config(
                intermediate_size=args.ffn_hidden_dim(), dtype=dtype, bos_id=bos_id, eos_id=eos_id
            ),
            "mlp_bias": False,
        }
        if args.use_scaled_rope:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": args.rope_scale_factor,
                "low_freq_factor": args.rope_low_freq_factor,
                "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_seq_len,
            }
        return config

    @classmethod
    def args_from_hf_config(cls, config: dict) -> ModelArgs:
        """Our hyper-parameters from a ``transformers`` Llama ``config.json``."""
        try:
            dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            hidden = int(config["intermediate_size"])
            base = int(2 * 4 * dim / 3)
            args = ModelArgs(
                dim=dim,
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                vocab_size=int(config["vocab_size"]),
                # SwiGLU width: rounding 8/3 * dim up to a multiple of `hidden` gives `hidden`
                multiple_of=hidden,
                ffn_dim_multiplier=None if hidden >= base else hidden / base,
                norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                max_seq_len=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a Llama config this model can build ({e!r})"
            ) from e
        scaling = config.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            args.use_scaled_rope = True
            args.rope_scale_factor = float(scaling["factor"])
            args.rope_low_freq_factor = float(scaling["low_freq_factor"])
            args.rope_high_freq_factor = float(scaling["high_freq_factor"])
            args.rope_original_max_seq_len = int(scaling["original_max_position_embeddings"])
        head_dim = config.get("head_dim", args.head_dim)
        if args.ffn_hidden_dim() != hidden or args.head_dim != head_dim:
            raise HFFormatError(
                f"config.json: intermediate_size {hidden} / head_dim {config.get('head_dim')} "
                "cannot be expressed by this model's Llama hyper-parameters"
            )
        return args
