"""Qwen3.5 text weights in the layout of Hugging Face ``transformers`` (``Qwen3_5ForCausalLM``,
``model_type`` ``qwen3_5_text``; MoE sizes ``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``), and
back.

As Qwen3-Next's (``qwen3_next/hf_adapter.py``: gated ``q_proj``, the convolution in
``transformers``' channel order, one tensor per expert, the gated shared expert, the ``mtp.``
depth), except:

* the linear layers' input projections are stored apart and not grouped by key head:
  ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a``. Ours stay grouped (``in_proj_qkvz``, ``in_proj_ba``: what a tensor-parallel
  split into whole key-head groups needs), so each is a fused parameter whose parts are those
  tensors, regrouped on the way (:meth:`Qwen3_5StateDictAdapter.split_tensor`);
* dense sizes: ``feed_forward.w1/w3/w2`` <-> ``mlp.gate_proj/up_proj/down_proj``;
* the rotary settings live in ``rope_parameters``, with the multimodal ``mrope_section``: on text
  the three position axes are equal, so the interleaved multimodal rotary embedding is the plain
  one, and the model trains text;
* the published folders are multimodal (``Qwen3_5ForConditionalGeneration``, ``model_type``
  ``qwen3_5`` / ``qwen3_5_moe``): the language model under ``model.language_model.``, the vision
  encoder under ``model.visual.``, the config under ``text_config``. An import reads the text
  weights and leaves the vision encoder; an export writes a text-only folder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchtitan.models.qwen3_next.hf_adapter import Qwen3NextStateDictAdapter, hybrid_config
from torchtitan.models.qwen3_next.model import Qwen3NextModelArgs

__all__ = ["Qwen3_5StateDictAdapter"]

_TEXT_PREFIX, _VISION_PREFIX = "model.language_model.", "model.visual."
# our grouped projections -> the separate tensors transformers stores
_SPLIT = {
    "attention.in_proj_qkvz.weight": ("attention.in_proj_qkv.weight", "attention.in_proj_z.weight"),
    "attention.in_proj_ba.weight": ("attention.in_proj_b.weight", "attention.in_proj_a.weight"),
}
# transformers' defaults for the keys a hand-written config.json may leave out (Qwen3_5TextConfig,
# and Qwen3_5MoeTextConfig's where they differ)
_DENSE_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 12288,
    "vocab_size": 248320,
    "max_position_embeddings": 32768,
}
_MOE_DEFAULTS = {
    **_DENSE_DEFAULTS,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


class Qwen3_5StateDictAdapter(Qwen3NextStateDictAdapter):
    model_type = "qwen3_5_text"
    also_reads = ("qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    family = "Qwen3.5"
    ignored = (*Qwen3NextStateDictAdapter.ignored, _VISION_PREFIX)

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        names = {k: v for k, v in self.layer_names.items() if k not in _SPLIT}
        for parts in _SPLIT.values():
            names.update({p: "linear_attn." + p.removeprefix("attention.") for p in parts})
        self.layer_names = names
        self.fused = {**self.fused, **_SPLIT}

    def our_name(self, hf: str) -> str | None:
        if hf.startswith(_TEXT_PREFIX):  # a multimodal folder's language model
            hf = "model." + hf.removeprefix(_TEXT_PREFIX)
        return super().our_name(hf)

    # ---- the grouped input projections

    def _groups(self) -> tuple[int, int, int]:
        a = self.args
        return (
            a.linear_n_key_heads,
            a.linear_key_head_dim,
            a.linear_n_value_heads // a.linear_n_key_heads,
        )

    def split_tensor(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if name.endswith("attention.in_proj_qkvz.weight"):
            _, dk, r = self._groups()
            dv = self.args.linear_value_head_dim
            q, k, v, z = w.unflatten(0, (self.args.linear_n_key_heads, -1)).split(
                (dk, dk, r * dv, r * dv), dim=1
            )
            return torch.cat([t.flatten(0, 1) for t in (q, k, v)]), z.flatten(0, 1)
        if name.endswith("attention.in_proj_ba.weight"):
            g, _, r = self._groups()
            b, a = w.unflatten(0, (g, 2 * r)).split((r, r), dim=1)
            return b.flatten(0, 1), a.flatten(0, 1)
        return super().split_tensor(name, w)

    def merge_tensors(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        g, dk, r = self._groups()
        if name.endswith("attention.in_proj_qkvz.weight"):
            qkv, z = parts
            dv = self.args.linear_value_head_dim
            q, k, v = qkv.split((g * dk, g * dk, g * r * dv))
            grouped = [t.unflatten(0, (g, -1)) for t in (q, k, v, z)]
            return torch.cat(grouped, dim=1).flatten(0, 1)
        if name.endswith("attention.in_proj_ba.weight"):
            b, a = (t.unflatten(0, (g, r)) for t in parts)
            return torch.cat([b, a], dim=1).flatten(0, 1)
        return super().merge_tensors(name, parts)

    # ---- config.json

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a text-only ``Qwen3_5ForCausalLM`` (or ``Qwen3_5MoeForCausalLM``):
        the published ``text_config``'s keys."""
        a, moe = self.args, self.args.moe
        config = self.shared_config(
            intermediate_size=a.hidden_dim, dtype=dtype, bos_id=bos_id, eos_id=eos_id
        )
        half = a.rotary_dim // 2
        axis = round(half * 11 / 32)  # the published [11, 11, 10] of 32 rotated pairs
        config.update(
            architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.pop("rope_theta"),
                "partial_rotary_factor": a.partial_rotary_factor,
                "mrope_section": [axis, axis, half - 2 * axis],
                "mrope_interleaved": True,
            },
            **hybrid_config(a),
        )
        if moe is not None:
            del config["intermediate_size"]  # every feed-forward is an MoE layer
            config.update(
                num_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.hidden_dim,
                shared_expert_intermediate_size=moe.shared_hidden_dim,
                router_aux_loss_coef=moe.aux_loss_coeff or 0.001,
            )
        if a.num_mtp_layers:
            config["mtp_num_hidden_layers"] = a.num_mtp_layers
        return config

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Qwen3NextModelArgs:
        """Our hyper-parameters from a Qwen3.5 ``config.json``: a text model's, or the
        ``text_config`` of a multimodal one; a key the file leaves out takes ``transformers``'
        default. MoE sizes are the ones with ``num_experts``."""
        text = config.get("text_config") or config
        moe = "num_experts" in text or "moe" in str(text.get("model_type", ""))
        text = {**(_MOE_DEFAULTS if moe else _DENSE_DEFAULTS), **text}
        if moe:  # no dense feed-forward: hidden_dim is the experts' width (as the flavors')
            text["intermediate_size"] = text["moe_intermediate_size"]
        args = super().args_from_hf_config(text)
        return args if moe else dataclasses.replace(args, moe=None)
