"""The mixture-of-experts feed-forward layer: math only, no parallelism.

``MoE(x)``: a token-choice top-k router picks ``top_k`` of ``num_experts`` SwiGLU experts for each
token; the experts' outputs, weighted by the router's scores, are summed, plus optional shared
experts every token goes through. Dropless: every expert takes every token routed to it.

* **Router.** ``gate`` (a bias-free ``dim -> num_experts`` linear), scores by softmax or sigmoid
  in float32, top-k selection (on ``scores + expert_bias`` when the bias is used: the bias only
  chooses, the weights stay the scores), optional renormalization of the top-k weights to sum to
  one (``route_norm``) and a constant factor (``route_scale``). ``score_before_experts`` scales
  an expert's *input* by its weight instead of its output (Llama 4). Group-limited routing
  (DeepSeek-V3's ``n_group`` / ``topk_group``): the experts form ``num_groups`` equal groups,
  each ranked by the sum of its two best biased scores, and a token chooses only among the
  experts of its ``topk_groups`` best groups.
* **Routed experts** hold their weights stacked: ``w1``/``w3`` ``[E, hidden, dim]`` and ``w2``
  ``[E, dim, hidden]`` (each expert's slice is an ``nn.Linear`` weight); gpt-oss adds biases
  ``w1_bias``/``w3_bias [E, hidden]`` and ``w2_bias [E, dim]``, a bias on the router's ``gate`` and its clamped
  activation (``MoEArgs.activation``). Tokens are sorted by
  expert and run through ``torch._grouped_mm`` (one kernel for all experts; float32 on CPU,
  bfloat16 on H100), or a per-expert loop, the reference the tests compare it to.
* **Load balancing without an auxiliary loss** (DeepSeek-V3, arXiv:2412.19437 section 2.1.2;
  Wang et al., arXiv:2408.15664): the persistent buffer ``expert_bias [E]`` enters the top-k
  choice only. The layer counts the tokens routed to each expert in ``tokens_per_expert``; the
  trainer sums the counts over the step and the data-parallel ranks and moves the bias towards the
  under-loaded experts (``torchtitan/distributed/expert_load.py``). Under activation
  checkpointing the recomputed forward counts its tokens again: every count of the layer doubles,
  which changes neither the sign-based update nor the max/mean load ratio.
* **Auxiliary loss** (optional, sequence-wise as in DeepSeek-V3 eq. 17-20):
  ``E * sum_i f_i * P_i`` per sequence, with ``f_i`` the fraction of the sequence's ``k * T``
  choices that went to expert ``i`` and ``P_i`` its mean normalized score; 1 when the load is
  uniform. Each sequence's value joins the training objective with weight ``aux_loss_scale`` (set
  by the trainer: the coefficient over the step's sequences, so the objective gets the coefficient
  times the mean over the global batch) through the backward pass of the layer's output
  (:class:`_AddAuxLossGrad`): it needs no path to the loss and works the same under pipeline
  parallelism. Being per sequence, it does not depend on how a batch is split into micro-batches
  or data-parallel ranks (context parallelism, which splits the sequences, computes it over each
  rank's part of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.blocks import FeedForward, local_part, trunc_normal_
from torchtitan.observability.log import logger

__all__ = [
    "MoEArgs",
    "MoE",
    "GroupedExperts",
    "TokenChoiceRouter",
    "SCORE_FUNCS",
    "ACTIVATIONS",
    "inactive_params",
]

SCORE_FUNCS = ("softmax", "sigmoid")
# the experts' gated activation of (gate, up): SwiGLU ``silu(gate) * up``, or gpt-oss's
# ``min(gate, L) * sigmoid(alpha * min(gate, L)) * (clamp(up, -L, L) + 1)``
ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass
class MoEArgs:
    """One MoE layer's hyper-parameters (``transformers`` names in brackets)."""

    num_experts: int = 8  # num_experts / num_local_experts
    top_k: int = 1  # num_experts_per_tok
    hidden_dim: int = 1024  # moe_intermediate_size / intermediate_size: each expert's width
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    route_norm: bool = False  # norm_topk_prob: the top-k weights renormalized to sum to one
    route_scale: float = 1.0  # the top-k weights times this
    score_before_experts: bool = False  # weight scales the expert's input (Llama 4), not output
    shared_hidden_dim: int = 0  # the shared expert's SwiGLU width; 0: no shared expert
    # Qwen3-Next: the shared expert's output times sigmoid(a linear of the token) [shared_expert_gate]
    shared_gate: bool = False
    # group-limited routing (DeepSeek-V3): the experts form num_groups groups [n_group]; a token
    # chooses among the experts of its topk_groups best groups [topk_group], a group ranked by
    # the sum of its two best (biased) scores. 1 group: every expert.
    num_groups: int = 1
    topk_groups: int = 1
    # layer i (from 0) is an MoE layer when (i + 1) % every == 0 (decoder_sparse_step /
    # interleave_moe_layer_step); the others are dense with the family's own width
    every: int = 1
    first_dense: int = 0  # the first layers are dense whatever every says [first_k_dense_replace]
    # gpt-oss: the router's linear has a bias [router.bias]; each expert's projections have
    # biases [gate_up_proj_bias, down_proj_bias]; the experts' activation (ACTIVATIONS)
    gate_bias: bool = False
    expert_linear_bias: bool = False
    activation: str = "silu"
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, -limit <= up <= limit
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate) * (up + 1)
    # how a run trains, not an architecture setting (not in config.json, not compared):
    # the expert-bias update rate per step (0: the bias stays zero), the auxiliary-loss
    # coefficient (0: none) and the grouped-mm kernel (False: the per-expert loop)
    load_balance_coeff: float = field(default=0.0, compare=False)
    aux_loss_coeff: float = field(default=0.0, compare=False)
    grouped_mm: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"score_func {self.score_func!r} is not one of: {', '.join(SCORE_FUNCS)}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.activation!r} is not one of: {', '.join(ACTIVATIONS)}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.shared_gate and self.shared_hidden_dim <= 0:
            raise ValueError("shared_gate needs a shared expert (shared_hidden_dim > 0)")
        if self.every < 1:
            raise ValueError(f"every ({self.every}) must be at least 1")
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if self.num_experts % self.num_groups or per_group < 2:
                raise ValueError(
                    f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})"
                    " into groups of at least 2 experts"
                )
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(
                    f"topk_groups ({self.topk_groups}) must be in 1..num_groups ({self.num_groups})"
                )
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(
                    f"top_k ({self.top_k}) exceeds the {self.topk_groups * per_group} experts of"
                    f" topk_groups ({self.topk_groups}) groups of {per_group}"
                )

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense and (layer_id + 1) % self.every == 0


def inactive_params(model: nn.Module) -> int:
    """The routed-expert parameters a token does not use: ``(E - k) / E`` of each MoE layer's
    experts (of the experts this module holds). Total minus this is the active parameter count."""
    inactive = 0
    for m in model.modules():
        if isinstance(m, MoE):
            held = sum(p.numel() for p in m.experts.parameters())
            inactive += held * (m.num_experts - m.args.top_k) // m.num_experts
    return inactive


class TokenChoiceRouter(nn.Module):
    """``(weights [N, k] float32, experts [N, k] int64, scores [N, E] float32)`` of ``x [N, dim]``."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=args.gate_bias)
        self.args = args

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        bias = None if self.gate.bias is None else local_part(self.gate.bias)
        logits = F.linear(x, local_part(self.gate.weight), bias).float()
        scores = logits.softmax(dim=-1) if a.score_func == "softmax" else logits.sigmoid()
        if expert_bias is None and a.num_groups == 1:
            weights, experts = scores.topk(a.top_k, dim=-1)
        else:  # the bias and the groups choose; the weights stay the scores
            choice = scores if expert_bias is None else scores + expert_bias
            if a.num_groups > 1:
                choice = _best_groups_only(choice, a.num_groups, a.topk_groups)
            experts = choice.topk(a.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores


def _best_groups_only(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice [N, E]`` with the experts outside each row's ``topk_groups`` best groups at
    -inf; a group's rank is the sum of its two best values."""
    grouped = choice.unflatten(-1, (num_groups, -1))  # [N, G, E / G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
    best = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


@torch.library.custom_op("torchtitan::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` (rows of group ``g`` end at ``offs[g]``) times ``w[g] [K, M]``: ``[N, M]``.

    ``torch._grouped_mm`` as an op of its own, so that ``torch.compile`` takes it whole: its
    fake (shape-only) implementation in torch 2.13 accepts only bfloat16, while the CPU kernel
    computes float32 too. The backward is two more grouped matmuls."""
    return torch._grouped_mm(x, w, offs=offs)


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("torchtitan::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The weight gradient of :func:`grouped_mm`: ``x[rows of g].T @ grad[rows of g]``, ``[G, K, M]``
    (zero for a group without rows)."""
    return torch._grouped_mm(x.t(), grad, offs=offs)


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()  # the kernel refuses broadcast (zero-stride) gradients
    gx = grouped_mm(grad, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    gw = grouped_mm_weight_grad(x, grad, offs) if ctx.needs_input_grad[1] else None
    return gx, gw, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


Biases = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # w1_bias [E, hidden], w2_bias [E, dim], w3_bias


def glu(gate: torch.Tensor, up: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """The experts' gated activation (``args.activation``, see ``ACTIVATIONS``)."""
    if args.activation == "silu":
        return F.silu(gate) * up
    limit = args.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(args.swiglu_alpha * gate) * (up + 1)


def _swiglu_grouped(
    x: torch.Tensor,
    w: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    counts: torch.Tensor,
    args: MoEArgs,
    biases: Biases | None = None,
) -> torch.Tensor:
    """All experts at once: ``x`` holds expert 0's rows, then expert 1's, ... (``counts``)."""
    w1, w2, w3 = w
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = grouped_mm(x, w1.transpose(-2, -1), offs), grouped_mm(x, w3.transpose(-2, -1), offs)
    if biases is not None:  # each row's expert, without a host sync
        b1, b2, b3 = biases
        expert = torch.arange(len(counts), device=x.device)
        expert = expert.repeat_interleave(counts, output_size=x.shape[0])
        gate, up = gate + b1[expert], up + b3[expert]
    out = grouped_mm(glu(gate, up, args), w2.transpose(-2, -1), offs)
    return out if biases is None else out + b2[expert]


def _swiglu_loop(
    x: torch.Tensor,
    w: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    counts: torch.Tensor,
    args: MoEArgs,
    biases: Biases | None = None,
) -> torch.Tensor:
    """The reference: one expert after another (a host sync for the counts)."""
    (w1, w2, w3), out = w, []
    for e, p in enumerate(x.split(counts.tolist())):
        gate, up = p @ w1[e].T, p @ w3[e].T
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[2][e]
        y = glu(gate, up, args) @ w2[e].T
        out.append(y if biases is None else y + biases[1][e])
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def _kernel_takes(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these sizes. CUDA's kernel needs every row 16-byte
    aligned (``dim`` and ``hidden_dim`` multiples of 8 in bfloat16) and refuses others with
    "strides should be multiple of 16 bytes"; those sizes run the per-expert loop (the same
    math), with one warning. The CPU kernel takes any size."""
    if x.device.type != "cuda":
        return True
    if all(n * x.element_size() % 16 == 0 for n in w1.shape[1:]):
        return True
    sizes = (w1.shape[2], w1.shape[1], x.dtype)
    if not torch.compiler.is_compiling() and sizes not in _WARNED_UNALIGNED:
        _WARNED_UNALIGNED.add(sizes)
        logger.warning(
            f"moe: CUDA's grouped matmul needs dim and moe hidden_dim to be multiples of "
            f"{16 // x.element_size()} ({x.dtype}); dim {w1.shape[2]}, hidden_dim {w1.shape[1]} "
            "run the experts one after another instead"
        )
    return False


_WARNED_UNALIGNED: set[tuple[int, int, torch.dtype]] = set()


class GroupedExperts(nn.Module):
    """``num_experts`` gated experts, weights stacked on dim 0: ``forward(x, counts)`` with the
    rows of ``x`` sorted by expert and ``counts [E]`` rows per expert (the local experts' rows
    only, when expert parallelism has sharded dim 0). ``args`` (a :class:`MoEArgs`, default
    plain SwiGLU) chooses the activation and whether each expert's projections have biases
    ``w1_bias``/``w3_bias [E, hidden]`` and ``w2_bias [E, dim]``.

    The module computes on its parameters' local parts (:func:`local_part`): which rows reach
    which expert is data-dependent, beyond what DTensor can describe. Where a parallelism splits
    the hidden width, each rank's output is a partial sum that it adds up; it then clears
    ``adds_output_bias`` on all of those ranks but one, whose output alone carries ``w2_bias``.
    The others still pass ``w2_bias`` its gradient (their forward adds ``b - b.detach()``, zero),
    so every copy of it gets the whole gradient with no communication."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        grouped_mm: bool,
        args: MoEArgs | None = None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.args = args if args is not None else MoEArgs(num_experts=num_experts)
        self.w1_bias = self.w2_bias = self.w3_bias = None
        if self.args.expert_linear_bias:
            self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.grouped_mm = grouped_mm
        self.adds_output_bias = True  # see the class doc

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w = (local_part(self.w1), local_part(self.w2), local_part(self.w3))
        biases = None
        if self.w1_bias is not None:
            b1, b2, b3 = (local_part(b) for b in (self.w1_bias, self.w2_bias, self.w3_bias))
            biases = (b1, b2 if self.adds_output_bias else b2 - b2.detach(), b3)
        run = _swiglu_grouped if self.grouped_mm and _kernel_takes(x, w[0]) else _swiglu_loop
        return run(x, w, counts, self.args, biases)

    def init_weights(self, init_std: float) -> None:
        """w1/w3: truncated normal std 0.02; w2 (output side): the given std; biases zero."""
        for w, std in ((self.w1, 0.02), (self.w3, 0.02), (self.w2, init_std)):
            trunc_normal_(w, std=std)
        for b in (self.w1_bias, self.w2_bias, self.w3_bias):
            if b is not None:
                nn.init.zeros_(b)


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; its backward also sends ``scale`` as the gradient of ``aux``, so the
    auxiliary loss joins the objective with weight ``scale`` without reaching the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        aux_grad = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class SharedGate(nn.Linear):
    """The shared expert's gate logit ``[N, 1]`` (Qwen3-Next), computed like the router's on
    the weight's local copy (a parallelism may have replicated it as a DTensor)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local_part(self.weight))


class MoE(nn.Module):
    """The MoE feed-forward: ``forward(x [B, T, dim]) -> [B, T, dim]`` (see the module doc)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.router = TokenChoiceRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args.grouped_mm, args)
        self.shared_experts = (
            FeedForward(dim, args.shared_hidden_dim) if args.shared_hidden_dim > 0 else None
        )
        self.shared_gate = SharedGate(dim) if args.shared_gate else None
        # persistent: the routing a checkpoint resumes with; zero unless load balancing moves it
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        # the tokens routed to each expert, and the auxiliary loss's sum over sequences and the
        # sequences, since the trainer last read them (not saved)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)
        # the weight of each sequence's auxiliary loss in the objective (set by the trainer: the
        # coefficient over the sequences of a step)
        self.aux_loss_scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        flat = x.reshape(-1, dim)
        bias = self.expert_bias if self.args.load_balance_coeff > 0 else None
        weights, experts, scores = self.router(flat, bias)
        counts = torch.histc(experts.float(), bins=self.num_experts, min=0, max=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        out = self.routed(flat, weights, experts, counts)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        out = out.reshape(bsz, seq_len, dim)
        if self.args.aux_loss_coeff > 0 and self.training:
            aux = self.aux_loss(scores.view(bsz, seq_len, -1), experts.view(bsz, seq_len, -1))
            with torch.no_grad():
                self.aux_loss_sum.add_(torch.stack((aux.detach().sum(), aux.new_tensor(bsz))))
            if torch.is_grad_enabled() and self.aux_loss_scale:
                out = _AddAuxLossGrad.apply(out, aux.sum(), self.aux_loss_scale)
        return out

    def routed(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum for each row of ``x [N, dim]``: the ``N * k`` choices
        sorted by expert, gathered, run, scaled by their weights and added back to their rows."""
        order = experts.flatten().argsort(stable=True)
        rows = order // self.args.top_k
        w = weights.flatten()[order].unsqueeze(-1)
        routed_in = x[rows]
        if self.args.score_before_experts:
            routed_in = (routed_in.float() * w).to(x.dtype)
        routed_out = self.experts(routed_in, counts.to(torch.int64))
        if not self.args.score_before_experts:
            routed_out = (routed_out.float() * w).to(x.dtype)
        return torch.zeros_like(x).index_add(0, rows, routed_out)

    def aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The balance loss of each sequence ``[B]``: ``scores [B, T, E]``, ``experts [B, T, k]``."""
        n_experts, top_k, seq_len = self.num_experts, experts.shape[-1], experts.shape[1]
        probs = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores normalized per token
        chosen = F.one_hot(experts, n_experts).sum(dim=(1, 2)).float()  # [B, E]
        load = chosen * n_experts / (top_k * seq_len)
        return (load * probs.mean(dim=1)).sum(dim=-1)

    def init_weights(self, init_std: float) -> None:
        """Router: truncated normal std 0.02; experts as :class:`GroupedExperts`; shared expert
        as :class:`FeedForward`; the bias and counters to zero."""
        trunc_normal_(self.router.gate.weight, std=0.02)
        if self.router.gate.bias is not None:
            trunc_normal_(self.router.gate.bias, std=0.02)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        if self.shared_gate is not None:
            trunc_normal_(self.shared_gate.weight, std=0.02)
        for buf in (self.expert_bias, self.tokens_per_expert, self.aux_loss_sum):
            if not buf.is_meta:
                buf.zero_()
