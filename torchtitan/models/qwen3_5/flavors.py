"""Published Qwen3.5 text-model hyper-parameters, plus two small debug flavors.

Qwen3.5 is Qwen3-Next's layer set (``models/qwen3_next``): three Gated DeltaNet layers per gated
softmax-attention layer, zero-centered norms, partial rotary embeddings; in dense sizes (every
feed-forward a SwiGLU) and MoE sizes (a softmax router over many small experts plus a gated
shared expert). The published folders are multimodal (``Qwen3_5ForConditionalGeneration``): this
family is their language model; the vision encoder is not built (docs/models.md, "Qwen3.5").

Sources: the ``text_config`` of each Hugging Face ``config.json`` (Qwen/Qwen3.5-0.8B, -2B, -4B,
-9B, -27B, -35B-A3B, -122B-A10B, -397B-A17B), as upstream torchtitan's ``models/qwen3_5/flavors.py``
transcribes them. Every size: vocab_size 248320, head_dim 256, partial_rotary_factor 0.25,
rope_theta 10000000, max_position_embeddings 262144, full_attention_interval 4, linear heads of
128 channels with 16 key heads, linear_conv_kernel_dim 4, rms_norm_eps 1e-6; the three smallest
tie the embedding and the output head. Per size:

==========  ======  ======  =====  ========  =============  ======================
flavor      hidden  layers  heads  kv heads  linear v-heads feed-forward
==========  ======  ======  =====  ========  =============  ======================
0.8B        1024    24      8      2         16             3584
2B          2048    24      8      2         16             6144
4B          2560    32      16     4         32             9216
9B          4096    32      16     4         32             12288
27B         5120    64      24     4         48             17408
35B-A3B     2048    40      16     2         32             256 experts top-8, 512
122B-A10B   3072    48      32     2         64             256 experts top-8, 1024
397B-A17B   4096    60      32     2         64             512 experts top-10, 1024
==========  ======  ======  =====  ========  =============  ======================

(MoE sizes: the shared expert as wide as a routed one.) The parameter counts are checked in
``tests/unit/models/test_qwen3_5.py`` against ``transformers``' own text models of these configs.
Each published size also holds one multi-token-prediction depth (``mtp_num_hidden_layers`` 1,
under ``mtp.``; its block a gated softmax-attention one with the size's feed-forward), which the
flavors build (``model.num_mtp_layers 0`` leaves it out); ``transformers`` does not load it.

``vocab_size`` is -1 for the debug flavors (set from the tokenizer). Copy an entry
(``dataclasses.replace``) before changing it.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.qwen3_next.flavors import qwen3_next_configs
from torchtitan.models.qwen3_next.model import Qwen3NextModelArgs, qwen3_next_moe

__all__ = ["QWEN3_5_VOCAB_SIZE", "qwen3_5_configs"]

QWEN3_5_VOCAB_SIZE = 248_320


def _dense(dim: int, layers: int, heads: int, kv: int, v_heads: int, ffn: int, tied: bool):
    return Qwen3NextModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        hidden_dim=ffn,
        vocab_size=QWEN3_5_VOCAB_SIZE,
        linear_n_value_heads=v_heads,
        tie_word_embeddings=tied,
        num_mtp_layers=1,
        moe=None,
    )


def _moe(dim: int, layers: int, heads: int, v_heads: int, experts: int, top_k: int, width: int):
    return Qwen3NextModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=2,
        hidden_dim=width,  # no dense feed-forward: the experts' width
        vocab_size=QWEN3_5_VOCAB_SIZE,
        linear_n_value_heads=v_heads,
        num_mtp_layers=1,
        moe=qwen3_next_moe(num_experts=experts, top_k=top_k, hidden_dim=width, shared_dim=width),
    )


qwen3_5_configs: dict[str, Qwen3NextModelArgs] = {
    # Tiny, for CPU runs and tests: Qwen3-Next's debug flavor (linear and full attention
    # alternating, so a layout suite's two blocks hold one of each), dense, and as it is
    "debugmodel": dataclasses.replace(qwen3_next_configs["debugmodel"], moe=None),
    "debugmodel_moe": dataclasses.replace(qwen3_next_configs["debugmodel"]),
    "0.8B": _dense(1024, 24, 8, 2, 16, 3584, tied=True),
    "2B": _dense(2048, 24, 8, 2, 16, 6144, tied=True),
    "4B": _dense(2560, 32, 16, 4, 32, 9216, tied=True),
    "9B": _dense(4096, 32, 16, 4, 32, 12288, tied=False),
    "27B": _dense(5120, 64, 24, 4, 48, 17408, tied=False),
    "35B-A3B": _moe(2048, 40, 16, 32, 256, 8, 512),
    "122B-A10B": _moe(3072, 48, 32, 64, 256, 8, 1024),
    "397B-A17B": _moe(4096, 60, 32, 64, 512, 10, 1024),
}
