"""The skeleton of a dense decoder-only language model, which each family fills in.

``tok_embeddings -> layers["0"] .. layers["n-1"] -> norm -> output``, every block called as
``block(h, rope_cache, mask)`` (``mask``: None for causal attention, else the block-causal mask
of the batch's documents, built once per forward by the first block's attention kernel). The attribute names are a contract with the generic code: the pipeline
split drops ``layers`` entries and sets ``tok_embeddings`` / ``norm`` / ``output`` to ``None``
(``forward`` then passes its input through the missing parts), FSDP and activation checkpointing
wrap each entry of ``layers``, and a family's tensor-parallel plan names the same modules.

A family subclasses :class:`Decoder` and provides ``build_block(layer_id, args)``,
``build_rope_cache(args, device)`` and ``build_norm(args)``; its args carry ``dim``, ``n_layers``,
``n_heads``, ``head_dim``, ``vocab_size`` and ``tie_word_embeddings``.

Intended construction (the parallelisms may be applied between the steps)::

    with torch.device("meta"):
        model = Family(args)
    model.to_empty(device="cuda")
    model.init_weights()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from torchtitan.models.common.attention import ATTN_MASK_TYPES
from torchtitan.models.common.blocks import trunc_normal_
from torchtitan.models.common.moe import inactive_params
from torchtitan.models.common.mtp import MTPLayer, roll_left
from torchtitan.models.common.norms.rmsnorm import NORM_TYPES


def check_decoder_args(args: Any) -> None:
    """The checks every family's args share (called from their ``__post_init__``, after
    ``n_kv_heads`` defaults to ``n_heads``); ValueError naming the field."""
    if args.norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type {args.norm_type!r} is not one of: {', '.join(NORM_TYPES)}")
    if args.attn_mask_type not in ATTN_MASK_TYPES:
        raise ValueError(
            f"attn_mask_type {args.attn_mask_type!r} is not one of: {', '.join(ATTN_MASK_TYPES)}"
        )
    if args.n_heads % args.n_kv_heads != 0:
        raise ValueError(
            f"n_heads ({args.n_heads}) must be divisible by n_kv_heads ({args.n_kv_heads})"
        )
    if args.head_dim % 2 != 0:
        raise ValueError(f"head_dim ({args.head_dim}) must be even for rotary embeddings")


def check_layer_types(
    layer_types: Any, n_layers: int, allowed: tuple[str, ...]
) -> tuple[str, ...] | None:
    """A family's ``layer_types`` (None: the family's default pattern) as a tuple of ``n_layers``
    names from ``allowed``; ValueError naming what is wrong."""
    if layer_types is None:
        return None
    layer_types = tuple(layer_types)
    bad = sorted(set(layer_types) - set(allowed))
    if bad or len(layer_types) != n_layers:
        raise ValueError(
            f"layer_types must name {n_layers} layers (n_layers), each one of: "
            f"{', '.join(allowed)}; got {len(layer_types)} with {bad or 'no'} others"
        )
    return layer_types


class Decoder(nn.Module, ABC):
    """``forward(tokens [B, T] int64) -> logits [B, T, vocab] float32``. ``layers`` is an
    ``nn.ModuleDict`` keyed ``"0"``..``"n-1"`` so pipeline stages can drop layers and keep the
    original names (checkpoint keys stay stable)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                f"vocab_size is {args.vocab_size}; set it from the tokenizer "
                "(tokenizer.n_words) before building the model"
            )
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: recomputed by init_weights, never stored in checkpoints.
        self.register_buffer("rope_cache", self.build_rope_cache(args), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): self.build_block(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.Module | None = self.build_norm(args)
        # multi-token prediction (models/common/mtp.py), keyed by the layer index published
        # checkpoints give them (n_layers + k - 1 for depth k); None without
        n_mtp = getattr(args, "num_mtp_layers", 0)
        self.mtp_layers: nn.ModuleDict | None = None
        if n_mtp > 0:
            self.mtp_layers = nn.ModuleDict(
                {
                    str(i): self.build_mtp_layer(i, args)
                    for i in range(args.n_layers, args.n_layers + n_mtp)
                }
            )
        # True (set by the training loss): forward also runs the prediction depths (see forward)
        self.mtp_active = False
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # True: forward stops at the final norm and the loss applies ``output`` itself, piece by
        # piece (``ChunkedOutputLoss``), so the whole batch's logits never exist at once
        self.output_in_loss = False

    # ---- what a family provides

    @abstractmethod
    def build_block(self, layer_id: int, args: Any) -> nn.Module:
        """Block ``layer_id``: called as ``block(h, rope_cache, mask)``, with ``init_weights()``."""

    @abstractmethod
    def build_rope_cache(self, args: Any, device: torch.device | str | None = None) -> torch.Tensor:
        """The rotary table, position-major (``[max_seq_len, ...]``: context parallel shards
        dim 0)."""

    @abstractmethod
    def build_norm(self, args: Any) -> nn.Module:
        """The final norm (with ``reset_parameters()``)."""

    def build_mtp_layer(self, layer_id: int, args: Any) -> nn.Module:
        """A multi-token-prediction depth around the family's block ``layer_id``."""
        return MTPLayer(args.dim, self.build_block(layer_id, args), lambda: self.build_norm(args))

    # ---- shared

    def _retie(self) -> None:
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Module._apply (to_empty from meta in particular) may replace each module's Parameter
        # with a new object, which would silently untie the embedding and output weights.
        result = super()._apply(fn, *args, **kwargs)
        self._retie()
        return result

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary table and initialize every parameter in place.

        Deterministic given torch's RNG state: embeddings ~ N(0, 1); each block by its own
        ``init_weights``; norms to one; output truncated normal std ``dim ** -0.5``. Every
        truncated normal is cut at 3 std (inverse-CDF sampling, see ``trunc_normal_``).

        With tied embeddings the one shared matrix is truncated normal std 0.02 (the
        ``initializer_range`` of Llama 3.2's and Qwen3's config.json): unit-variance rows would
        make the logits ~dim large at init, and even std ``dim ** -0.5`` lets each position's own
        token embedding dominate its logits (initial loss far above ln(vocab)).

        The table goes to ``buffer_device`` (default: where the buffer already is, i.e. the
        ``to_empty`` device).
        """
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        with torch.no_grad():
            self.rope_cache = self.build_rope_cache(self.args, device=device)
        self._retie()
        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None:
            if tied:
                trunc_normal_(self.tok_embeddings.weight, std=0.02)
            else:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        for layer in (self.mtp_layers or {}).values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            if not tied:
                trunc_normal_(self.output.weight, std=self.args.dim**-0.5, clip_stds=3.0)
            elif self.tok_embeddings is None:
                # a pipeline stage holding only the (tied) output: same scheme as the embedding
                trunc_normal_(self.output.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every position (the final norm's output with ``output_in_loss``); stages
        without embeddings take hidden states instead, stages without the output return them.

        ``doc_ids [B, T]`` (see :mod:`torchtitan.data.batch`) say where the packed documents
        start; with ``attn_mask_type = "block_causal"`` attention stays within them, otherwise
        they are not used.

        With ``mtp_active`` the output holds ``1 + D`` batches stacked on dim 0: the main one,
        then each multi-token-prediction depth's (:meth:`mtp_hidden`). The tensor between
        pipeline stages then stacks the hidden states and the token embeddings the depths read
        on the last stage (one tensor: the pipeline sends one)."""
        mtp = self.mtp_active
        if self.tok_embeddings is not None:
            h = emb = self.tok_embeddings(tokens)
        elif mtp:
            h, emb = tokens.chunk(2)
        else:
            h = tokens
        mask = self.attention_mask(doc_ids)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, mask)
        if self.norm is None:  # a pipeline stage before the last
            return torch.cat([h, emb]) if mtp else h
        h = self.norm(h)
        if mtp:
            h = torch.cat([h, *self.mtp_hidden(h, emb, mask)])
        if self.output is not None and not self.output_in_loss:
            return self.output(h).float()
        return h

    def mtp_hidden(self, h: torch.Tensor, emb: torch.Tensor, mask: Any) -> list[torch.Tensor]:
        """Each prediction depth's states, from the main model's final-norm output ``h`` and the
        token embeddings ``emb``: depth ``k`` reads ``emb`` moved ``k`` places left."""
        if self.mtp_layers is None:
            raise RuntimeError("mtp_active is set, but this model has no multi-token prediction")
        states = []
        for k, layer in enumerate(self.mtp_layers.values(), start=1):
            h = layer(roll_left(emb, k), h, self.rope_cache, mask)
            states.append(h)
        return states

    def attention_mask(self, doc_ids: torch.Tensor | None) -> Any:
        """The mask every block's attention takes for this batch (None: causal attention), built
        by the attention kernel (which a parallelism may have replaced) of the first block."""
        if doc_ids is None or self.args.attn_mask_type == "causal":
            return None
        # the first module with ``mask_for``, whatever wraps the blocks (AC, compile, FSDP); a
        # last pipeline stage may hold no main block but the prediction depths'
        blocks = [self.layers] + ([self.mtp_layers] if self.mtp_layers is not None else [])
        modules = (m for b in blocks for m in b.modules())
        kernel = next((m for m in modules if hasattr(m, "mask_for")), None)
        if kernel is None:
            return None
        # the sliding windows' masks, where a kernel makes them, are made here too
        windows = getattr(self.args, "attention_windows", lambda: [])()
        windows = sorted({w for w in windows if w is not None})
        return kernel.mask_for(doc_ids, windows) if windows else kernel.mask_for(doc_ids)


def get_nparams_and_flops(model: nn.Module, args: Any, seq_len: int) -> tuple[int, int]:
    """Parameter count and training FLOPs per token; works on meta-device models.

    * Parameters: every distinct parameter once (tied embedding/output weights count once).
    * FLOPs per token ``= 6 * N + 6 * n_layers * n_heads * head_dim * seq_len`` where

      - ``N`` is the number of parameters used in matmuls: everything except the input embedding
        table (a lookup), with the output projection counted even when tied to the embedding
        (it is a real ``dim x vocab`` matmul). RMSNorm scales are negligible and included. In a
        mixture-of-experts layer only the active parameters count: the router, the shared
        experts and ``top_k / num_experts`` of the routed experts.
        ``6 = 2`` (multiply-add) ``x 3`` (forward, grad wrt input, grad wrt weight).
      - the attention term covers ``Q K^T`` and ``A V`` (a sliding-window layer's by the keys
        its window holds, see ``args.attention_windows``): ``2 * 2 * T * w`` FLOPs per token and
        layer forward for full attention over query width ``w = n_heads * head_dim`` (``dim``
        for Llama), halved for causal attention, times 3 for forward plus backward:
        ``6 * T * w`` per layer. Grouped-query attention does not change it (every query head
        still attends over T keys of width head_dim). A family whose layers differ in kind
        (linear attention) gives each layer's term itself: ``args.mixer_flops(seq_len)``.

    ``args.n_layers`` and the widths are used for the attention term, so a pipeline stage's
    model still reports the whole model's FLOPs; its parameter count is its own.

    Multi-token prediction (``args.num_mtp_layers``) is counted: its parameters (each depth's
    block and projection; the embedding and head it shares count once) and each depth's
    attention term, as one more layer each, and each depth's pass through the shared output
    head (``6 * dim * vocab`` per token, the head's own term once more).
    """
    params = list(model.parameters())  # deduplicates shared Parameters
    nparams = sum(p.numel() for p in params)

    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    emb_numel = embedding.weight.numel() if embedding is not None else 0
    out_numel = output.weight.numel() if output is not None else 0
    tied = embedding is not None and output is not None and output.weight is embedding.weight

    # a mixture-of-experts layer's token runs through top_k of its experts only
    matmul_params = nparams - emb_numel + (out_numel if tied else 0) - inactive_params(model)
    attention_width = args.n_heads * args.head_dim
    n_mtp = getattr(args, "num_mtp_layers", 0)
    matmul_params += n_mtp * args.dim * args.vocab_size  # each depth's logits
    mixer_flops = getattr(args, "mixer_flops", None)  # a family whose layers differ in kind
    if mixer_flops is not None:
        attention = sum(mixer_flops(seq_len))
    else:
        windows = getattr(args, "attention_windows", lambda: [None] * args.n_layers)()
        attention = sum(attention_flops(attention_width, seq_len, w) for w in windows)
    attention += n_mtp * attention_flops(attention_width, seq_len, None)
    return nparams, int(6 * matmul_params + attention)


def attention_flops(width: int, seq_len: int, window: int | None = None) -> float:
    """One layer's ``Q K^T`` and ``A V``, forward and backward, per token: ``12 * width`` per key
    a query sees on average (causal: ``T / 2``; a window of ``W < T`` keys, the query's own
    included: ``(W (W + 1) / 2 + (T - W) W) / T``)."""
    if window is None or window >= seq_len:
        return 6 * width * seq_len
    mean_keys = (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
    return 12 * width * mean_keys
