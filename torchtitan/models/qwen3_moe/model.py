"""Qwen3-MoE: the Qwen3 decoder (``qwen3/model.py``: QK-norm, half-split rotary, GQA) with
mixture-of-experts feed-forwards (``models/common/moe.py``). Model math only.

From ``transformers``' ``modeling_qwen3_moe.py`` and the Qwen3 technical report
(arXiv:2505.09388, section 2): softmax router scores in float32, top-k (8 of 128 in the published
models), the chosen weights renormalized to sum to one (``norm_topk_prob``), the experts' outputs
weighted after the experts, no shared expert; layer ``i`` is an MoE layer when
``(i + 1) % decoder_sparse_step == 0`` (every layer in the published models), else a dense SwiGLU of
``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3ModelArgs

__all__ = ["Qwen3MoeModelArgs", "Qwen3MoeModel"]


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    """Qwen3's hyper-parameters plus ``moe`` (``hidden_dim``: the dense layers' width)."""

    moe: MoEArgs = field(default_factory=MoEArgs)

    def ffn_hidden_dim(self) -> int:
        """The width tensor parallelism splits: every expert's."""
        return self.moe.hidden_dim


class Qwen3MoeModel(Qwen3Model):
    """The Qwen3 decoder whose blocks' feed-forward is ``moe`` on MoE layers (see
    :class:`~torchtitan.models.common.blocks.TransformerBlock`); init as Qwen3's, experts like
    its SwiGLU (w1/w3 std 0.02, w2 depth-scaled), the router std 0.02."""
