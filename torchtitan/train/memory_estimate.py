"""The traced memory estimate: peak memory per device of one training step, without allocating
the model. ``scripts/estimate_memory.py`` prints it; the layout planner (``python -m
torchtitan.plan``) calls it for each layout it shows.

How: one process stands in for rank 0 of an N-rank job (a fake process group, so the device
mesh, FSDP2, TP and CP are applied exactly as train.py applies them) and runs one training step
(forward, loss, backward, optimizer step) twice on fake tensors, which have shapes and dtypes but
no storage. PyTorch's memory tracker follows every tensor that would be alive and reports the
peak of the second step, split into parameters, gradients, optimizer state, activations (saved
for backward) and temporaries. The parameter, gradient and optimizer lines are also computed from
the model description (local parameter count x bytes) and printed beside the trace.

What it does not model (stated in the output too): the CUDA caching allocator's reserve and
fragmentation (compare the estimate to ``memory/peak_active_gib``, i.e. max_memory_allocated),
NCCL buffers and the CUDA context (~0.5-1 GiB), ``torch.compile`` (estimated without it; compiled
blocks usually save less), and float8 (estimated in the compute dtype). With pipeline parallel,
each local stage runs as many micro-batches forward as it holds at once before its first
gradient, one backward, then the forwards that bring it to the most it holds beside its
gradients, then the rest of the backwards (:func:`stage_residency`, from the order its schedule
runs the rank's actions: ``pipeline.rank_order``), as torch's schedules run them under FSDP:
the stage's gathered parameters kept and its unsharded gradients accumulated (float32 with a
bfloat16 compute) until the reduce-scatters after the last.

Multi-token prediction (``deepseek_v3``'s depths) is traced as training runs it: the depths'
blocks and logits on the last stage, the embeddings travelling with the hidden states between
pipeline stages. Multi-head latent attention needs nothing of its own: the trace sees its
latent projections and its narrower values as they are.

Mixture-of-experts models (``qwen3_moe``, ``llama4``, ``deepseek_v3``) are traced like the others. Under expert
parallelism the all-to-all dispatch needs host split sizes read from the router's counts, which
fake tensors do not have: the estimate assumes balanced routing, each of the E experts receiving
N x top_k / E of the N tokens a rank routes (``exchange_counts`` in
``torchtitan/distributed/expert_parallel.py`` is replaced for the trace). A step whose routing is
uneven holds more on the ranks of the busiest experts (their dispatched rows and the experts'
activations grow with their load). The formula lines count each rank's local shards, the routed
experts' included (sharded over ep x efsdp, and their hidden width over tp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings

GIB = 1024**3
# the repeats of the short traces: the first and the last layer differ from the others (FSDP
# does not reshard the last after its forward and prefetches from the first), and two repeats
# against three were measured off where three against four are exact (Llama 3 8B, FSDP 8)
SHORT = (3, 4)
ROWS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "inputs")
# what a trace that cannot follow a job raises (fake tensors, torch's private trackers): the
# callers that must go on (preflight, the planner) catch these
TRACE_FAILURES = (
    RuntimeError,
    NotImplementedError,
    TypeError,
    ValueError,
    AssertionError,
    AttributeError,
    KeyError,
    IndexError,
)


def estimate_memory(
    train_args: list[str], world_size: int, device_type: str, fast: bool = False
) -> dict:
    """The estimate for ``train.py``'s arguments on ``world_size`` devices of ``device_type``."""
    from torchtitan.config.parse import parse_args

    return estimate_job(parse_args(train_args, need_files=False), world_size, device_type, fast)


def estimate_job(
    job_config, world_size: int, device_type: str, fast: bool = False, vocab: int | None = None
) -> dict:
    """The estimate for a parsed config (changed: what the trace cannot follow is turned off).
    ``fast``: a model whose layers repeat is traced at two short depths and the peak
    extrapolated to its own (:func:`short_depths`), where possible. ``vocab``: the tokenizer's
    size when the caller has read it."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.errors import ConfigError

    if world_size < 1:
        raise ConfigError(f"--world-size: {world_size} must be >= 1")
    machine = dist_utils.device_type
    dist_utils.device_type = device_type  # the target's rules (dtype, device features)
    try:
        return _estimate(job_config, world_size, device_type, fast, vocab)
    finally:
        dist_utils.device_type = machine


def _estimate(job_config, world_size: int, device_type: str, fast: bool, vocab: int | None) -> dict:
    from torchtitan.train.plan import plan_job

    notes = _adapt(job_config)
    plan = plan_job(job_config, world_size)
    notes += moe_notes(plan)
    if vocab is None:  # the tokenizer's size, as train.py sizes the embedding
        vocab = vocab_size(plan.model_args, job_config)
    model_args = dataclasses.replace(
        plan.model_args, vocab_size=vocab, max_seq_len=job_config.training.seq_len
    )
    depths = short_depths(plan, model_args, _ac_interval(job_config)) if fast else None
    if depths is None:
        per_rank = _trace_ranks(job_config, plan, model_args, device_type)
    else:
        traced = []
        for n in depths:
            args = dataclasses.replace(model_args, n_layers=n)
            short = dataclasses.replace(plan, model_args=args)
            traced.append(_trace_ranks(job_config, short, args, device_type))
        per_rank = [_extrapolate(a, b, depths, model_args.n_layers) for a, b in zip(*traced)]
        notes.append(
            f"traced with {depths[0]} and {depths[1]} layers, the peak extrapolated linearly "
            f"to {model_args.n_layers}"
        )
    worst = max(per_rank, key=lambda r: r["peak_gib"])
    t, d = job_config.training, plan.dims
    return {
        "model": f"{job_config.model.name} {job_config.model.flavor}",
        "world_size": world_size,
        "layout": d.layout(),
        "device_type": device_type,
        "local_batch_size": t.local_batch_size,
        "seq_len": t.seq_len,
        "activation_checkpoint": _ac_name(job_config),
        "param_dtype": str(_param_dtype(job_config, device_type)).replace("torch.", ""),
        "parameters_total": sum(p.numel() for p in _meta_model(plan, model_args).parameters()),
        "pp_rank": worst["pp_rank"],
        **{k: v for k, v in worst.items() if k != "pp_rank"},
        "per_pp_rank": per_rank if len(per_rank) > 1 else None,
        "notes": notes,
    }


def _trace_ranks(job_config, plan, model_args, device_type: str) -> list[dict]:
    """The trace of rank 0, and of the last pipeline stage's first rank under PP (the first and
    last stages differ: embedding against output and loss)."""
    pp_ranks = [0] if plan.dims.pp == 1 else [0, plan.dims.pp - 1]
    return [_trace_one(job_config, plan, model_args, r, device_type) for r in pp_ranks]


def _trace_one(job_config, plan, model_args, pp_rank: int, device_type: str) -> dict:
    """One rank's trace in a fake process group of the job's world size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = plan.dims.world_size
    rank = pp_rank * (world_size // plan.dims.pp)  # pp is the outermost mesh dim
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _trace_rank(job_config, plan, model_args, pp_rank, device_type)
    finally:
        dist.destroy_process_group()
        _forget_shardings()


def _forget_shardings() -> None:
    """DTensor caches each op's output sharding by its inputs' specs, whose meshes compare equal
    to the next trace's (same shape and names, another fake process group): a cached spec would
    carry this trace's mesh, and its group names, into the next ("Could not resolve the process
    group registered under the name ..."). Its caches (C++ and Python) are cleared."""
    import torch
    from torch.distributed.tensor import DTensor

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    clear = getattr(propagator.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()


def short_depths(plan, model_args, ac_interval: int = 1) -> tuple[int, int] | None:
    """Two depths ``o + 3p`` and ``o + 4p`` whose traces extrapolate to the model's own, or None.

    Every tensor a step holds per layer (its parameters, gradients, optimizer state, saved
    activations) grows linearly with the depth; the rest (embedding, output, logits, one layer's
    temporaries) does not. So for a stack whose layers after the first ``o`` repeat with period
    ``p`` (``p`` = 1 for a plain stack; DeepSeek's dense first layers are the ``o``; gpt-oss's
    alternating attention and Qwen3-Next's linear/full mix give ``p`` > 1), the peak at depth
    ``o + kp`` is ``a + bk`` (from k = 3: ``SHORT``). The layers are compared by their modules,
    parameter shapes and the kinds their arguments give each layer (attention windows, RoPE or
    not), on the meta device; ``p`` is a multiple of ``ac_interval`` (selective checkpointing
    of every k-th layer, from layer 0). The short models must be the full one's first layers,
    else None (and under pipeline parallel, whose split follows the depth: the full trace is one
    stage's)."""
    import math

    from torchtitan.errors import TorchTitanError

    n = model_args.n_layers
    if plan.dims.pp > 1:
        return None
    full = _layer_signatures(plan, model_args)
    period = _period(full)
    if period is None:
        return None
    o, p = period
    p = math.lcm(p, ac_interval)
    depths = (o + SHORT[0] * p, o + SHORT[1] * p)
    if depths[1] >= n or (n - o) % p:
        return None
    for depth in depths:
        try:
            short = dataclasses.replace(model_args, n_layers=depth)
        except (TorchTitanError, ValueError, AssertionError):  # the family's own checks
            return None
        if _layer_signatures(plan, short) != full[:depth]:
            return None
    return depths


def _layer_signatures(plan, model_args) -> list[tuple]:
    """Each main layer's kind: its modules' classes, its parameters' names and shapes, and what
    the family's arguments say of it that no shape shows (``kinds()``, ``attention_windows()``,
    ``uses_rope(i)``: gpt-oss's sliding layers, Llama 4's layers without RoPE)."""
    layers = _meta_model(plan, model_args).layers
    blocks = list(layers.values() if hasattr(layers, "values") else layers)
    said = [
        list(getattr(model_args, name)())
        for name in ("kinds", "attention_windows")
        if callable(getattr(model_args, name, None))
    ]
    if callable(getattr(model_args, "uses_rope", None)):
        said.append([model_args.uses_rope(i) for i in range(len(blocks))])
    return [
        (
            tuple(type(m).__name__ for m in block.modules()),
            tuple((name, tuple(p.shape)) for name, p in block.named_parameters()),
            tuple(values[i] for values in said),
        )
        for i, block in enumerate(blocks)
    ]


def _period(signatures: list[tuple]) -> tuple[int, int] | None:
    """The cheapest ``(o, p)``: layers ``o`` on repeat every ``p`` layers (p at most 8)."""
    n, best = len(signatures), None
    for p in range(1, 9):
        for o in range(0, n):
            if o + 2 * p > n:
                break
            if all(signatures[i] == signatures[i + p] for i in range(o, n - p)):
                if best is None or o + 2 * p < best[0] + 2 * best[1]:
                    best = (o, p)
                break
    return best


def _extrapolate(a: dict, b: dict, depths: tuple[int, int], n: int) -> dict:
    """A rank's trace at depth ``n`` from its traces at the two short depths, field by field
    (the numbers linearly, the rest as traced)."""
    scale = (n - depths[0]) / (depths[1] - depths[0])

    def line(x, y):
        if isinstance(x, dict):  # a segment met at one depth only counts as traced there
            return {k: line(x.get(k, y.get(k)), y.get(k, x.get(k))) for k in {**x, **y}}
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return x
        value = x + scale * (y - x)
        return round(value) if isinstance(x, int) else value

    out = {k: line(a[k], b[k]) for k in a if k not in ("peak_gib", "breakdown_gib")}
    out["pp_rank"] = a["pp_rank"]
    out["microbatches_in_flight"] = a["microbatches_in_flight"]
    return _with_peak(out)


def _ac_interval(job_config) -> int:
    """k of selective checkpointing of every k-th layer; 1 otherwise."""
    ac = job_config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option.isdigit():
        return max(1, int(ac.selective_ac_option))
    return 1


def _adapt(job_config) -> list[str]:
    """Settings the fake trace cannot follow, turned off, each with a note of its effect."""
    notes = [
        "excludes the CUDA context, NCCL buffers and the caching allocator's reserve; "
        "compare with max_memory_allocated (memory/peak_active_gib in the training log)"
    ]
    if job_config.compile.enable:
        job_config.compile.enable = False
        notes.append("traced without torch.compile; compiled blocks usually save less")
    if job_config.model.converters:
        notes.append(
            f"model.converters {job_config.model.converters} not applied: traced in the compute dtype"
        )
        job_config.model.converters = []
    if job_config.optimizer.implementation == "fused":
        # fake tensors give the fused kernel out-of-place outputs; the for-loop step needs the
        # same memory as the fused one (in place, no full-size temporaries)
        job_config.optimizer.implementation = "for-loop"
    if job_config.parallelism.enable_async_tensor_parallel:
        job_config.parallelism.enable_async_tensor_parallel = False
    if job_config.checkpoint.create_seed_checkpoint:
        job_config.checkpoint.create_seed_checkpoint = False
    return notes


def moe_notes(plan) -> list[str]:
    """What the estimate of an MoE model assumes, and a sharding that leaves rank 0 more."""
    moe, d = getattr(plan.model_args, "moe", None), plan.dims
    if moe is None:
        return []
    notes = []
    if d.ep > 1:
        notes.append(
            "expert parallel: routing assumed balanced (each of the E experts receives "
            "N x top_k / E of the N tokens a rank routes); uneven routing holds more on the ranks "
            "of the busiest experts"
        )
    # ep x efsdp: the experts' dim 0 is split over them (the TP ranks too with whole experts)
    whole, ranks = d.experts_whole_under_tp, d.expert_borrowed_ranks
    if moe.num_experts % ranks:
        held = -(-moe.num_experts // ranks)
        notes.append(
            f"FSDP shards the routed experts on dim 0: {moe.num_experts} experts over "
            f"dp_shard x cp{' x tp' if whole else ''} = {ranks} ranks"
            f"{' (ep x efsdp)' if d.ep > 1 else ''} leave rank 0, "
            f"the one traced, {held} per layer, {held * ranks / moe.num_experts:.1f}x an even "
            f"share, and some ranks none; choose dp_shard x cp{' x tp' if whole else ''} dividing "
            f"the experts (add {'' if whole else 'tensor or '}pipeline parallel, or "
            "data_parallel_replicate_degree)"
        )
    return notes


def vocab_size(model_args, job_config) -> int:
    """The tokenizer's size, as train.py uses; the flavor's published one if the file is absent."""
    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_source
    from torchtitan.errors import ConfigError

    path, key = tokenizer_source(job_config.model)  # tokenizer_path, else hf_assets_path's
    if path and os.path.exists(path):
        return build_tokenizer(path, key=key).n_words
    if model_args.vocab_size > 0:
        return model_args.vocab_size
    raise ConfigError(
        f"{key}: {path!r} does not exist and flavor "
        f"'{job_config.model.flavor}' has no published vocabulary size; give the tokenizer file"
    )


def _meta_model(plan, model_args):
    import torch

    with torch.device("meta"):
        return plan.spec.cls(model_args)


def _param_dtype(job_config, device_type):
    from torchtitan.distributed.data_parallel import param_dtype

    return param_dtype(job_config.training, device_type)


def _ac_name(job_config) -> str:
    ac = job_config.activation_checkpoint
    return ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}"


def _trace_rank(job_config, plan, model_args, pp_rank: int, device_type: str) -> dict:
    """Build this rank's parallelized stages on fake tensors and trace two training steps."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.optim.optimizers import build_optimizer
    from torchtitan.train import builders
    from torchtitan.train.loss import build_loss_fn

    dims, t = plan.dims, job_config.training
    dims.build_mesh("cpu")
    # as train.py builds it (meta device, stages, the family's parallelisms), left on the meta
    # device, then materialized as fake tensors (shapes, no storage)
    rank = pp_rank * (dims.world_size // dims.pp)
    rt = builders.Runtime(torch.device("cpu"), rank, dims.world_size, plan, seed=0)
    with _without_ddp():
        built = builders.build_model(job_config, rt, model_args.vocab_size, materialize=False)
    parts = built.stages
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, _balanced_routing(), _propagation_untracked():
        for part in parts.values():
            part.to_empty(device="cpu")
            with torch.no_grad():
                part.init_weights()
        optimizer = build_optimizer(list(parts.values()), job_config.optimizer)
        loss_fn = build_loss_fn(dims, job_config, list(parts.values()))
        batch = plan.pipeline.microbatch_size if plan.pipeline else t.local_batch_size
        residency = stage_residency(plan, pp_rank, list(parts))
        dtype = _param_dtype(job_config, device_type)
        stages = [
            _trace_stage(
                part, opt, stage, plan, model_args, (held, (batch, t.seq_len // dims.cp)), dtype,
                job_config, loss_fn,
            )
            for (stage, part), opt, held in zip(parts.items(), optimizer.per_part, residency)
        ]  # fmt: skip
    state, local_parameters = _formula_state(parts, job_config)
    if len(stages) == 1:
        segments = stages[0]
    else:  # a rank's stages are traced one after the other: their peaks are added (an upper
        # bound)
        tops = [max(s.values(), key=lambda rows: sum(rows.values())) for s in stages]
        segments = {"stages": {k: sum(top[k] for top in tops) for k in ROWS}}
    if dims.dp_replicate_enabled and not dims.uses_fully_shard:
        for rows in segments.values():  # DDP's buckets: a float32 copy of the gradients
            rows["gradients"] += state["gradients"]
    segments = {key: {k: v / GIB for k, v in rows.items()} for key, rows in segments.items()}
    return _with_peak(
        {
            "pp_rank": pp_rank,
            "segments_gib": segments,
            "formula_gib": {k: v / GIB for k, v in state.items()},
            "microbatches_in_flight": max(max(r) for r in residency),
            "local_parameters": local_parameters,
        }
    )


def _with_peak(rank: dict) -> dict:
    """``peak_gib`` and its ``breakdown_gib``: those of the phase that holds the most."""
    top = max(rank["segments_gib"].values(), key=lambda rows: sum(rows.values()))
    return {**rank, "peak_gib": sum(top.values()), "breakdown_gib": dict(top)}


def _without_ddp():
    """DDP (``replicate``) checks its parameters across the ranks when it wraps the model,
    which meta and fake tensors cannot answer: the trace builds the model without it, and
    :func:`_trace_rank` adds what DDP keeps, its gradient buckets (``gradient_as_bucket_view``
    off: a copy of every gradient, from the first backward on)."""

    from torchtitan.distributed import parallelize

    @contextlib.contextmanager
    def patched():
        real = parallelize.apply_ddp
        parallelize.apply_ddp = lambda model, mesh: None
        try:
            yield
        finally:
            parallelize.apply_ddp = real

    return patched()


# > 0 while DTensor's sharding propagation runs an op on global-shaped fake tensors
_PROPAGATING = [0]


def _propagation_untracked():
    """DTensor infers some outputs' global shapes by running the op on fake tensors of the
    global shape, in the fake mode that is active: in a real run its own, which the tracker
    skips, but in the trace the trace's own, so the tracker took them for the step's tensors
    (the vocabulary-parallel loss's whole logits, twice). They are not tracked."""

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    real = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return real(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    @contextlib.contextmanager
    def patched():
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = real

    return patched()


def _balanced_routing():
    """Expert parallel's dispatch with balanced routing in place of the counts fake tensors do
    not have: of a rank's ``rows`` routed copies, expert ``e`` gets ``rows // E`` (one more for the
    first ``rows % E``), and every rank of the EP group sends the same."""

    import torch.distributed as dist

    from torchtitan.distributed import expert_parallel

    def balanced(counts, rows: int, ep: int, group):
        n = counts.shape[0]
        per_expert = [rows // n + (e < rows % n) for e in range(n)]
        local = n // ep
        me = dist.get_rank(group)
        mine = per_expert[me * local : (me + 1) * local]
        received = counts.new_tensor([mine] * ep)  # [source rank, local expert]
        sent = [sum(per_expert[r * local : (r + 1) * local]) for r in range(ep)]
        return received, sent, [sum(mine)] * ep

    @contextlib.contextmanager
    def patched():
        real = expert_parallel.exchange_counts
        expert_parallel.exchange_counts = balanced
        try:
            yield
        finally:
            expert_parallel.exchange_counts = real

    return patched()


def _trace_stage(
    part, optimizers, stage, plan, model_args, shape, dtype, job_config, loss_fn
) -> dict:
    """Peak bytes of one stage over a training step, by kind, for each segment of the step
    (:func:`_segment`): the micro-batches go forward and backward in the order that meets the
    stage's peaks before and after its first gradient (:func:`trace_order` of ``shape[0]``; one
    forward and its backward without pipelining), then the
    optimizers (the part's AdamW, and its Muon if any) step; twice, as the first step creates the
    optimizer state. The peaks are the second
    step's: it holds everything the first did plus the optimizer state, and on fake tensors the
    first optimizer step of DTensor parameters holds about a copy of them until it ends, which a
    real step does not (torch 2.13). Each segment's peak is linear in the depth; the step's, their
    maximum, is not where the segment holding the most changes with it (the output's backward
    in a short model, the end of the forward in a deep one)."""

    from torchtitan.train.loss import loss_context

    residency, (batch, seq) = shape
    first = plan.pipeline is None or stage == 0
    last = plan.pipeline is None or stage == plan.pipeline.num_stages - 1
    ends, shape = (first, last), (batch, seq, plan.dims.tp)
    tracker = _tracker(part, optimizers)
    with tracker:
        for step in range(2):
            if step == 1:
                _restart_peak(tracker)
            losses = []
            with loss_context(plan.dims, job_config), _pipelined_fsdp(part, plan, tracker):
                for kind in trace_order(*residency):
                    if kind == "B":
                        losses.pop(0).backward()
                        continue
                    tracker.reset_mod_stats()  # per-module statistics allow one call; peak stays
                    with _autocast(plan, dtype):
                        losses.append(_stage_forward(part, model_args, ends, shape, dtype, loss_fn))
            del losses
            tracker._phase = "optimizer_step"
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            tracker._phase = "forward_backward"
    return {key: _by_kind(snapshot) for key, snapshot in tracker._segments.items()}


@contextlib.contextmanager
def _pipelined_fsdp(part, plan, tracker):
    """A pipeline stage's backwards as torch.distributed.pipelining runs them under FSDP
    (``backward_maybe_with_nosync`` and ``perform_reduce_grad`` of its stage, torch 2.13): no
    gradient reduction and no resharding until the last micro-batch's backward, so that the
    stage's gathered parameters stay and its unsharded gradients accumulate (in the reduce dtype,
    float32, when it differs from the compute dtype: FSDP's ``unsharded_accumulated_grad``); then
    the reduce-scatters run at once. The tracker, which saw the accumulated gradients made as
    temporaries, counts them as gradients from each group's post-backward on."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if plan.pipeline is None or not isinstance(part, FSDPModule):
        yield
        return
    state = fully_shard.state(part)
    groups = [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]

    def counted_as_gradients(group, post_backward):
        def run(*args, **kwargs):
            out = post_backward(*args, **kwargs)
            for param in group.fsdp_params:
                if param.unsharded_accumulated_grad is not None:
                    grad = param.unsharded_accumulated_grad
                    tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)
            return out

        return run

    tracked = {id(g): g.post_backward for g in groups}
    for group in groups:
        group.post_backward = counted_as_gradients(group, tracked[id(group)])
    _fsdp_syncs(part, False)
    try:
        yield
        _fsdp_syncs(part, True)
        for group in groups:
            group.post_backward()
        state._root_post_backward_final_callback()
    finally:  # as the module was, also when the trace fails
        _fsdp_syncs(part, True)
        for group in groups:
            group.post_backward = tracked[id(group)]


def _fsdp_syncs(part, on: bool) -> None:
    """FSDP's gradient reduction and resharding after backward, on or off (for the last
    micro-batch's backward, or for those before it)."""
    part.set_is_last_backward(on)
    part.set_reshard_after_backward(on)
    part.set_requires_gradient_sync(on)


def _by_kind(snapshot: dict) -> dict:
    by_kind = dict.fromkeys(ROWS, 0)
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            row = _ROW_OF.get(str(kind).split(".")[-1])
            if row is not None:
                by_kind[row] += nbytes
    return by_kind


def _stage_forward(part, model_args, ends, shape, dtype, loss_fn):
    """A scalar to call backward on: the loss as training computes it (whole or in pieces,
    ``training.loss_chunks``) on the last stage, else a sum of the output. ``ends``: whether
    the stage is the first, the last; ``shape``: batch, sequence, tensor-parallel degree (a
    stage after the first receives its predecessor's hidden states, which sequence parallel
    leaves split over the TP ranks)."""
    import torch

    from torchtitan.train.loss import MTPLoss, mtp_targets

    mtp = isinstance(loss_fn, MTPLoss)
    (first, last), (batch, seq, tp) = ends, shape
    if first:
        x = torch.randint(0, model_args.vocab_size, (batch, seq))
    else:  # hidden states from the previous stage (and the embeddings with MTP), compute dtype
        rows = 2 * batch if mtp else batch
        x = torch.randn(rows, seq // tp, model_args.dim, dtype=dtype, requires_grad=True)
    out = part(x)
    if last:
        labels = torch.randint(0, model_args.vocab_size, (batch, seq))
        if mtp:  # each prediction depth's targets too, as training passes them
            labels = mtp_targets(labels, None, loss_fn.depths)
        return loss_fn(out, labels, 1.0)
    return out.float().sum()


def _autocast(plan, dtype):
    """train.py casts with autocast when FSDP does not (GPU, no FSDP); the CPU autocast stands in."""

    import torch

    if dtype != torch.float32 and not plan.dims.uses_fully_shard:
        return torch.autocast("cpu", dtype=dtype)
    return contextlib.nullcontext()


_ROW_OF = {
    "PARAM": "parameters",
    "SHARDED_PARAM": "parameters",
    "UNSHARDED_PARAM": "parameters",
    "BUFFER": "parameters",
    "GRAD": "gradients",
    "SHARDED_GRAD": "gradients",
    "UNSHARDED_GRAD": "gradients",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "temporaries",
    "ALL_GATHER": "temporaries",
    "REDUCE_SCATTER": "temporaries",
    "INP": "inputs",
}


def _tracker(part, optimizers):
    """PyTorch's memory tracker; its FSDP-aware kind tells gathered parameters from activations."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(part, FSDPModule):
        tracker = FSDPMemTracker(mod=part, optm=optimizers[0])
        tracker.track_inputs(())
        for extra in optimizers[1:]:  # it takes one optimizer (and no track_external): the
            # state a Muon beside the AdamW creates is tracked as the AdamW's is, after its step
            extra.register_step_post_hook(
                lambda opt, *_: tracker._track_optimizer_states(_FSDPRefType.OPT, opt)
            )
    else:
        tracker = MemTracker()
        tracker.track_external(part, *optimizers)
    tracker._update_peak_stats = functools.partial(_update_global_peak, tracker)
    track = tracker._track
    tracker._track = lambda reftype, t: None if _PROPAGATING[0] else track(reftype, t)
    tracker._segments, tracker._segment_totals, tracker._phase = {}, {}, "forward_backward"
    tracker._after = {"forward": "", "backward": ""}
    return tracker


def _restart_peak(tracker) -> None:
    """Count the peak from now on, starting from what is alive now."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for dev, dev_snap in tracker._curr_mem_snap.items():
        tracker._peak_mem[dev] = dev_snap[_TOTAL_KEY]
        tracker._peak_mem_snap[dev] = dict(dev_snap)
    tracker._segments, tracker._segment_totals = {}, {}
    tracker._after = {"forward": "", "backward": ""}


def _update_global_peak(tracker, peak_state) -> None:
    """The tracker's peak update without its per-module peaks, which this script does not read:
    they loop over every module after every op, which made a 48-layer MoE model's trace take
    minutes (``_update_peak_stats`` of ``torch.distributed._tools.mem_tracker``, torch 2.13)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    every = 0
    for dev, dev_snap in tracker._curr_mem_snap.items():
        total = dev_snap[_TOTAL_KEY]
        every += total
        if tracker._peak_mem.get(dev, 0) < total:
            tracker._peak_mem[dev] = total
            tracker._peak_mem_snap[dev] = dict(dev_snap)
    key = _segment(tracker)
    if key not in tracker._segment_totals or tracker._segment_totals[key] < every:
        tracker._segment_totals[key] = every
        tracker._segments[key] = {d: dict(v) for d, v in tracker._curr_mem_snap.items()}


def _segment(tracker) -> str:
    """Where the step is: its phase, the direction and the model's top-level part running
    (``layers``, ``output``, ``tok_embeddings``...), or, between parts (the loss, FSDP's hooks),
    the last part that ran. These are the same at every depth, and inside each the peak grows
    linearly with it (the forward's at the last layer, the backward's at the first it meets)."""
    parents = tracker._mod_tracker.parents
    parts = "+".join(sorted({n.split(".")[1] for n in parents if n.count(".") >= 1}))
    direction = "backward" if tracker._mod_tracker.is_bw else "forward"
    if parts:
        tracker._after[direction] = parts
    else:
        parts = f"after {tracker._after[direction] or 'none'}"
    return f"{tracker._phase}/{direction}/{parts}"


def _formula_state(parts, job_config) -> tuple[dict, int]:
    """Model state from the local parameter count: parameters in float32 (FSDP keeps float32
    shards and casts for compute), gradients of the same size, and the optimizer's state
    (``optimizer.state_dtype``): Adam and AdamW two moments per parameter; Muon one momentum
    buffer per hidden-matrix parameter, and AdamW's two moments for the rest."""
    from torchtitan.optim.param_groups import categories, clean_name, for_muon

    n = moments = 0
    muon = job_config.optimizer.name == "Muon"
    for part in parts.values():
        kinds = categories(part) if muon else {}
        for name, p in part.named_parameters():
            local = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            n += local
            moments += local * (1 if muon and for_muon(kinds.get(clean_name(name)), p) else 2)
    state_bytes = 2 if job_config.optimizer.state_dtype == "bfloat16" else 4
    return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": state_bytes * moments}, n


def stage_residency(plan, pp_rank: int, local_stages: list[int]) -> list[tuple[int, int]]:
    """For each of a pipeline rank's stages, the most micro-batches whose activations it holds
    before its first gradient exists, and the most it holds while its gradients exist (0 if
    never), in the order the rank runs its actions (``pipeline.rank_order``, ``residency``).
    1F1B with more micro-batches than its warm-up: a stage holds as many after its first
    backward as before, with its gradients."""
    from torchtitan.distributed.pipeline import rank_order, residency

    if plan.pipeline is None:
        return [(1, 0)] * len(local_stages)
    most = residency(rank_order(plan.pipeline, pp_rank))
    return [most.get(stage, (0, 0)) for stage in local_stages]


def trace_order(before: int, after: int) -> str:
    """The forwards (F) and backwards (B) a stage's trace runs to meet both of its peaks
    (:func:`stage_residency`): ``before`` forwards, one backward (its gradients now exist), the
    forwards that bring it back to ``after`` micro-batches held, then the rest of the
    backwards."""
    more = max(0, after - (before - 1))
    return "F" * before + "B" + "F" * more + "B" * (before - 1 + more)
