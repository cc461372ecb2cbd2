"""A family's weights in the names and layout of Hugging Face ``transformers``, and back.

A family subclasses :class:`HFStateDictAdapter` with its name tables (per block and outside the
blocks), any per-tensor layout change, ``hf_config`` (the ``config.json`` of these
hyper-parameters) and ``args_from_hf_config``. The generic part here does the renaming, the tied
output, the pipeline-stage filtering, the split of fused parameters into the separate tensors
Hugging Face stores (and their merge back), and one error listing every missing, unexpected or
misshapen tensor. The checkpoint manager and the scripts reach it only through the model spec.

Fused parameters: the attention's ``wqkv`` holds what Hugging Face (and this library's
checkpoints before the fusion) store as ``wq``, ``wk`` and ``wv``. :meth:`~HFStateDictAdapter.unfuse`
and :meth:`~HFStateDictAdapter.fuse` convert between the two layouts; the conversions by name
then see the separate tensors only.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.blocks import fuse_qkv, split_qkv
from torchtitan.observability.log import logger

# a block's parameter: ``layers.N.X`` or a multi-token-prediction depth's ``mtp_layers.N.block.X``
_BLOCK_KEY = re.compile(r"^(layers\.\d+|mtp_layers\.\d+\.block)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: a multi-token-prediction depth's own tensors (models/common/mtp.py) <-> the names DeepSeek's
#: checkpoints give them inside ``model.layers.N.`` (N = n_layers + depth - 1)
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
#: the copies of the embedding and output head DeepSeek's checkpoints keep in each depth
MTP_COPIES = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}


class HFStateDictAdapter(ABC):
    """Conversions for one set of model hyper-parameters (``args``)."""

    #: ``config.json``'s ``model_type`` this adapter reads and writes (e.g. "llama")
    model_type: ClassVar[str]
    #: other ``model_type`` values whose folders this adapter imports (a multimodal checkpoint
    #: whose text weights are this family's)
    also_reads: ClassVar[tuple[str, ...]] = ()
    #: parameter name inside a block -> the name inside ``model.layers.N.``
    layer_names: ClassVar[dict[str, str]]
    #: parameters outside the blocks
    top_names: ClassVar[dict[str, str]] = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    #: Hugging Face tensors that are not weights (old exports carry the rotary table)
    ignored: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    #: tensors inside a block that this library keeps and Hugging Face does not (an MoE layer's
    #: load-balancing bias): an import starts them at zero, an export leaves them out
    not_in_hf: ClassVar[tuple[str, ...]] = ()
    #: whether an export writes DeepSeek's copies of the embedding and output head into each
    #: multi-token-prediction depth (``MTP_COPIES``)
    mtp_copies: ClassVar[bool] = True
    #: fused parameter inside a block -> the separate tensors it holds, in order
    fused: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention.wqkv.weight": (
            "attention.wq.weight",
            "attention.wk.weight",
            "attention.wv.weight",
        )
    }

    def __init__(self, args: Any) -> None:
        self.args = args

    # ---- what a family provides

    def tensor_to_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """A (full) tensor of ours in the Hugging Face layout; default: unchanged."""
        return w

    def tensor_from_hf(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`tensor_to_hf` (``name`` is ours)."""
        return w

    @abstractmethod
    def hf_config(self, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
        """``config.json`` of a ``transformers`` model with these hyper-parameters."""

    @classmethod
    @abstractmethod
    def args_from_hf_config(cls, config: dict) -> Any:
        """The family's args from a ``config.json`` (HFFormatError if it cannot build it)."""

    def shared_config(
        self, *, intermediate_size: int, dtype: torch.dtype, bos_id: int | None, eos_id: int | None
    ) -> dict[str, Any]:
        """The ``config.json`` keys every dense decoder family writes alike (a family adds its
        ``architectures``, ``model_type`` and own keys)."""
        args = self.args
        return {
            "hidden_size": args.dim,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "max_position_embeddings": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_word_embeddings,
            "attention_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
        }

    # ---- names

    def hf_name(self, name: str) -> str:
        if name in self.top_names:
            return self.top_names[name]
        block, mtp = _BLOCK_KEY.match(name), _MTP_KEY.match(name)
        if block and block.group(2) in self.layer_names:
            index = block.group(1).split(".")[1]
            return f"model.layers.{index}.{self.layer_names[block.group(2)]}"
        if mtp and mtp.group(2) in MTP_NAMES:
            return f"model.layers.{mtp.group(1)}.{MTP_NAMES[mtp.group(2)]}"
        raise HFFormatError(f"parameter '{name}' has no Hugging Face {self.model_type} counterpart")

    def our_name(self, hf: str) -> str | None:
        """Ours for a Hugging Face name; layers after the main ones are multi-token-prediction
        depths (their copies of the embedding and head: None, see :func:`is_mtp_copy`)."""
        top = {v: k for k, v in self.top_names.items()}
        if hf in top:
            return top[hf]
        m = _HF_LAYER_KEY.match(hf)
        if m is None:
            return None
        index, rest = int(m.group(1)), m.group(2)
        inverse = {v: k for k, v in self.layer_names.items()}
        if index < self.args.n_layers or not hasattr(self.args, "num_mtp_layers"):
            return f"layers.{index}.{inverse[rest]}" if rest in inverse else None
        own = {v: k for k, v in MTP_NAMES.items()}
        if rest in own:
            return f"mtp_layers.{index}.{own[rest]}"
        return f"mtp_layers.{index}.block.{inverse[rest]}" if rest in inverse else None

    def is_mtp_copy(self, hf: str) -> bool:
        """A depth's copy of the embedding or output head (``model.layers.N.embed_tokens``, N
        after the main layers): this library shares the model's own."""
        m = _HF_LAYER_KEY.match(hf)
        return m is not None and int(m.group(1)) >= self.args.n_layers and m.group(2) in MTP_COPIES

    def _not_in_hf(self, name: str) -> bool:
        m = _BLOCK_KEY.match(name)
        return m is not None and m.group(2) in self.not_in_hf

    def _mtp_index(self, name: str) -> int | None:
        m = _MTP_KEY.match(name)
        return int(m.group(1)) if m else None

    def _in_model(self, name: str) -> bool:
        """A parameter of the whole model (perhaps held by another pipeline stage)."""
        n_layers = self.args.n_layers
        depth = self._mtp_index(name)
        if depth is not None:
            return n_layers <= depth < n_layers + getattr(self.args, "num_mtp_layers", 0)
        m = _BLOCK_KEY.match(name)
        return name in self.top_names if m is None else int(m.group(1).split(".")[1]) < n_layers

    # ---- fused parameters

    def fused_parts(self, name: str) -> tuple[str, ...] | None:
        """The full names of the separate tensors that parameter ``name`` fuses (None if it is
        not fused)."""
        m = _BLOCK_KEY.match(name)
        if m is None or m.group(2) not in self.fused:
            return None
        return tuple(f"{m.group(1)}.{part}" for part in self.fused[m.group(2)])

    def split_tensor(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Fused ``w`` (or a tensor of its shape, e.g. an optimizer moment) as its parts."""
        return split_qkv(w, self.args.n_heads, self.args.n_kv_heads)

    def merge_tensors(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`split_tensor`."""
        return fuse_qkv(*parts, n_kv_heads=self.args.n_kv_heads)

    def unfuse(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each fused (full) tensor replaced by its separate parts; shapes
        (``torch.Size``) are split the same way."""
        out: dict[str, Any] = {}
        for name, w in state.items():
            parts = self.fused_parts(name)
            if parts is None:
                out[name] = w
                continue
            if isinstance(w, torch.Size):
                pieces = self.split_tensor(name, torch.empty(w, device="meta"))
                out.update({p: t.shape for p, t in zip(parts, pieces)})
            else:
                out.update(zip(parts, self.split_tensor(name, w)))
        return out

    def fuse(self, state: dict[str, Any], names: Any) -> dict[str, Any]:
        """``state`` with the parts of each fused parameter among ``names`` (a model's parameter
        names) merged into it; parts missing from ``state`` leave that parameter out."""
        out = dict(state)
        for name in names:
            parts = self.fused_parts(name) or ()
            if parts and all(p in out for p in parts):
                out[name] = self.merge_tensors(name, [out.pop(p) for p in parts])
        return out

    # ---- state dicts

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our (full, unsharded) state dict in ``transformers``' names and layout."""
        out = {}
        for name, w in self.unfuse(state).items():
            if name == "output.weight" and self.args.tie_word_embeddings:
                continue  # transformers ties lm_head to embed_tokens itself
            if self._not_in_hf(name):
                if w.count_nonzero():
                    logger.warning(
                        f"{name} is not zero, but a Hugging Face {self.model_type} model has no "
                        "such tensor: the exported model routes without it"
                    )
                continue
            out[self.hf_name(name)] = self.tensor_to_hf(name, w).contiguous()
        # each prediction depth's copies of the embedding and head, as DeepSeek publishes them
        depths = {self._mtp_index(n) for n in state} - {None} if self.mtp_copies else set()
        for depth in sorted(depths):
            for hf, ours in MTP_COPIES.items():
                if ours in state:
                    out[f"model.layers.{depth}.{hf}"] = out[self.top_names[ours]].clone()
        return out

    def from_hf(
        self, hf_state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
    ) -> dict[str, torch.Tensor]:
        """``transformers`` weights as our state dict. ``expected``: the names and shapes of the
        parameters wanted (a pipeline stage's: the other stages' are dropped); any name or shape
        that does not match is listed in one HFFormatError."""
        wanted = list(expected)
        expected = self.unfuse(expected)
        state: dict[str, torch.Tensor] = {}
        unexpected = []
        for hf, w in hf_state.items():
            name = self.our_name(hf)
            if name is None:
                if not any(part in hf for part in self.ignored) and not self.is_mtp_copy(hf):
                    unexpected.append(hf)
                continue
            try:  # a misshapen tensor is kept as it is, for the error below
                state[name] = self.tensor_from_hf(name, w) if name in expected else w
            except (RuntimeError, ValueError, IndexError):
                state[name] = w
        for name, shape in expected.items():
            if self._not_in_hf(name):
                state[name] = torch.zeros(shape)
        tied = self.args.tie_word_embeddings
        if tied and "output.weight" in expected and "output.weight" not in state:
            if "tok_embeddings.weight" in state:
                state["output.weight"] = state["tok_embeddings.weight"]
        missing = [self.hf_name(n) for n in expected if n not in state]
        unused_depths = set()
        for name in [n for n in state if n not in expected]:
            depth = self._mtp_index(name)
            if depth is not None and not self._in_model(name):
                unused_depths.add(depth)  # prediction depths this model does not have
            elif not self._in_model(name):
                unexpected.append(self.hf_name(name))
            del state[name]  # another pipeline stage's parameter (or an unexpected one)
        if unused_depths:
            logger.info(
                f"Hugging Face layers {sorted(unused_depths)} are multi-token-prediction depths "
                "this model does not have (model.num_mtp_layers): not loaded"
            )
        shapes = [
            f"{self.hf_name(n)} {tuple(state[n].shape)} vs {tuple(s)}"
            for n, s in expected.items()
            if n in state and tuple(state[n].shape) != tuple(s)
        ]
        problems = []
        for what, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)):
            if items:
                more = f" and {len(items) - 4} more" if len(items) > 4 else ""
                problems.append(f"{len(items)} {what}: {', '.join(items[:4])}{more}")
        if problems:
            raise HFFormatError(
                "Hugging Face weights do not match this model (" + "; ".join(problems) + ")"
            )
        return self.fuse(state, wanted)
