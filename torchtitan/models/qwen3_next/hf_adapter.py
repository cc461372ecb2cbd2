"""Qwen3-Next weights in the layout of Hugging Face ``transformers`` (``Qwen3NextForCausalLM``), and
back.

As Qwen3-MoE's (``qwen3_moe/hf_adapter.py``: the norms, the router ``mlp.gate``, one tensor per
expert), plus:

* gated attention: ``attention.wqkv`` fuses ``self_attn.q_proj`` (each query head's rows followed
  by its gate's, ``[2 H D, dim]``), ``k_proj`` and ``v_proj``, grouped by kv head;
* linear attention (``linear_attn.*``): ``in_proj_qkvz``, ``in_proj_ba``, ``A_log``, ``dt_bias``,
  ``norm`` and ``out_proj`` as they are; ``attention.conv_weight [C, K]`` <-> ``conv1d.weight
  [C, 1, K]``, whose channels ``transformers`` orders all queries, all keys, all values, and ours
  by key head (each head's query, key, values), so the rows are regrouped;
* the shared expert ``mlp.shared_expert.gate_proj/up_proj/down_proj`` and its gate
  ``mlp.shared_expert_gate``;
* the one multi-token-prediction depth, under a top-level ``mtp.`` (not DeepSeek's
  ``model.layers.N.``): ``enorm``/``hnorm``/``eh_proj``/``norm`` <-> ``mtp.pre_fc_norm_embedding``
  /``pre_fc_norm_hidden``/``fc``/``norm``, its block <-> ``mtp.layers.0.*`` (a full-attention
  layer, named as the main ones). A model without the depth (``model.num_mtp_layers`` 0) leaves
  those tensors out on import, as ``transformers`` does.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.blocks import fuse_qkv, split_qkv
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_next.model import (
    Qwen3NextModelArgs,
    default_layer_types,
    qwen3_next_moe,
)

__all__ = ["Qwen3NextStateDictAdapter", "hybrid_config"]

_LINEAR = ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias", "norm.weight")
# a prediction depth's own tensors (models/common/mtp.py) <-> theirs under ``mtp.``
_MTP = {
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "eh_proj.weight": "fc.weight",
    "norm.weight": "norm.weight",
}
_OUR_MTP = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_HF_MTP_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hybrid_config(a: Qwen3NextModelArgs) -> dict[str, Any]:
    """The ``config.json`` keys of the layer pattern and the linear layers."""
    return {
        "layer_types": list(a.kinds()),
        "full_attention_interval": a.full_attention_interval,
        "linear_num_key_heads": a.linear_n_key_heads,
        "linear_num_value_heads": a.linear_n_value_heads,
        "linear_key_head_dim": a.linear_key_head_dim,
        "linear_value_head_dim": a.linear_value_head_dim,
        "linear_conv_kernel_dim": a.linear_conv_kernel,
    }


class Qwen3NextStateDictAdapter(Qwen3MoeStateDictAdapter):
    model_type = "qwen3_next"
    family = "Qwen3-Next"  # in error messages
    mtp_copies = False  # the depth shares the model's embedding and head

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.layer_names = {
            **self.layer_names,
            **{f"attention.{n}": f"linear_attn.{n}" for n in _LINEAR},
            "attention.out_proj.weight": "linear_attn.out_proj.weight",
            "attention.conv_weight": "linear_attn.conv1d.weight",
            "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
            "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
            "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
            "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
        }

    # ---- the prediction depth's names

    def hf_name(self, name: str) -> str:
        m = _OUR_MTP.match(name)
        if m is None:
            return super().hf_name(name)
        if int(m.group(1)) != self.args.n_layers:
            raise HFFormatError(
                f"parameter '{name}': {self.family}'s Hugging Face layout holds one prediction "
                "depth (mtp.*); use model.num_mtp_layers 1 or 0 to exchange it"
            )
        rest = m.group(2)
        if rest in _MTP:
            return f"mtp.{_MTP[rest]}"
        inner = rest.removeprefix("block.")
        if rest.startswith("block.") and inner in self.layer_names:
            return f"mtp.layers.0.{self.layer_names[inner]}"
        raise HFFormatError(f"parameter '{name}' has no Hugging Face {self.model_type} counterpart")

    def our_name(self, hf: str) -> str | None:
        if not hf.startswith("mtp."):
            return super().our_name(hf)
        rest, depth = hf.removeprefix("mtp."), self.args.n_layers
        own = {v: k for k, v in _MTP.items()}
        if rest in own:
            return f"mtp_layers.{depth}.{own[rest]}"
        m = _HF_MTP_LAYER.match(rest)
        inverse = {v: k for k, v in self.layer_names.items()}
        if m is None or m.group(2) not in inverse:
            return None
        return f"mtp_layers.{depth + int(m.group(1))}.block.{inverse[m.group(2)]}"

    # ---- the gated query rows: twice as many "heads" for the split

    def split_tensor(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if name.endswith("attention.wqkv.weight"):
            return split_qkv(w, 2 * self.args.n_heads, self.args.n_kv_heads)
        return super().split_tensor(name, w)

    def merge_tensors(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if name.endswith("attention.wqkv.weight"):
            return fuse_qkv(*parts, n_kv_heads=self.args.n_kv_heads)
        return super().merge_tensors(name, parts)

    # ---- the convolution's channel order

    def _conv_sizes(self) -> tuple[int, int, int]:
        a = self.args
        r = a.linear_n_value_heads // a.linear_n_key_heads
        return a.linear_n_key_heads, a.linear_key_head_dim, r * a.linear_value_head_dim

    def tensor_to_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if not name.endswith("attention.conv_weight"):
            return w
        g, dk, r_dv = self._conv_sizes()
        q, k, v = w.unflatten(0, (g, -1)).split((dk, dk, r_dv), dim=1)
        return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)]).unsqueeze(1)

    def tensor_from_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if not name.endswith("attention.conv_weight"):
            return w
        g, dk, r_dv = self._conv_sizes()
        q, k, v = w.squeeze(1).split((g * dk, g * dk, g * r_dv))
        grouped = [q.unflatten(0, (g, dk)), k.unflatten(0, (g, dk)), v.unflatten(0, (g, r_dv))]
        return torch.cat(grouped, dim=1).flatten(0, 1)

    # ---- config.json

    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``Qwen3NextForCausalLM`` (the published file's keys, plus
        ``layer_types``)."""
        a, moe = self.args, self.args.moe
        config = super().hf_config(dtype=dtype, bos_id=bos_id, eos_id=eos_id)
        for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
            config.pop(key, None)
        config.update(
            architectures=["Qwen3NextForCausalLM"],
            model_type="qwen3_next",
            intermediate_size=a.hidden_dim,
            partial_rotary_factor=a.partial_rotary_factor,
            **hybrid_config(a),
            shared_expert_intermediate_size=moe.shared_hidden_dim,
        )
        if a.num_mtp_layers:  # the published file has no key for it; Qwen3.5's name
            config["mtp_num_hidden_layers"] = a.num_mtp_layers
        return config

    @classmethod
    def args_from_hf_config(cls, config: dict) -> Qwen3NextModelArgs:
        """Our hyper-parameters from a ``transformers`` Qwen3-Next ``config.json``; a key the file
        leaves out takes ``Qwen3NextConfig``'s default."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        unsupported = []
        if config.get("mlp_only_layers"):
            unsupported.append(f"mlp_only_layers {config['mlp_only_layers']}")
        if str(config.get("decoder_sparse_step", 1)) != "1":
            unsupported.append(f"decoder_sparse_step {config['decoder_sparse_step']}")
        if config.get("attention_bias"):
            unsupported.append("attention_bias true")
        if config.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act {config['hidden_act']!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            unsupported.append(f"rope type {rope_type!r}")
        if unsupported:
            raise HFFormatError(
                f"config.json: this {cls.family} model does not implement " + ", ".join(unsupported)
            )
        try:
            n_layers = int(config.get("num_hidden_layers", 48))
            interval = int(config.get("full_attention_interval", 4))
            layer_types = tuple(config.get("layer_types") or ())
            if layer_types == default_layer_types(n_layers, interval):
                layer_types = ()
            heads = int(config.get("num_attention_heads", 16))
            return Qwen3NextModelArgs(
                dim=int(config.get("hidden_size", 2048)),
                n_layers=n_layers,
                n_heads=heads,
                n_kv_heads=int(config.get("num_key_value_heads", 2)),
                head_dim=int(config.get("head_dim", 256)),
                # transformers takes rope_parameters' value first
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.25
                ),
                hidden_dim=int(config.get("intermediate_size", 5632)),
                vocab_size=int(config.get("vocab_size", 151936)),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                max_seq_len=int(config.get("max_position_embeddings", 32768)),
                layer_types=layer_types or None,
                full_attention_interval=interval,
                linear_n_key_heads=int(config.get("linear_num_key_heads", 16)),
                linear_n_value_heads=int(config.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
                linear_conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                num_mtp_layers=int(config.get("mtp_num_hidden_layers", 0)),
                moe=_moe_args(config),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFFormatError(
                f"config.json is not a {cls.family} config this model can build ({e!r})"
            ) from e


def _moe_args(config: dict) -> MoEArgs:
    moe = qwen3_next_moe(
        num_experts=int(config.get("num_experts", 512)),
        top_k=int(config.get("num_experts_per_tok", 10)),
        hidden_dim=int(config.get("moe_intermediate_size", 512)),
        shared_dim=int(config.get("shared_expert_intermediate_size", 512)),
    )
    moe.route_norm = bool(config.get("norm_topk_prob", True))
    return moe
