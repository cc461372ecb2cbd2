"""Old upstream torchtitan key names, and the hints for keys nobody ever declared.

Upstream torchtitan renamed and moved many keys during its TOML era (2024-2025): ``[training]``
held the parallel degrees until ``[parallelism]`` took them, an ``[experimental]`` section held
pipeline and context parallel, float8 moved from ``training.fp8_linear`` to ``[float8]`` and then
to ``[quantize.linear.float8]``. Every such key still loads here: :data:`ALIASES` maps it to the
current key (with a value conversion where the meaning was turned around), and parsing leaves one
warning line naming the current key. ``scripts/migrate_config.py`` rewrites a file with the same
table. This module imports nothing from the package but its errors: the config parser and the migration script
both read it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.errors import ConfigError


@dataclass(frozen=True)
class Alias:
    """An old key: where its value goes now, and how it is converted on the way."""

    new: str | None  # the current key; None: accepted and ignored (test-only metadata)
    old_type: Any = None  # the old key's type where it differs from the current key's
    # (old value, the current key's value so far) -> the current key's value
    convert: Callable[[Any, Any], Any] | None = None
    # (old value, the whole JobConfig) -> the current key's value, once every layer is applied
    compute: Callable[[Any, Any], Any] | None = None
    # (old value) -> further current keys it sets, {key: value}
    also: Callable[[Any], dict[str, Any]] | None = None
    only: tuple[Any, ...] | None = None  # the only values accepted (for features not built here)
    why: str = ""  # why other values are refused, and what to do instead
    note: str = ""  # said in the warning: what changed besides the name

    def warning(self, where: str, origin: str) -> str:
        if self.new is None:
            return f"{where}: no effect here ({self.note})"
        extra = f" ({self.note})" if self.note else ""
        fix = (
            f"write --{self.new} instead"
            if origin == "command line"
            else f"python scripts/migrate_config.py {origin} rewrites the file"
        )
        return f"{where}: old name of {self.new}{extra}; it still works ({fix})"


def _negate(value: bool, _current: Any) -> bool:
    return not value


def _add_float8(enabled: Any, converters: list[str]) -> list[str]:
    """``true`` / ``"dynamic"`` (2024's fp8_linear) add float8; ``false`` / ``""`` leave it out."""
    if enabled and "float8" not in converters:
        return [*converters, "float8"]
    if not enabled:
        return [c for c in converters if c != "float8"]
    return converters


def _fused_to_implementation(fused: bool, _current: Any) -> str:
    return "fused" if fused else "foreach"


def _selective_ac(enabled: bool, current: str) -> str:
    return "selective" if enabled else current


def _warmup_from_pct(pct: float, cfg: Any) -> int:
    return int(round(pct * cfg.training.steps))


def _microbatch_size(n_microbatches: int, cfg: Any) -> int:
    local = cfg.training.local_batch_size
    if n_microbatches < 1 or local % n_microbatches:
        raise ConfigError(
            f"{n_microbatches} micro-batches must divide training.local_batch_size ({local}); "
            f"use a divisor of {local}, or set parallelism.pipeline_parallel_microbatch_size"
        )
    return local // n_microbatches


def _float8_experts(fqns: list, cfg: Any) -> None:
    """Upstream's float8 grouped matmuls for the experts: not built here. No effect without the
    float8 converter; with it, a non-empty list is refused (the experts would silently stay in
    the training dtype)."""
    if fqns and "float8" in cfg.model.converters:
        raise ConfigError(
            f"{fqns!r}: float8 grouped matmuls for the routed experts are not built here (float8 "
            "converts nn.Linear layers; the experts run in the training dtype); leave it empty"
        )


def _split_points_from_fqns(parts: Any, _current: Any) -> list[str]:
    """``module_fqns_per_model_part`` (the modules of each stage) as stage boundaries: the
    first ``layers.N`` of every stage after the first."""
    bad = ConfigError(
        "parallelism.pipeline_parallel_split_points: module_fqns_per_model_part must list, per "
        "stage, consecutive 'layers.N' modules (tok_embeddings in the first, norm and output in "
        f"the last); got {parts!r}"
    )
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
        raise bad
    firsts = []
    for stage in parts:
        layers = [int(m.split(".")[1]) for m in stage if str(m).startswith("layers.")]
        if not layers or layers != list(range(layers[0], layers[0] + len(layers))):
            raise bad
        firsts.append(layers[0])
    if firsts != sorted(firsts) or "tok_embeddings" not in parts[0] or "output" not in parts[-1]:
        raise bad
    return [f"layers.{n}" for n in firsts[1:]]


def _rename(new: str, note: str = "") -> Alias:
    return Alias(new, note=note)


def _ignored(old_type: Any, why: str) -> Alias:
    """A setting of a feature not built here that changes nothing while that feature is off."""
    return Alias(None, old_type=old_type, note=why)


def _refuse(old_type: Any, only: tuple[Any, ...], why: str) -> Alias:
    """A key for a feature not built here: accepted at its off value, else refused with why."""
    return Alias(
        None,
        old_type=old_type,
        only=only,
        why=why,
        note="the off value of a feature not built here",
    )


_EXPERIMENTAL = {  # [experimental] and [training] keys that moved to [parallelism]
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "enable_async_tensor_parallel",
    "fsdp_reshard_after_forward",
    "disable_loss_parallel",
    "pipeline_parallel_schedule",
    "pipeline_parallel_split_points",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_microbatch_size",
}
_FLOAT8 = (
    "enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp",
    "recipe_name",
    "filter_fqns",
)
_MICROBATCHES = Alias(
    "parallelism.pipeline_parallel_microbatch_size",
    old_type=int,
    compute=_microbatch_size,
    note="a micro-batch count, turned into training.local_batch_size / count",
)
_NO_COMPILED_AUTOGRAD = _refuse(
    bool,
    (False,),
    "compiled autograd is not supported here; use false (compile.enable compiles "
    "the forward, and its backward with it)",
)
_ADD_FLOAT8 = Alias("model.converters", old_type=bool, convert=_add_float8, note="true adds float8")
_FP8_LINEAR = Alias(
    "model.converters",
    old_type=str,
    convert=_add_float8,
    only=("", "dynamic"),
    why="2024's fp8_linear takes '' (off) or 'dynamic' (float8 with dynamic scaling)",
    note="'dynamic' adds float8",
)
_ROTATE = Alias(
    None,
    old_type=str,
    only=("allgather",),
    why="context parallel here all-gathers K/V; use 'allgather'",
    note="the all-gather method is the one built here",
)
_MOE = "is not supported here (the router always chooses by its scores)"

_FLOAT8_EXPERTS = Alias(
    None,
    old_type=list,
    compute=_float8_experts,
    note="float8 grouped matmuls for the experts are not built here; the experts run in the "
    "training dtype",
)

ALIASES: dict[str, Alias] = {
    # [global]: the earliest (2024) home of dump_folder
    "global.dump_folder": _rename("job.dump_folder"),
    # [job]
    "job.print_args": _rename("job.print_config"),
    "job.use_for_integration_test": Alias(None, old_type=bool, note="upstream's CI marker"),
    # [metrics]
    "metrics.enable_color_printing": Alias(
        "metrics.disable_color_printing", old_type=bool, convert=_negate, note="value negated"
    ),
    "metrics.rank_0_only": Alias(
        "metrics.save_for_all_ranks", old_type=bool, convert=_negate, note="value negated"
    ),
    "metrics.use_for_integration_test": Alias(None, old_type=bool, note="upstream's CI marker"),
    # [training]: the 2024 home of many keys
    "training.batch_size": _rename("training.local_batch_size"),
    "training.compile": _rename("compile.enable"),
    "training.warmup_steps": _rename("lr_scheduler.warmup_steps"),
    "training.warmup_pct": Alias(
        "lr_scheduler.warmup_steps",
        old_type=float,
        compute=_warmup_from_pct,
        note="a fraction of training.steps, turned into steps",
    ),
    "training.seed": _rename("debug.seed"),
    "training.deterministic": _rename("debug.deterministic"),
    "training.data_parallel_degree": _rename("parallelism.data_parallel_shard_degree"),
    "training.sequence_parallel_degree": _rename(
        "parallelism.tensor_parallel_degree", note="sequence parallel comes with tensor parallel"
    ),
    "training.enable_loss_parallel": Alias(
        "parallelism.disable_loss_parallel", old_type=bool, convert=_negate, note="value negated"
    ),
    "training.fp8_linear": _FP8_LINEAR,
    "training.fp8_linear_type": _FP8_LINEAR,
    "training.enable_float8_linear": _ADD_FLOAT8,
    "training.enable_fsdp_fp8_all_gather": _rename("float8.enable_fsdp_float8_all_gather"),
    "training.enable_fsdp_float8_all_gather": _rename("float8.enable_fsdp_float8_all_gather"),
    "training.precompute_float8_dynamic_scale_for_fsdp": _rename(
        "float8.precompute_float8_dynamic_scale_for_fsdp"
    ),
    "training.enable_selective_ac": Alias(
        "activation_checkpoint.mode",
        old_type=bool,
        convert=_selective_ac,
        note="true sets mode = 'selective'",
    ),
    "training.checkpoint_folder": Alias(
        "checkpoint.folder",
        also=lambda folder: {"checkpoint.enable": bool(folder)},
        note="a non-empty folder also sets checkpoint.enable",
    ),
    "training.checkpoint_interval": _rename("checkpoint.interval"),
    "training.checkpoint_interval_type": _rename("checkpoint.interval_type"),
    "training.enable_cpu_offload": _refuse(
        bool, (False,), "FSDP CPU offload is not supported here; use false"
    ),
    "training.gc_debug": _refuse(bool, (False,), "GC debugging is not supported here; use false"),
    "training.dtype": _refuse(
        str,
        ("float32",),
        "full bfloat16 training is not supported here; use float32 (training."
        "mixed_precision_param gives bfloat16 compute)",
    ),
    "training.compiled_autograd": _NO_COMPILED_AUTOGRAD,
    "training.debug_moe_force_load_balance": _refuse(bool, (False,), f"it {_MOE}; use false"),
    **{f"training.{k}": _rename(f"parallelism.{k}") for k in sorted(_EXPERIMENTAL)},
    # [experimental]: pipeline, context parallel and async TP before [parallelism] existed
    **{f"experimental.{k}": _rename(f"parallelism.{k}") for k in sorted(_EXPERIMENTAL)},
    "experimental.pipeline_parallel_microbatches": _MICROBATCHES,
    "experimental.pipeline_parallel_split_mode": Alias(
        None,
        old_type=str,
        only=("manual", "tracer"),
        why="use 'manual' or 'tracer'",
        note="both give the same stages here",
    ),
    "experimental.pipeline_parallel_schedule_csv": _rename(
        "parallelism.pipeline_parallel_schedule_csv"
    ),
    "experimental.context_parallel_rotate_method": _ROTATE,
    "experimental.enable_compiled_autograd": _NO_COMPILED_AUTOGRAD,
    "experimental.custom_model_path": _rename("job.custom_import"),
    "experimental.custom_import": _rename("job.custom_import"),
    "experimental.custom_args_module": _rename("job.custom_config_module"),
    # [parallelism]: 2025 keys for features built differently (or not) here
    "parallelism.pipeline_parallel_microbatches": _MICROBATCHES,
    "parallelism.module_fqns_per_model_part": Alias(
        "parallelism.pipeline_parallel_split_points",
        old_type=list,
        convert=_split_points_from_fqns,
        note="each stage's first layer becomes a split point",
    ),
    "parallelism.context_parallel_rotate_method": _ROTATE,
    "parallelism.context_parallel_load_balancer": Alias(
        None,
        old_type=str,
        only=("headtail",),
        why="context parallel here balances the causal load head-and-tail; use 'headtail'",
        note="head-and-tail balancing is the one built here",
    ),
    "parallelism.enable_compiled_autograd": _NO_COMPILED_AUTOGRAD,
    "parallelism.expert_parallel_comm_backend": _refuse(
        str, ("standard",), "DeepEP kernels are not built here; all-to-all is 'standard'"
    ),
    # [optimizer]
    "optimizer.fused": Alias(
        "optimizer.implementation", old_type=bool, convert=_fused_to_implementation
    ),
    # [lr_scheduler]
    "lr_scheduler.lr_min": _rename("lr_scheduler.min_lr_factor", note="both a fraction of lr"),
    # [checkpoint]
    "checkpoint.enable_checkpoint": _rename("checkpoint.enable"),
    "checkpoint.model_weights_only": _rename(
        "checkpoint.last_save_model_only", note="upstream's meaning: the last save only"
    ),
    "checkpoint.last_save_model_weights_only": _rename("checkpoint.last_save_model_only"),
    "checkpoint.initial_load_model_weights_only": _rename("checkpoint.initial_load_model_only"),
    # [model]: FlexAttention was a switch of its own in 2025
    "model.use_flex_attn": _ignored(
        bool,
        "the attention kernel follows model.attn_mask_type here: block_causal runs FlexAttention "
        "on CUDA, causal runs SDPA (the same math as a causal FlexAttention)",
    ),
    # [profiling]
    "profiling.run_profiler": _rename("profiling.enable_profiling"),
    "profiling.profile_every_x_iter": _rename("profiling.profile_freq"),
    # [validation]
    "validation.enabled": _rename("validation.enable"),
    # float8: [training] keys (2024), a [float8] enable flag, then [quantize.linear.float8]
    "float8.enable_float8_linear": _ADD_FLOAT8,
    "float8.scaling_type_input": _refuse(str, ("dynamic",), "only dynamic scaling; use 'dynamic'"),
    "float8.scaling_type_weight": _refuse(str, ("dynamic",), "only dynamic scaling; use 'dynamic'"),
    "float8.scaling_type_grad_output": _refuse(
        str, ("dynamic",), "only dynamic scaling; use 'dynamic'"
    ),
    "float8.moe_fqns_prototype": _FLOAT8_EXPERTS,  # mid-2025
    "float8.moe_fqns": _FLOAT8_EXPERTS,  # late 2025
    "float8.force_recompute_fp8_weight_in_bwd": _refuse(
        bool, (False,), "not supported here (torchao removed it); use false"
    ),
    **{f"quantize.linear.float8.{k}": _rename(f"float8.{k}") for k in _FLOAT8},
    "quantize.linear.float8.emulate": _rename("float8.emulate"),
    # [activation_checkpoint]: late-2025 knobs of modes and policies not built here
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": _ignored(
        list, "mixture-of-experts router matmuls; the op policy here treats them like any matmul"
    ),
    "activation_checkpoint.early_stop": _refuse(bool, (False,), "not supported here; use false"),
    "activation_checkpoint.preserve_rng_state": _refuse(
        bool, (False,), "not supported here; use false"
    ),
    "activation_checkpoint.determinism_check": _refuse(
        str, ("default",), "not supported here; use 'default'"
    ),
    "activation_checkpoint.debug": _refuse(bool, (False,), "not supported here; use false"),
    "activation_checkpoint.memory_budget": _ignored(float, "used only by mode 'memory_budget'"),
    "activation_checkpoint.visualize_memory_budget_pareto": _refuse(
        bool, (False,), "not supported here; use false"
    ),
    # [compile], [comm], [debug], [checkpoint]: late-2025 keys with one value here
    "comm.save_traces_file_prefix": _refuse(
        str, ("rank_",), "flight-recorder dumps are named rank_N here"
    ),
    "comm.mode": _refuse(str, ("default",), "fake or local-tensor backends are not built here"),
    "debug.deterministic_warn_only": _refuse(bool, (False,), "not supported here; use false"),
    "debug.moe_force_load_balance": _refuse(bool, (False,), f"it {_MOE}; use false"),
    "checkpoint.load_only": _refuse(bool, (False,), "not supported here; use false"),
    "checkpoint.initial_load_in_hf_quantized": _refuse(
        bool, (False,), "quantized Hugging Face weights are not read here; use false"
    ),
    "checkpoint.enable_ft_dataloader_checkpoints": _ignored(
        bool, "each replica group saves its whole state (loader included) in replica-N/"
    ),
    # [fault_tolerance] (torchft): replica groups and DiLoCo / local SGD are built (the
    # section's own keys); streaming DiLoCo's overlapped sync is not
    "fault_tolerance.fragment_sync_delay": _refuse(
        int, (0,), "the groups' sync is not overlapped with inner steps here; use 0"
    ),
    "fault_tolerance.should_quantize": _refuse(
        bool, (False,), "quantized collectives between groups are not built here; use false"
    ),
    # MX and grouped-matmul quantization: settings of converters not built here
    **{
        key: _ignored(tp, "used only by the mx or grouped-matmul converters, not built here")
        for key, tp in (
            ("mx.use_fp8_dim1_cast_triton_kernel", bool),
            ("mx.mxfp8_dim1_cast_kernel_choice", str),
            ("mx.recipe_name", str),
            ("mx.filter_fqns", list),
            ("mx.moe_fqns_prototype", list),
            ("quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", str),
            ("quantize.linear.mx.recipe_name", str),
            ("quantize.linear.mx.filter_fqns", list),
            ("quantize.grouped_mm.float8.fqns", list),
            ("quantize.grouped_mm.mx.recipe_name", str),
            ("quantize.grouped_mm.mx.fqns", list),
        )
    },
    "parallelism.pipeline_parallel_expert_parallel_overlap": _ignored(
        bool, "used only with expert parallel"
    ),
    # [memory_estimation]: here a script, not a training mode
    "memory_estimation.enabled": _refuse(
        bool, (False,), "use python scripts/estimate_memory.py with the same config instead"
    ),
    "memory_estimation.enable": _refuse(
        bool, (False,), "use python scripts/estimate_memory.py with the same config instead"
    ),
    "memory_estimation.disable_fake_mode": Alias(None, old_type=bool, note="no effect"),
}

# Upstream's debug-model variants named by their attention kernel (its integration tests): the
# debug model with document masking. flavor -> (flavor here, further keys it sets).
FLAVOR_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "debugmodel_flex_attn": ("debugmodel", {"model.attn_mask_type": "block_causal"}),
    "debugmodel_varlen_attn": ("debugmodel", {"model.attn_mask_type": "block_causal"}),
}

# Old values of current keys: key -> {old value: current value}.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "model.name": {"llama": "llama2"},
    "parallelism.pipeline_parallel_schedule": {
        "interleaved_1f1b": "Interleaved1F1B",
        "flexible_interleaved_1f1b": "Interleaved1F1B",
    },
    "model.converters": {"quantize.linear.float8": "float8"},
}


def old_type(dotted: str, keys: dict[str, Any]) -> Any:
    """The type an old key's value is read as, or None when ``dotted`` is no old key."""
    alias = ALIASES.get(dotted)
    if alias is None:
        return None
    return alias.old_type or keys.get(alias.new or "")


def is_old_section(section: str) -> bool:
    return any(old.split(".", 1)[0] == section for old in ALIASES)


# ----------------------------------------------------------------------------- hints

# Words whose swap turns a key into its opposite: never suggested for one another.
_OPPOSITES = [
    {"enable", "disable"},
    {"min", "max"},
    {"first", "last"},
    {"input", "output"},
    {"train", "eval"},
]


def _words(key: str) -> list[str]:
    return key.split("_")


def _same_meaning(typed: str, known: str) -> bool:
    """A typo of ``known``: as many words, each close, none turned into its opposite."""
    a, b = _words(typed), _words(known)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if any({x, y} <= pair for pair in _OPPOSITES):
            return False
        if difflib.SequenceMatcher(None, x, y).ratio() < 0.7:
            return False
    return difflib.SequenceMatcher(None, typed, known).ratio() >= 0.8


def suggest(dotted: str, keys: dict[str, Any]) -> str | None:
    """The key a mistyped ``section.key`` most likely meant, or None.

    Looks in every section and through the old names (answering with the current key), and only
    suggests a key of the same meaning: the same name in another section, or a typo of a name.
    """
    section, key = dotted.partition(".")[0], dotted.rsplit(".", 1)[-1]  # a.b.c: section a, key c
    candidates = {k: k for k in keys}
    # an old name answers with its current key, unless the value changes meaning on the way
    # (negated, or turned into another unit): then the old name itself, which still works
    candidates.update(
        {old: old if a.convert or a.compute else a.new for old, a in ALIASES.items() if a.new}
    )
    same_name = [k for k in candidates if k.rsplit(".", 1)[-1] == key and k != dotted]
    if same_name:
        return candidates[sorted(same_name, key=lambda k: k.split(".")[0] != section)[0]]
    close = [k for k in candidates if _same_meaning(key, k.rsplit(".", 1)[-1])]
    close = [k for k in close if k.split(".")[0] == section] or close
    if not close:
        return None
    best = max(close, key=lambda k: difflib.SequenceMatcher(None, dotted, k).ratio())
    return candidates[best]
