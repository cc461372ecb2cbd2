"""Tensor parallelism machinery: a family gives the per-block plan, this applies it.

The modules outside the blocks (``tok_embeddings``, ``norm``, ``output``: the decoder contract of
``models/common/decoder.py``) get one plan for every family; each block gets the family's
``block_plan(styles)``, whose ``styles`` picks torchao's float8 styles where a linear is float8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.distributed.expert_parallel import EXPERT_WIDTH_DIMS
from torchtitan.distributed.utils import waited
from torchtitan.lora.layers import LoRAColwiseParallel, LoRARowwiseParallel, is_lora
from torchtitan.observability.log import logger
from torchtitan.quantization import float8


def uses_loss_parallel(dims: Any, parallelism: Any) -> bool:
    """Whether the loss runs vocab-parallel on the sharded logits (``loss_parallel()``): under
    tensor parallelism unless ``parallelism.disable_loss_parallel``."""
    return dims.tp > 1 and not parallelism.disable_loss_parallel


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    block_plan: Callable[[Any], dict[str, Any]],
    *,
    loss_parallel: bool,
    async_tp: bool = False,
    compiled_blocks: bool = False,
    float8_tensorwise: bool = False,
    experts_whole: bool = False,
) -> None:
    """Megatron-style TP: the family's ``block_plan`` in each block (for Llama: column-wise
    wq/wk/wv/w1/w3, row-wise wo/w2, sequence parallel norms), the embedding row-wise, the output
    column-wise, the final norm sequence parallel.

    Activations between blocks stay sharded along the sequence (``Shard(1)``); each attention and
    feed-forward input is all-gathered once and its output reduce-scattered back. With
    ``async_tp`` (CUDA and compiled blocks), inductor splits those collectives into pieces that
    overlap with the matmuls through symmetric memory.

    With ``float8_tensorwise`` (float8 converter, tensorwise recipe), the block linears that are
    torchao ``Float8Linear`` get torchao's float8 styles: inputs are cast to float8 (one scale over
    the whole sequence) before the all-gather, which then moves one byte per element, and so are
    the output gradients before their all-gather in backward. Linears left in high precision
    (``float8.filter_fqns``, sizes not divisible by 16) keep the plain styles, and a block input
    is gathered in float8 only if every linear reading it is float8.

    ``experts_whole`` (``expert_tensor_parallel_degree`` 1 with expert parallel): an MoE layer's
    routed experts stay whole, and the TP ranks split its routed rows between them instead.
    """
    if async_tp:
        from torch._inductor import config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor_config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    # torch's SequenceParallel re-registers a norm's weight as trainable: a frozen one (a LoRA
    # run's) is frozen again below
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    root_plan = _root_plan(model, loss_parallel)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if compiled_blocks and model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_materialize_async_output)
    styles = BlockStyles(float8_tensorwise, experts_whole)
    for block in model.layers.values():
        styles.block = block
        parallelize_module(block, tp_mesh, block_plan(styles))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    if float8_tensorwise:
        logger.info(
            f"Float8 tensor parallel: torchao's float8 styles on {styles.float8_linears} linears, "
            f"{styles.float8_inputs} block inputs all-gathered in float8"
        )


def _root_plan(model: nn.Module, loss_parallel: bool) -> dict[str, Any]:
    """The styles of the modules outside the blocks that this (pipeline) part holds."""
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        colwise = LoRAColwiseParallel if is_lora(model.output) else ColwiseParallel
        plan["output"] = colwise(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


class BlockStyles:
    """The TP style of each linear of ``block``: torchao's float8 style where it is float8."""

    def __init__(self, float8_tensorwise: bool, experts_whole: bool = False) -> None:
        self.block: nn.Module | None = None  # the block being planned
        self.experts_whole = experts_whole  # see apply_tp
        self.float8 = float8_tensorwise
        self.float8_linears = self.float8_inputs = 0
        if float8_tensorwise:
            self.f8_colwise, self.f8_rowwise, self.f8_prepare = float8.tp_styles()

    def _is_float8(self, fqn: str) -> bool:
        return self.float8 and float8.is_float8_linear(self.block.get_submodule(fqn))

    def colwise(self, fqn: str, **kwargs) -> ColwiseParallel:
        if not self._is_float8(fqn):
            return self.unquantized_colwise(fqn, **kwargs)
        self.float8_linears += 1
        return self.f8_colwise(**kwargs)

    def rowwise(self, fqn: str, **kwargs) -> RowwiseParallel:
        if not self._is_float8(fqn):
            return self.unquantized_rowwise(fqn, **kwargs)
        self.float8_linears += 1
        return self.f8_rowwise(**kwargs)

    def unquantized_colwise(self, fqn: str, **kwargs) -> ColwiseParallel:
        """The plain style, or LoRA's where the linear has adapters (``torchtitan/lora``)."""
        lora = is_lora(self.block.get_submodule(fqn))
        return (LoRAColwiseParallel if lora else ColwiseParallel)(**kwargs)

    def unquantized_rowwise(self, fqn: str, **kwargs) -> RowwiseParallel:
        lora = is_lora(self.block.get_submodule(fqn))
        return (LoRARowwiseParallel if lora else RowwiseParallel)(**kwargs)

    def prepare_input(self, fqn: str, readers: tuple[str, ...], **kwargs) -> PrepareModuleInput:
        """Gather ``fqn``'s input in float8 only if every linear reading it casts to float8."""
        if not all(self._is_float8(f"{fqn}.{r}") for r in readers):
            return PrepareModuleInput(**kwargs)
        self.float8_inputs += 1
        # the cast takes its config from the first reader (the converter gives all one config)
        return self.f8_prepare(fwd_config_submodule_fqn=readers[0], **kwargs)


def _materialize_async_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output, waited for before the compiled blocks (:func:`utils.waited`)."""
    return waited(output)


def decoder_block_plan(styles: BlockStyles) -> dict[str, Any]:
    """The plan of the shared ``TransformerBlock`` (``models/common/blocks.py``), Megatron-style:
    column-wise wqkv/w1/w3 (``wqkv`` rows are grouped by kv head, so each rank gets whole groups
    of query, key and value heads), row-wise wo/w2 (their outputs reduce-scattered back to the
    sequence-sharded ``Shard(1)`` activations), sequence-parallel norms. Biases follow their
    linears (``wqkv``'s split with its rows, ``wo``'s added once to the reduced sum) and the
    attention sinks their query heads. ``styles`` picks torchao's float8 style for float8
    linears (``styles.block`` is the block)."""
    attention: ParallelStyle = styles.prepare_input(
        "attention",
        ("wqkv",),
        input_layouts=(Shard(1), None, None),  # x, rope_cache, mask (None: causal)
        desired_input_layouts=(Replicate(), None, None),
    )
    if getattr(styles.block.attention, "sinks", None) is not None:  # one per query head
        attention = InOrder(attention, ShardParameters({"sinks": 0}))
    return {
        "attention_norm": SequenceParallel(),
        "attention": attention,
        "attention.wqkv": styles.colwise("attention.wqkv"),
        "attention.wo": styles.rowwise("attention.wo", output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        **(
            moe_plan(styles)
            if getattr(styles.block, "moe", None) is not None
            else feed_forward_plan(styles)
        ),
    }


def feed_forward_plan(styles: BlockStyles) -> dict[str, Any]:
    """A dense SwiGLU ``feed_forward``: column-wise w1/w3, row-wise w2 back to ``Shard(1)``."""
    return {
        "feed_forward": styles.prepare_input(
            "feed_forward",
            ("w1", "w3"),
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": styles.colwise("feed_forward.w1"),
        "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=Shard(1)),
        "feed_forward.w3": styles.colwise("feed_forward.w3"),
    }


def moe_plan(styles: BlockStyles) -> dict[str, Any]:
    """A mixture-of-experts ``moe`` (``models/common/moe.py``), experts split like a SwiGLU:
    the layer's input is all-gathered (every rank routes all the tokens of the sequence, with
    the router's weight replicated: the same choices and counts everywhere), each rank holds
    every expert's slice of the hidden width (:class:`SplitExpertWidth`) and the shared expert's, and the routed and shared outputs, partial sums over those slices, are
    added and reduce-scattered back to ``Shard(1)`` once. Float8 does not apply to the experts
    (grouped matmuls).

    The layer computes on local tensors, so the gradients that are partial sums over the slices
    are summed over the TP ranks where they leave the sliced part: the experts' input (the
    routed rows, ``SumGradOverTP`` on ``moe.experts``) and, when the routing weights scale the
    experts' outputs (not their inputs), the routing weights (on ``moe.router``). Every gradient
    upstream of them (router, norms, earlier layers) is then the one-process gradient.

    With ``styles.experts_whole`` the experts are not split (expert parallel holds them whole):
    each TP rank runs its share of the routed rows instead (:class:`SplitRoutedRows`), its
    routed output zero elsewhere, so the sums above hold unchanged."""
    block = styles.block
    plan: dict[str, Any] = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
        ),
        "moe.router.gate": ReplicateParameters(),
        "moe.experts": _experts_style(block.moe.experts, styles.experts_whole),
    }
    if not block.moe.args.score_before_experts:
        plan["moe.router"] = SumGradOverTP(output=True)
    if block.moe.shared_experts is not None:
        plan |= {
            "moe.shared_experts.w1": styles.unquantized_colwise(
                "moe.shared_experts.w1", input_layouts=Replicate()
            ),
            "moe.shared_experts.w3": styles.unquantized_colwise(
                "moe.shared_experts.w3", input_layouts=Replicate()
            ),
            "moe.shared_experts.w2": styles.unquantized_rowwise(
                "moe.shared_experts.w2", output_layouts=Partial()
            ),
        }
    if getattr(block.moe, "shared_gate", None) is not None:
        # it scales the shared expert's partial sums: its output's gradient is one too
        plan["moe.shared_gate"] = InOrder(ReplicateParameters(), SumGradOverTP(output=True))
    return plan


def _experts_style(experts: nn.Module, whole: bool) -> ParallelStyle:
    if whole:
        return SplitRoutedRows()
    # expert parallel has sharded them already when it splits them with TP (a 2-D mesh)
    return SplitExpertWidth(shard=not isinstance(experts.w1, DTensor))


class SplitExpertWidth(ParallelStyle):
    """Apply to an MoE layer's stacked experts on the TP mesh: each rank holds every expert's
    slice of the hidden width (``EXPERT_WIDTH_DIMS``: ``w1``/``w3`` and their biases on their
    hidden dim, ``w2`` on dim 2; ``w2_bias``, which is per output channel, whole), so its output
    is a partial sum over the ranks. ``w2_bias`` enters that sum on the first rank only (the
    experts' ``adds_output_bias``), and the gradient of the experts' input, a partial sum too,
    is summed over the ranks. ``shard=False``: expert parallel has placed the parameters already
    (on its 2-D mesh, the same dims)."""

    def __init__(self, shard: bool = True) -> None:
        super().__init__()
        self.shard = shard

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.shard:
            module = ShardParameters(EXPERT_WIDTH_DIMS)._apply(module, device_mesh)
        module.adds_output_bias = device_mesh.get_local_rank() == 0
        return SumGradOverTP()._apply(module, device_mesh)


def row_share(rows: int, rank: int, size: int) -> tuple[int, int]:
    """``[lo, hi)``: rank ``rank`` of ``size``'s contiguous share of ``rows`` rows (the first
    ``rows % size`` ranks one row more)."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def split_counts(counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The rows per group within rows ``[lo, hi)`` of rows laid out group by group (``counts``
    rows each): each group's overlap with the range, computed on the device (no host sync)."""
    ends = counts.cumsum(0)
    return ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)


class SplitRoutedRows(ParallelStyle):
    """Apply to an MoE layer's whole experts (``forward(x, counts)``, rows sorted by expert) on
    the TP mesh: every TP rank routed the same rows, and each runs one contiguous ``1/tp`` share
    of them (the next share to the next rank), passing on the counts of its share, then pads its
    output with zeros back to every row, a partial sum over the TP ranks like the split experts'.
    The gradient of ``x`` (zero outside the share) is summed over the TP ranks.

    Its input hook runs before expert parallel's dispatch, which then sends only the share; its
    output hook after the combine."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: tuple[int, int, int] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()

        # eager, like the dispatch that follows: traced into a compiled block, whose graph then
        # ends here, the sum of the gradient was lost (measured: Llama 4's router and norm
        # gradients 100% off; tests/e2e/test_moe_parallel.py, compiled_blocks)
        @torch.compiler.disable
        def take_share(mod: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
            x, counts = inputs
            lo, hi = row_share(x.shape[0], rank, size)
            self._rows = (lo, hi, x.shape[0])
            x = sum_grad_over(x, device_mesh)
            return (x[lo:hi], split_counts(counts, lo, hi), *inputs[2:])

        def pad(mod: nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
            lo, hi, total = self._rows
            return torch.nn.functional.pad(out, (0, 0, lo, total - hi))

        module.register_forward_pre_hook(take_share, prepend=True)
        module.register_forward_hook(pad)
        return module


def sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient, a partial sum on each rank of ``mesh``, is
    all-reduced (summed) over ``mesh`` (Megatron's "copy to the tensor-parallel region")."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()]
    )


class SumGradOverTP(ParallelStyle):
    """Sums over the TP ranks the gradient of the module's first input, or (``output``) of its
    output (the first element of an output tuple); parameters and values are left alone."""

    def __init__(self, output: bool = False) -> None:
        super().__init__()
        self.output = output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # plain hooks: expert parallel may have distributed the module already (once only)
        if self.output:

            def summed(mod: nn.Module, inputs: Any, out: Any) -> Any:
                if isinstance(out, torch.Tensor):
                    return sum_grad_over(out, device_mesh)
                return (sum_grad_over(out[0], device_mesh), *out[1:])

            module.register_forward_hook(summed)
        else:
            module.register_forward_pre_hook(
                lambda mod, inputs: (sum_grad_over(inputs[0], device_mesh), *inputs[1:])
            )
        return module


class ShardParameters(ParallelStyle):
    """The module's own parameters as DTensors sharded on the given dims (``{name: dim}``, a
    dim of None: replicated; a name the module has as None is skipped); the module computes with
    their local parts itself (inputs and outputs are left alone)."""

    def __init__(self, dims: dict[str, int | None]) -> None:
        super().__init__()
        self.dims = dims

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, dim in self.dims.items():
            if getattr(module, pname) is not None:
                placement = Replicate() if dim is None else Shard(dim)
                param = distribute_tensor(getattr(module, pname), device_mesh, [placement])
                module.register_parameter(pname, nn.Parameter(param, param.requires_grad))
        return module


class HeadShardedNorm(SequenceParallel):
    """A norm applied to each head by itself, with one replicated scale, that takes several
    per-head inputs (a gated norm: the values and their gates): like the QK norms'
    ``SequenceParallel(sequence_dim=head_dim)``, every tensor input is this rank's heads of a
    ``Shard(head_dim)`` DTensor and the output goes back local. The scale's gradient covers this
    rank's heads; DTensor sums it over the TP ranks."""

    def __init__(self, head_dim: int = 2) -> None:
        super().__init__(sequence_dim=head_dim, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):  # type: ignore[override]
        return tuple(
            DTensor.from_local(x, device_mesh, sequence_sharding, run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )


class InOrder(ParallelStyle):
    """Several styles on one module, applied in the order given."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


class ReplicateParameters(ParallelStyle):
    """The module's parameters as replicated DTensors (so FSDP x TP sees every parameter on the
    TP mesh); the module computes with their local copies itself."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class ReplicatedCompute(ParallelStyle):
    """A module every TP rank runs whole on the same whole input (a low-rank down-projection
    and its norm in multi-head latent attention): parameters replicated DTensors, the local input
    taken as ``Replicate``, the output handed back local.

    Its output's gradient must then be whole on every rank, as it is when the reader is a
    column-wise linear (which sums its input's gradient over the ranks); channels from
    ``sum_grad_from`` on, read by each rank's own heads only, get their gradient summed here.
    The parameters' gradients are then whole and equal on every rank with no communication."""

    def __init__(self, sum_grad_from: int | None = None) -> None:
        super().__init__()
        self.sum_grad_from = sum_grad_from

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def as_replicated(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def as_local(mod: nn.Module, out: Any, mesh: DeviceMesh) -> torch.Tensor:
            local = out.to_local()
            if self.sum_grad_from is None:
                return local
            own, shared = local.split(
                [self.sum_grad_from, local.shape[-1] - self.sum_grad_from], dim=-1
            )
            return torch.cat([own, sum_grad_over(shared, mesh)], dim=-1)

        return distribute_module(module, device_mesh, input_fn=as_replicated, output_fn=as_local)
