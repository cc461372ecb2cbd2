"""Llama 4 (text) weights in the layout of Hugging Face ``transformers`` (``Llama4ForCausalLM``,
``model_type`` ``llama4_text``), and back.

Names: ``layers.N.attention.wq/wk/wv/wo`` <-> ``model.layers.N.self_attn.q_proj/k_proj/v_proj/
o_proj`` (no row permutation: both rotate Meta's interleaved pairs), the norms as Llama's, a
dense layer's ``feed_forward.w1/w3/w2`` <-> ``feed_forward.gate_proj/up_proj/down_proj``, and an
MoE layer's ``moe.router.gate`` <-> ``feed_forward.router``, ``moe.shared_experts.w1/w3/w2`` <->
``feed_forward.shared_expert.gate_proj/up_proj/down_proj``, and the stacked routed experts:
``moe.experts.w1 [E, I, D]`` and ``w3`` <-> ``feed_forward.experts.gate_up_proj [E, D, 2I]``
(transposed, gate then up), ``w2 [E, D, I]`` <-> ``feed_forward.experts.down_proj [E, I, D]``.
The load-balancing ``moe.expert_bias`` has no Hugging Face counterpart (zero on import, left out
on export).

The published Scout and Maverick folders are multimodal (``Llama4ForConditionalGeneration``,
``model_type`` ``llama4``): their text weights are the same names under ``language_model.``, next
to ``vision_model.`` and ``multi_modal_projector.`` weights. An import reads the text weights and
leaves the others; an export writes a text-only ``Llama4ForCausalLM`` folder.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.hf_adapter import HFStateDictAdapter
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.llama4.model import Llama4ModelArgs

__all__ = ["Llama4StateDictAdapter"]

_GATE_UP = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts\.)gate_up_proj$")
_DOWN = re.compile(r"^model\.layers\.\d+\.feed_forward\.experts\.down_proj$")
# what the two halves of gate_up_proj are called between the conversion by name and the fusion
_GATE, _UP = "gate_proj_stacked", "up_proj_stacked"
# a multimodal (Llama4ForConditionalGeneration) folder: the text model, and what is not text
_TEXT_PREFIX = "language_model."
_NOT_TEXT = ("vision_model.", "multi_modal_projector.")


class Llama4StateDictAdapter(HFStateDictAdapter):
    model_type = "llama4_text"
    also_reads = ("llama4",)
    not_in_hf = ("moe.expert_bias",)
    layer_names = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
        "feed_forward.w3.weight": "feed_forward.up_proj.weight",
        "feed_forward.w2.weight": "feed_forward.down_proj.weight",
        "moe.router.gate.weight": "feed_forward.router.weight",
        "moe.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
        "moe.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
        "moe.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
        "moe.experts.w1": f"feed_forward.experts.{_GATE}",
        "moe.experts.w3": f"feed_forward.experts.{_UP}",
        "moe.experts.w2": "feed_forward.experts.down_proj",
    }

    def tensor_to_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2) if ".moe.experts." in name else w

    def tensor_from_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2) if ".moe.experts." in name else w

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As the generic conversion, then each MoE layer's gate and up halves as one
        ``gate_up_proj``."""
        out = super().to_hf(state)
        for name in [n for n in out if n.endswith(_GATE)]:
            prefix = name[: -len(_GATE)]
            gate, up = out.pop(name), out.pop(prefix + _UP)
            out[prefix + "gate_up_proj"] = torch.cat((gate, up), dim=-1).contiguous()
        return out

    def from_hf(
        self, hf_state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
    ) -> dict[str, torch.Tensor]:
        """The text weights of a multimodal folder by their text-model names; each
        ``gate_up_proj`` cut into its gate and up halves; then the generic conversion."""
        split: dict[str, torch.Tensor] = {}
        for name, w in _text_weights(hf_state).items():
            m = _GATE_UP.match(name)
            if m is None:
                split[name] = w
                continue
            gate, up = w.chunk(2, dim=-1)
            split[m.group(1) + _GATE], split[m.group(1) + _UP] = gate, up
        return super().from_hf(split, expected)

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``Llama4ForCausalLM`` (the keys of the published text configs)."""
        a, moe = self.args, self.args.moe
        config = self.shared_config(
            intermediate_size=moe.hidden_dim, dtype=dtype, bos_id=bos_id, eos_id=eos_id
        )
        rope_scaling = None
        if a.use_scaled_rope:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": a.rope_scale_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
            }
        return {
            "architectures": ["Llama4ForCausalLM"],
            "model_type": "llama4_text",
            **config,
            "intermediate_size_mlp": a.hidden_dim,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "interleave_moe_layer_step": moe.every,
            "no_rope_layer_interval": a.nope_layer_interval,
            "attention_chunk_size": a.attention_chunk_size,
            "use_qk_norm": a.use_qk_norm,
            "attn_temperature_tuning": a.attn_temperature_tuning,
            "floor_scale": a.floor_scale,
            "attn_scale": a.attn_scale,
            "rope_scaling": rope_scaling,
            "router_aux_loss_coef": moe.aux_loss_coeff or 0.001,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Llama4ModelArgs:
        """Our hyper-parameters from a ``Llama4TextConfig`` ``config.json`` (or the
        ``text_config`` of a multimodal ``llama4`` one)."""
        config = config.get("text_config", config)
        _refuse_unsupported(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        scaled = rope.get("rope_type", rope.get("type", "default")) == "llama3"
        try:
            dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            width = int(config["intermediate_size"])
            moe = MoEArgs(
                num_experts=int(config["num_local_experts"]),
                top_k=int(config.get("num_experts_per_tok", 1)),
                hidden_dim=width,
                score_func="sigmoid",
                score_before_experts=True,
                shared_hidden_dim=width,
                every=int(config.get("interleave_moe_layer_step", 1)),
            )
            return Llama4ModelArgs(
                dim=dim,
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                head_dim=int(config.get("head_dim") or dim // n_heads),
                hidden_dim=int(config["intermediate_size_mlp"]),
                vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 500000.0),
                use_scaled_rope=scaled,
                rope_scale_factor=float(rope.get("factor", 16.0)),
                rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                rope_high_freq_factor=float(rope.get("high_freq_factor", 1.0)),
                rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 8192)),
                max_seq_len=int(config.get("max_position_embeddings", 131072)),
                nope_layer_interval=int(config.get("no_rope_layer_interval", 4)),
                attention_chunk_size=config.get("attention_chunk_size", 8192),
                use_qk_norm=bool(config.get("use_qk_norm", True)),
                attn_temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
                floor_scale=int(config.get("floor_scale", 8192)),
                attn_scale=float(config.get("attn_scale", 0.1)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                moe=moe,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a Llama 4 text config this model can build ({e!r})"
            ) from e


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """One error naming every setting of this config.json the model here does not implement."""
    unsupported = []
    if config.get("attention_bias"):
        unsupported.append("attention_bias true")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']!r}")
    interval = config.get("no_rope_layer_interval", 4)
    layers = config.get("num_hidden_layers", 0)
    default_nope = [int((i + 1) % interval != 0) for i in range(layers)]
    if config.get("no_rope_layers") and list(config["no_rope_layers"]) != default_nope:
        unsupported.append("no_rope_layers other than every no_rope_layer_interval-th")
    step = int(config.get("interleave_moe_layer_step", 1))
    if config.get("moe_layers") is not None and list(config["moe_layers"]) != list(
        range(step - 1, layers, step)
    ):
        unsupported.append("moe_layers other than every interleave_moe_layer_step-th")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3"):
        unsupported.append(f"rope type {rope.get('rope_type', rope.get('type'))!r}")
    if unsupported:
        raise HFFormatError(
            "config.json: this Llama 4 model does not implement " + ", ".join(unsupported)
        )


def _text_weights(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal folder's text weights, named as a ``Llama4ForCausalLM``'s; any other folder's
    weights as they are."""
    if not any(name.startswith(_TEXT_PREFIX) for name in hf_state):
        return hf_state
    return {
        name.removeprefix(_TEXT_PREFIX): w
        for name, w in hf_state.items()
        if not name.startswith(_NOT_TEXT)
    }
