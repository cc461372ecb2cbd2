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

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


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
        m = _LAYER_KEY.match(name)
        if not m or m.group(2) not in self.layer_names:
            raise HFFormatError(
                f"parameter '{name}' has no Hugging Face {self.model_type} counterpart"
            )
        return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}"

    def our_name(self, hf: str) -> str | None:
        top = {v: k for k, v in self.top_names.items()}
        if hf in top:
            return top[hf]
        m = _HF_LAYER_KEY.match(hf)
        if m:
            inverse = {v: k for k, v in self.layer_names.items()}
            if m.group(2) in inverse:
                return f"layers.{m.group(1)}.{inverse[m.group(2)]}"
        return None

    def _not_in_hf(self, name: str) -> bool:
        m = _LAYER_KEY.match(name)
        return m is not None and m.group(2) in self.not_in_hf

    def _in_model(self, name: str) -> bool:
        """A parameter of the whole model (perhaps held by another pipeline stage)."""
        m = _LAYER_KEY.match(name)
        return name in self.top_names if m is None else int(m.group(1)) < self.args.n_layers

    # ---- fused parameters

    def fused_parts(self, name: str) -> tuple[str, ...] | None:
        """The full names of the separate tensors that parameter ``name`` fuses (None if it is
        not fused)."""
        m = _LAYER_KEY.match(name)
        if m is None or m.group(2) not in self.fused:
            return None
        return tuple(f"layers.{m.group(1)}.{part}" for part in self.fused[m.group(2)])

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
                if not any(part in hf for part in self.ignored):
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
        for name in [n for n in state if n not in expected]:
            if not self._in_model(name):
                unexpected.append(self.hf_name(name))
            del state[name]  # another pipeline stage's parameter (or an unexpected one)
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
