"""Estimate peak memory per device for a training config, without allocating the model.

    python scripts/estimate_memory.py [--world-size N] [--device-type cuda|cpu] [--json] \\
        --job.config_file train_configs/llama3_8b.toml [any train.py --section.key value ...]

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
one micro-batch of each local stage is traced and its activations are multiplied by the number of
micro-batches a stage holds at once (1F1B-style schedules: up to pp; GPipe: all of them).

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

import argparse
import dataclasses
import functools
import json
import os
import sys
import warnings

from _common import run

GIB = 1024**3
ROWS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "inputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument(
        "--device-type",
        choices=("cuda", "cpu"),
        default="cuda",
        help="dtype rules of the target: cuda uses training.mixed_precision_param, cpu float32",
    )
    parser.add_argument(
        "--gpu-type",
        help="the verdict against this GPU's memory (torchtitan/devices.py: h100, h200, a100, ...); "
        "default: this machine's CUDA device, if any",
    )
    parser.add_argument("--device-memory-gib", type=float, help="the verdict against this memory")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a, train_args = parser.parse_known_args()
    estimate = estimate_memory(train_args, a.world_size, a.device_type)
    estimate.update(_verdict(estimate, a))
    if a.json:
        print(json.dumps(estimate))
    else:
        print(format_table(estimate))


def estimate_memory(train_args: list[str], world_size: int, device_type: str) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.config.parse import parse_args
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.errors import ConfigError
    from torchtitan.train.plan import plan_job

    job_config = parse_args(train_args, need_files=False)
    if world_size < 1:
        raise ConfigError(f"--world-size: {world_size} must be >= 1")
    notes = _adapt(job_config)
    dist_utils.device_type = (
        device_type  # the target's rules (dtype, device features) for preflight
    )
    plan = plan_job(job_config, world_size)
    notes += _moe_notes(plan)
    model_args = dataclasses.replace(
        plan.model_args,
        vocab_size=_vocab_size(plan, job_config),
        max_seq_len=job_config.training.seq_len,
    )
    pp_ranks = [0] if plan.dims.pp == 1 else [0, plan.dims.pp - 1]
    per_rank = []
    for pp_rank in pp_ranks:  # the first and last stages differ (embedding vs output and loss)
        rank = pp_rank * (world_size // plan.dims.pp)  # pp is the outermost mesh dim
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                per_rank.append(_trace_rank(job_config, plan, model_args, pp_rank, device_type))
        finally:
            dist.destroy_process_group()
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


def _verdict(estimate: dict, a: argparse.Namespace) -> dict:
    """Whether the traced peak fits the device's memory (torchtitan/train/memory_fit.py)."""
    from torchtitan.train.memory_fit import device_memory, verdict

    memory = device_memory(a.device_type, a.gpu_type, a.device_memory_gib)
    if memory is None:
        return {"fits": None, "verdict": None}
    fits, line = verdict(estimate["peak_gib"], memory, "the traced peak is")
    return {"fits": fits, "verdict": line}


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


def _moe_notes(plan) -> list[str]:
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


def _vocab_size(plan, job_config) -> int:
    """The tokenizer's size, as train.py uses; the flavor's published one if the file is absent."""
    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_source
    from torchtitan.errors import ConfigError

    path, key = tokenizer_source(job_config.model)  # tokenizer_path, else hf_assets_path's
    if path and os.path.exists(path):
        return build_tokenizer(path, key=key).n_words
    if plan.model_args.vocab_size > 0:
        return plan.model_args.vocab_size
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
    parts = builders.build_model(job_config, rt, model_args.vocab_size, materialize=False).stages
    with FakeTensorMode(allow_non_fake_inputs=True), _balanced_routing():
        for part in parts.values():
            part.to_empty(device="cpu")
            with torch.no_grad():
                part.init_weights()
        optimizer = build_optimizer(list(parts.values()), job_config.optimizer)
        loss_fn = build_loss_fn(dims, job_config, list(parts.values()))
        batch = plan.pipeline.microbatch_size if plan.pipeline else t.local_batch_size
        inflight = _microbatches_in_flight(plan, pp_rank)
        shape = (inflight, batch, t.seq_len // dims.cp)
        dtype = _param_dtype(job_config, device_type)
        stages = [
            _trace_stage(part, opt, stage, plan, model_args, shape, dtype, job_config, loss_fn)
            for (stage, part), opt in zip(parts.items(), optimizer.per_part)
        ]
    state, local_parameters = _formula_state(parts, job_config)
    # a rank's stages are traced one after the other: their peaks are added (an upper bound)
    traced = {k: sum(s[k] for s in stages) for k in ROWS}
    peak = sum(traced.values())
    return {
        "pp_rank": pp_rank,
        "peak_gib": peak / GIB,
        "breakdown_gib": {k: v / GIB for k, v in traced.items()},
        "formula_gib": {k: v / GIB for k, v in state.items()},
        "microbatches_in_flight": inflight,
        "local_parameters": local_parameters,
    }


def _balanced_routing():
    """Expert parallel's dispatch with balanced routing in place of the counts fake tensors do
    not have: of a rank's ``rows`` routed copies, expert ``e`` gets ``rows // E`` (one more for the
    first ``rows % E``), and every rank of the EP group sends the same."""
    import contextlib

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
    """Peak bytes of one stage over a training step, by kind: ``shape[0]`` micro-batches go
    forward before the first goes backward (a pipeline's warm-up; 1 without pipelining), then the
    optimizers (the part's AdamW, and its Muon if any) step; twice, as the first step creates the
    optimizer state. The peak is the second
    step's: it holds everything the first did plus the optimizer state, and on fake tensors the
    first optimizer step of DTensor parameters holds about a copy of them until it ends, which a
    real step does not (torch 2.13)."""

    from torchtitan.train.loss import loss_context

    inflight, batch, seq = shape
    first = plan.pipeline is None or stage == 0
    last = plan.pipeline is None or stage == plan.pipeline.num_stages - 1
    tracker = _tracker(part, optimizers)
    with tracker:
        for step in range(2):
            if step == 1:
                _restart_peak(tracker)
            losses = []
            with loss_context(plan.dims, job_config), _autocast(plan, dtype):
                for _ in range(inflight):
                    tracker.reset_mod_stats()  # per-module statistics allow one call; peak stays
                    losses.append(
                        _stage_forward(part, model_args, first, last, batch, seq, dtype, loss_fn)
                    )
            with loss_context(plan.dims, job_config):
                for loss in losses:
                    loss.backward()
            del losses
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        snapshot = tracker.get_tracker_snapshot("peak")
    by_kind = dict.fromkeys(ROWS, 0)
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            row = _ROW_OF.get(str(kind).split(".")[-1])
            if row is not None:
                by_kind[row] += nbytes
    return by_kind


def _stage_forward(part, model_args, first, last, batch, seq, dtype, loss_fn):
    """A scalar to call backward on: the loss as training computes it (whole or in pieces,
    ``training.loss_chunks``) on the last stage, else a sum of the output."""
    import torch

    from torchtitan.train.loss import MTPLoss, mtp_targets

    mtp = isinstance(loss_fn, MTPLoss)
    if first:
        x = torch.randint(0, model_args.vocab_size, (batch, seq))
    else:  # hidden states from the previous stage (and the embeddings with MTP), compute dtype
        rows = 2 * batch if mtp else batch
        x = torch.randn(rows, seq, model_args.dim, dtype=dtype, requires_grad=True)
    out = part(x)
    if last:
        labels = torch.randint(0, model_args.vocab_size, (batch, seq))
        if mtp:  # each prediction depth's targets too, as training passes them
            labels = mtp_targets(labels, None, loss_fn.depths)
        return loss_fn(out, labels, 1.0)
    return out.float().sum()


def _autocast(plan, dtype):
    """train.py casts with autocast when FSDP does not (GPU, no FSDP); the CPU autocast stands in."""
    import contextlib

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
    return tracker


def _restart_peak(tracker) -> None:
    """Count the peak from now on, starting from what is alive now."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for dev, dev_snap in tracker._curr_mem_snap.items():
        tracker._peak_mem[dev] = dev_snap[_TOTAL_KEY]
        tracker._peak_mem_snap[dev] = dict(dev_snap)


def _update_global_peak(tracker, peak_state) -> None:
    """The tracker's peak update without its per-module peaks, which this script does not read:
    they loop over every module after every op, which made a 48-layer MoE model's trace take
    minutes (``_update_peak_stats`` of ``torch.distributed._tools.mem_tracker``, torch 2.13)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for dev, dev_snap in tracker._curr_mem_snap.items():
        total = dev_snap[_TOTAL_KEY]
        if tracker._peak_mem.get(dev, 0) < total:
            tracker._peak_mem[dev] = total
            tracker._peak_mem_snap[dev] = dict(dev_snap)


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


def _microbatches_in_flight(plan, pp_rank: int) -> int:
    """How many micro-batches' activations a pipeline rank holds at its peak."""
    p = plan.pipeline
    if p is None:
        return 1
    if p.schedule == "GPipe":  # every forward before any backward
        return p.n_microbatches
    return min(p.n_microbatches, p.pp - pp_rank)  # 1F1B-style warm-up depth of this rank


def format_table(e: dict) -> str:
    lines = [
        f"Memory estimate per device: {e['model']} ({e['parameters_total']:,} parameters), "
        f"world size {e['world_size']}, {e['layout']}",
        f"  local batch {e['local_batch_size']} x seq {e['seq_len']}, compute dtype "
        f"{e['param_dtype']} ({e['device_type']} rules), activation checkpoint "
        f"{e['activation_checkpoint']}"
        + (f", pp rank {e['pp_rank']} (the larger)" if e["per_pp_rank"] else ""),
        "",
        f"  {'':14}{'traced at peak':>16}{'formula':>12}",
    ]
    for row in ROWS:
        formula = e["formula_gib"].get(row)
        f_text = f"{formula:10.3f}  " if formula is not None else " " * 12
        lines.append(f"  {row:14}{e['breakdown_gib'][row]:14.3f}  {f_text}")
    lines.append(f"  {'peak':14}{e['peak_gib']:14.3f}  GiB")
    if e["microbatches_in_flight"] > 1:
        lines.append(
            f"  (traced with {e['microbatches_in_flight']} micro-batches forward before the first "
            "backward, as the pipeline warm-up holds them)"
        )
    lines.append(
        "  formula: steady state after the first step (float32 parameters and gradients, "
        "optimizer state in optimizer.state_dtype: 2 moments, 1 for Muon's matrices); the "
        "traced column is what is alive at the peak"
    )
    lines += [f"  note: {n}" for n in e["notes"]]
    if e.get("verdict"):
        lines.append(f"  {e['verdict']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run(main))
