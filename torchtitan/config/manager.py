"""JobConfig: typed, defaulted, documented keys from defaults < TOML file < command line.

Every key lives in a section dataclass below and is declared with :func:`opt`, which records its
help text (shown by ``python train.py --help``) and, where it has them, its choices and bounds.
:func:`parse_args` builds a :class:`JobConfig` and validates it once; any problem raises
:class:`~torchtitan.errors.ConfigError` with one line naming the key as the user wrote it.
This module depends on nothing else in the package (only on ``errors``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from torchtitan.config import compat as config_aliases
from torchtitan.errors import ConfigError, ConfigErrors, Problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_MISSING = object()


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """Declare a config key: default, one-line help, optional choices and numeric bounds."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str | None = opt(
        None, "TOML file with the job's settings (lowest precedence after defaults)"
    )
    dump_folder: str = opt(
        "./outputs", "Folder for everything the run writes: logs, TensorBoard, checkpoints"
    )
    description: str = opt("default job", "Free-text description of the job, logged at start-up")
    print_config: bool = opt(False, "Print the resolved configuration as TOML at start-up")
    custom_config_module: str | None = opt(
        None,
        "Module (dotted name or .py file) whose JobConfig dataclass adds sections and keys",
    )
    save_config_file: str | None = opt(
        None, "Write the resolved config as TOML to this file under dump_folder at start-up"
    )
    custom_import: str | None = opt(
        None, "Module (dotted name or .py file) imported at start-up, e.g. to register a model"
    )


@dataclass
class Model:
    name: str = opt("llama3", "Model family in the train-spec registry (llama2, llama3, qwen3)")
    flavor: str = opt("debugmodel", "Model size within the family (debugmodel, 8B, 70B, ...)")
    n_layers: int = opt(
        0,
        "Transformer blocks, overriding the flavor's count (0: the flavor's); other sizes stay",
        ge=0,
    )
    tokenizer_path: str = opt(
        "tests/assets/tokenizer/tiktoken.model",
        "Tokenizer: a tiktoken BPE file (Llama 3), a SentencePiece model (Llama 2), a "
        "tokenizer.json or a Hugging Face folder; unset with hf_assets_path = that folder's",
    )
    hf_assets_path: str | None = opt(
        None,
        "Hugging Face model folder (tokenizer.json, config.json, *.safetensors); its tokenizer is "
        "used unless tokenizer_path is set",
    )
    converters: list[str] = opt(
        [],
        "Model converters applied to the meta model before parallelism: float8 (GPU; CPU for checks)",
    )
    print_after_conversion: bool = opt(
        False, "Log the model's modules after model.converters were applied"
    )
    vocab_size_from_tokenizer: bool = opt(
        False,
        "Size the embedding from the tokenizer even when it differs from the flavor's published "
        "vocabulary (debug flavors always do)",
    )
    norm_type: str = opt(
        "rmsnorm",
        "RMSNorm implementation: eager, torch.compile'd, or a Triton kernel (CUDA only); same weights",
        choices=("rmsnorm", "compiled_rmsnorm", "fused_rmsnorm"),
    )
    attn_mask_type: str = opt(
        "causal",
        "Attention across the documents packed into a sequence: causal (every earlier token) or "
        "block_causal (earlier tokens of the same document only; FlexAttention on CUDA)",
        choices=("causal", "block_causal"),
    )

    def tokenizer_source(self) -> tuple[str, str]:
        """(path, key that named it): ``tokenizer_path`` when set, else the Hugging Face assets
        folder's tokenizer when ``hf_assets_path`` is set, else the default tokenizer."""
        if self.hf_assets_path and self.tokenizer_path in ("", _DEFAULT_TOKENIZER):
            return self.hf_assets_path, "model.hf_assets_path"
        return self.tokenizer_path, "model.tokenizer_path"


_DEFAULT_TOKENIZER = "tests/assets/tokenizer/tiktoken.model"


@dataclass
class Float8:
    recipe_name: str = opt(
        "tensorwise",
        "Float8 scaling recipe (torchao)",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "FSDP all-gathers float8 weights (tensorwise recipe only)"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute all float8 weight scales in one pass after the optimizer step"
    )
    filter_fqns: list[str] = opt(["output"], "Linear layers (by name) kept in high precision")
    emulate: bool = opt(
        False, "Emulate the float8 matmuls in high precision (torchao), e.g. to test on any GPU"
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "Optimizer; Muon: Muon for the hidden matrices, AdamW (optimizer.lr) for embeddings, "
        "output, norms and biases",
        choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "Peak learning rate", gt=0)
    eps: float = opt(1e-8, "Adam epsilon", gt=0)
    weight_decay: float = opt(0.1, "Decoupled weight decay", ge=0)
    weight_decay_exempt: list[str] = opt(
        ["norms", "biases", "embeddings"],
        "Parameters without weight decay: norms (1-D weights), biases, embeddings (nn.Embedding), "
        "output (the model's final nn.Linear); [] = every parameter decays",
        choices=("norms", "biases", "embeddings", "output"),
    )
    param_groups: list | None = opt(
        None,
        "Rules giving parameters their own settings: [[optimizer.param_groups]] tables with match "
        "(a glob over parameter names, e.g. 'layers.*.attention.*') and lr_multiplier and/or "
        "weight_decay; on the command line JSON",
    )
    beta1: float = opt(0.9, "Adam beta1", ge=0, le=1)
    beta2: float = opt(0.95, "Adam beta2", ge=0, le=1)
    muon_lr: float = opt(
        0.02, "Muon's peak learning rate (the same schedule as optimizer.lr)", gt=0
    )
    muon_momentum: float = opt(0.95, "Muon's momentum (Nesterov)", ge=0, le=1)
    muon_adjust_lr: str = opt(
        "original",
        "Muon's learning rate by matrix shape: original (x sqrt(max(1, rows/cols))) or "
        "match_rms_adamw (x 0.2 sqrt(max(rows, cols)), to share AdamW's learning rate)",
        choices=("original", "match_rms_adamw"),
    )
    muon_ns_steps: int = opt(5, "Muon's Newton-Schulz iterations", ge=1, le=99)
    state_dtype: str = opt(
        "float32",
        "Dtype of the optimizer's moments and momentum buffers between steps; bfloat16 halves "
        "their memory at some precision (docs/optimizers.md)",
        choices=("float32", "bfloat16"),
    )
    implementation: str = opt(
        "fused",
        "Optimizer kernel: fused, foreach or for-loop (falls back to foreach where fused is unsupported)",
        choices=("fused", "foreach", "for-loop"),
    )
    early_step_in_backward: bool = opt(
        False,
        "Step each parameter as soon as backward has its gradient, then free the gradient "
        "(memory); no gradient clipping; not with pipeline parallel, accumulation, DDP or Muon",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warm-up from near zero to optimizer.lr", ge=0)
    decay_ratio: float | None = opt(
        None,
        "Fraction of the post-warm-up steps spent decaying (warmup-stable-decay); unset = all of them",
        ge=0,
        le=1,
    )
    decay_type: str = opt("linear", "Decay curve", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "Final learning rate as a fraction of optimizer.lr", ge=0, le=1)
    total_steps: int | None = opt(
        None, "Steps the schedule spans (warm-up, stable, decay); unset = training.steps", ge=1
    )


@dataclass
class DataLoader:
    """``[training.dataloader]``: worker processes of the training data loader (upstream's keys,
    torch DataLoader's meanings)."""

    num_workers: int = opt(
        0,
        "Processes that read and tokenize the training data ahead of the step, each a share of "
        "every batch's rows (at most training.local_batch_size); resume stays exact; 0 = in the "
        "training process",
        ge=0,
    )
    persistent_workers: bool = opt(
        False, "Keep the worker processes between passes over the data (needs num_workers > 0)"
    )
    pin_memory: bool = opt(
        False, "Batches in page-locked memory for faster host-to-GPU copies (CUDA; no-op on CPU)"
    )
    prefetch_factor: int = opt(
        2, "Batches each worker prepares ahead (torch's default 2; used when num_workers > 0)", ge=1
    )


@dataclass
class Training:
    dataset: str = opt(
        "python_docs", "Named dataset: python_docs (offline debug), c4, c4_validation, fineweb_edu"
    )
    dataset_path: str | None = opt(
        None,
        "Local file or folder (json, jsonl, parquet, txt, save_to_disk), a pretokenized .bin/.idx corpus (prefix, file or folder), or a Hub id; overrides the named dataset's source",
    )
    dataset_text_field: str | None = opt(
        None, "Field holding each row's text; unset = the dataset's default ('text')"
    )
    dataset_streaming: bool | None = opt(
        None, "Stream the dataset instead of downloading it; unset = the dataset's default"
    )
    datasets: list | None = opt(
        None,
        "A weighted mixture of sources replacing dataset/dataset_path: [[training.datasets]] tables with path or dataset, weight, and optional name, text_field, streaming (see docs/data.md); on the command line JSON or name_or_path:weight,...",
    )
    shuffle: bool = opt(
        True,
        "Read each epoch of map-style and pretokenized data in a seeded permutation of its documents (a new one every epoch), streamed data with its files reordered and through a shuffle buffer; false = stored order",
    )
    shuffle_buffer: int = opt(
        100,
        "Documents each virtual shard of streamed data holds to shuffle (they are saved in checkpoints); 0 = streamed data unshuffled",
        ge=0,
    )
    data_seed: int = opt(0, "Seed of the data order (shuffling); independent of debug.seed", ge=0)
    local_batch_size: int = opt(8, "Sequences per micro-batch per data-parallel rank", ge=1)
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree (no accumulation)",
    )
    seq_len: int = opt(2048, "Tokens per sequence", ge=1)
    mask_document_starts: bool = opt(
        False,
        "Do not predict a document's first token from the end of the one before it (its label "
        "is ignored; the loss is the mean over the other tokens)",
    )
    loss_chunks: int = opt(
        0,
        "Compute the output projection and cross entropy this many sequence pieces at a time, never holding the whole batch's logits (0 or 1 = all at once)",
        ge=0,
    )
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm", gt=0)
    steps: int = opt(10000, "Optimizer steps to train", ge=1)
    mixed_precision_param: str = opt(
        "bfloat16",
        "Compute dtype of parameters on GPU (CPU runs stay float32)",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reduction across data-parallel ranks", choices=("float32",)
    )
    gc_freq: int = opt(
        50, "Run Python's garbage collector every N steps (automatic GC is turned off)", ge=1
    )
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps", ge=1)
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars")
    save_tb_folder: str = opt("tb", "TensorBoard folder under job.dump_folder")
    disable_color_printing: bool = opt(False, "Print console metrics without colour")
    enable_wandb: bool = opt(
        False, "Log the same scalars and the config to Weights & Biases (pip install wandb)"
    )
    save_for_all_ranks: bool = opt(
        False, "Every rank writes its own TensorBoard / W&B metrics, not only rank 0"
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "Replicated data-parallel degree (DDP, or HSDP's outer dim)", ge=1
    )
    data_parallel_shard_degree: int = opt(
        -1, "Sharded data-parallel degree (FSDP2); -1 = the rest of the world size"
    )
    tensor_parallel_degree: int = opt(1, "Tensor (and sequence) parallel degree", ge=1)
    pipeline_parallel_degree: int = opt(1, "Pipeline parallel degree", ge=1)
    context_parallel_degree: int = opt(
        1, "Context parallel degree: ranks that split each sequence (all-gather attention)", ge=1
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert parallel degree: ranks that split each MoE layer's experts (tokens go to their "
        "experts by all-to-all), borrowed from data_parallel_shard x context_parallel (x "
        "tensor_parallel with expert_tensor_parallel_degree 1)",
        ge=1,
    )
    expert_tensor_parallel_degree: int = opt(
        1,
        "Tensor parallel degree of the routed experts under expert parallel: 1 (upstream's "
        "default) = whole experts, expert parallel borrowing the TP ranks too, which split the "
        "routed rows; tensor_parallel_degree (or -1) = split like the dense layers. No effect "
        "when expert_parallel_degree is 1",
    )
    disable_loss_parallel: bool = opt(
        False, "Gather logits before the loss instead of a vocab-parallel loss"
    )
    enable_async_tensor_parallel: bool = opt(
        False, "Overlap TP communication with compute (GPU + compile)"
    )
    fsdp_reshard_after_forward: str = opt(
        "default", "Free gathered parameters after forward", choices=("default", "always", "never")
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B", "Pipeline schedule (GPipe, 1F1B, Interleaved1F1B, ...)"
    )
    pipeline_parallel_split_points: list[str] = opt(
        [],
        "Where each pipeline stage after the first begins, e.g. layers.4,layers.8; empty = even split",
    )
    pipeline_parallel_layers_per_stage: int | None = opt(
        None, "Transformer layers per pipeline stage; unset = even split"
    )
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline micro-batch", ge=1)
    pipeline_parallel_first_stage_less_layers: int = opt(
        1,
        "Layers the embedding counts as when stages are split (the first stage gets that many "
        "fewer transformer blocks)",
        ge=0,
    )
    pipeline_parallel_last_stage_less_layers: int = opt(
        1,
        "Layers the final norm + output count as when stages are split (the last stage gets that "
        "many fewer transformer blocks)",
        ge=0,
    )
    pipeline_parallel_schedule_csv: str = opt(
        "",
        "A custom schedule: a CSV file of each pipeline rank's actions (torch's "
        "PipelineScheduleMulti format); empty = the named schedule",
    )


@dataclass
class Moe:
    load_balance_coeff: float = opt(
        1e-3,
        "Auxiliary-loss-free load balancing: each step every MoE layer's expert bias moves this "
        "much towards its under-loaded experts (DeepSeek-V3); 0 = off",
        ge=0,
    )
    aux_loss_coeff: float = opt(
        0.0, "Weight of the sequence-wise load-balancing loss added to the objective; 0 = off", ge=0
    )
    grouped_mm: bool = opt(
        True, "Run the routed experts through torch._grouped_mm (False: one matmul per expert)"
    )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the newest complete one")
    folder: str = opt("checkpoint", "Checkpoint folder under job.dump_folder")
    interval: int = opt(500, "Save every N steps (or seconds, see interval_type)", ge=1)
    interval_type: str = opt(
        "steps",
        "Unit of checkpoint.interval: steps, or seconds of training (checked at each step's end)",
        choices=("steps", "seconds"),
    )
    enable_first_step_checkpoint: bool = opt(
        False, "Also save after step 1 (to find a broken save path before hours of training)"
    )
    keep_latest_k: int = opt(10, "Keep only the newest k complete checkpoints; 0 = keep all", ge=0)
    async_mode: str = opt(
        "disabled", "Asynchronous save", choices=("disabled", "async", "async_with_pinned_mem")
    )
    load_step: int = opt(-1, "Resume from this step instead of the newest; -1 = newest")
    every_save_model_only: bool = opt(
        False, "Every save holds model weights only (exports, not resume points)"
    )
    export_dtype: str = opt(
        "float32", "Dtype of model-only exports", choices=("float32", "bfloat16", "float16")
    )
    exclude_from_loading: list[str] = opt(
        [], "State keys not to load on resume (e.g. dataloader,optimizer)"
    )
    initial_load_path: str | None = opt(None, "Checkpoint to start from when the folder has none")
    initial_load_model_only: bool = opt(True, "Load only model weights from initial_load_path")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face safetensors folder")
    last_save_in_hf: bool = opt(False, "Export the final weights in Hugging Face format")
    last_save_model_only: bool = opt(
        False, "Final save holds only model weights (an export, not a resume point)"
    )
    create_seed_checkpoint: bool = opt(
        False, "Write the initial weights to step-0 from one process and exit"
    )
    on_save_error: str = opt(
        "stop",
        "A save that fails (disk full, permission, I/O error): stop with one line, or log it and "
        "continue training (the previous complete checkpoint is kept either way)",
        choices=("stop", "continue"),
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Activation checkpointing", choices=("none", "full", "selective"))
    selective_ac_option: str = opt(
        "2", "Selective AC: a layer interval like '2', or 'op' for the per-op policy"
    )


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the parts named by compile.components")
    components: list[str] = opt(
        ["model", "loss"],
        "What compile.enable compiles: model (each transformer block), loss (the cross entropy)",
        choices=("model", "loss"),
    )

    def compiles(self, component: str) -> bool:
        """Whether ``component`` ('model' or 'loss') is compiled."""
        return self.enable and component in self.components


@dataclass
class Profiling:
    enable_profiling: bool = opt(
        False, "Write torch.profiler Chrome traces per rank every profile_freq steps"
    )
    save_traces_folder: str = opt("profile_traces", "Trace folder under job.dump_folder")
    profile_freq: int = opt(10, "Trace (and snapshot) every N steps", ge=1)
    profiler_warmup: int = opt(3, "Untraced warm-up steps before the traced ones", ge=0)
    profiler_active: int = opt(1, "Traced steps, ending on each multiple of profile_freq", ge=1)
    enable_memory_snapshot: bool = opt(
        False, "Write CUDA memory snapshots every profile_freq steps and on OOM (GPU only)"
    )
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Snapshot folder under job.dump_folder"
    )


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate held-out loss and perplexity every freq steps")
    dataset: str = opt("c4_validation", "Named validation dataset (as training.dataset)")
    dataset_path: str | None = opt(None, "Local validation data or Hub id")
    datasets: list | None = opt(
        None, "A weighted mixture of validation sources, as training.datasets"
    )
    local_batch_size: int = opt(
        0, "Validation sequences per rank per batch; 0 = training.local_batch_size", ge=0
    )
    seq_len: int = opt(0, "Validation tokens per sequence; 0 = training.seq_len", ge=0)
    freq: int = opt(500, "Validate every N training steps (and after the last)", ge=1)
    steps: int = opt(-1, "Validation batches per evaluation; -1 = the whole dataset", ge=-1)


@dataclass
class Debug:
    seed: int | None = opt(
        None,
        "Seed for every RNG (Python, NumPy, torch); unset = random, logged",
        ge=0,
        le=2**32 - 1,
    )
    deterministic: bool = opt(
        False, "Use deterministic algorithms (bit-for-bit repeatable CPU runs)"
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        600, "Collective timeout until the first step ends (start-up, compile, loading)", ge=1
    )
    train_timeout_seconds: int = opt(600, "Collective timeout after the first step", ge=1)
    trace_buf_size: int = opt(
        20000, "NCCL flight-recorder entries kept per rank (CUDA; 0 turns it off)", ge=0
    )
    save_traces_folder: str = opt(
        "comm_traces", "Flight-recorder dumps on a timeout, under job.dump_folder (CUDA)"
    )


@dataclass
class Resilience:
    hang_watchdog_factor: float = opt(
        10.0,
        "A training step running longer than this many times the median step (and the floor) "
        "makes every rank write its Python stacks to job.dump_folder/hangs/step-N/; 0 turns it off",
        ge=0,
    )
    hang_watchdog_floor_seconds: float = opt(
        60.0, "The hang watchdog never fires on a step shorter than this", gt=0
    )
    preemption_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1"],
        "Signals after which every rank saves a checkpoint at the next step boundary and exits "
        "with code 160 (preempted; start again to resume); [] = default signal handling. "
        "Ctrl-C (SIGINT) unless listed here stops the same way with code 130",
        choices=("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"),
    )
    straggler_threshold: float = opt(
        1.2,
        "Every metrics.log_freq steps, name the slowest rank when its busy time over the interval "
        "is this many times the median rank's; 0 turns the report off",
        ge=0,
    )
    loss_spike_zscore: float = opt(
        0.0,
        "Skip the optimizer update of a step whose loss is this many standard deviations above "
        "the mean of recent steps; 0 turns the guard off",
        ge=0,
    )
    loss_spike_window: int = opt(
        100, "Recent accepted steps whose loss mean and deviation the spike guard uses", ge=2
    )
    loss_spike_warmup_steps: int = opt(
        20, "Accepted steps the spike guard sees before it may skip one", ge=2
    )
    loss_spike_max_consecutive: int = opt(
        3, "Stop the run after this many consecutive skipped steps", ge=1
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    float8: Float8 = field(default_factory=Float8)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: Moe = field(default_factory=Moe)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)
    resilience: Resilience = field(default_factory=Resilience)

    def __post_init__(self) -> None:
        self.origins: dict[str, Setting] = {}  # key -> where parse_args found it
        self.warnings: list[str] = []  # old key names used, one line each

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved config as TOML (unset optional keys are written as comments)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    lines.append(f"# {key} = (unset)")
                else:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- introspection


def _sections(cls: type | None = None) -> dict[str, type]:
    cls = cls or JobConfig
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _keys(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """A section's keys; a field that is itself a dataclass (``training.dataloader``, as upstream
    nests it) gives its keys under its name: ``dataloader.num_workers``."""
    hints = typing.get_type_hints(section_cls)
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for f in dataclasses.fields(section_cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update({f"{f.name}.{k}": v for k, v in _keys(hints[f.name]).items()})
        else:
            out[f.name] = (f, hints[f.name])
    return out


def _owner(cfg: Any, dotted: str) -> tuple[Any, str]:
    """The object that holds key ``dotted`` (``training.dataloader.num_workers``: the
    ``training.dataloader`` object) and the key's own name."""
    *path, key = dotted.split(".")
    for name in path:
        cfg = getattr(cfg, name)
    return cfg, key


def all_keys(cls: type | None = None) -> dict[str, Any]:
    """Every current key as ``section.key`` -> its type."""
    return {
        f"{section}.{key}": tp
        for section, section_cls in _sections(cls).items()
        for key, (_, tp) in _keys(section_cls).items()
    }


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _strip_optional(tp)
    name = "list[str]" if typing.get_origin(base) is list else base.__name__
    return f"{name} (optional)" if optional else name


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (an entry of training.datasets)
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


# ----------------------------------------------------------------------------- value conversion

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(raw: Any, tp: Any, from_cli: bool) -> Any:
    """Convert a TOML value or CLI string to the key's type, or raise ConfigError (the caller
    puts the key and where it was written in front of the message)."""
    base, optional = _strip_optional(tp)
    if optional and (
        raw is None or (from_cli and isinstance(raw, str) and raw.lower() in ("none", ""))
    ):
        return None
    want = _type_name(tp)
    if base is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
    elif base is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
    elif base is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if from_cli and isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif base is str:
        if isinstance(raw, str):
            return raw
    elif base is list:  # tables (training.datasets) or an old key's raw list
        if isinstance(raw, list):
            return raw
        if isinstance(raw, str):  # the key's own parser reads the text (training.datasets)
            return raw
    elif typing.get_origin(base) is list:
        if isinstance(raw, str):
            return [s.strip() for s in raw.split(",") if s.strip()]
        if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
            return list(raw)
    raise ConfigError(f"{raw!r} is not a valid {want}")


# ----------------------------------------------------------------------------- reading settings


@dataclass(frozen=True)
class Setting:
    """One key as the user wrote it: where (a TOML file or the command line), name and value."""

    origin: str  # the TOML file's path, or "command line"
    written: str  # section.key as written (a current name, an old upstream name, or a typo)
    raw: Any
    from_cli: bool = False

    def where(self) -> str:
        """``FILE: key`` or ``command line: --key``, the prefix of any line about this setting."""
        return f"{self.origin}: {'--' if self.from_cli else ''}{self.written}"


def split_cli(argv: list[str]) -> list[Setting]:
    """Turn ``--a.b v``, ``--a.b=v`` and bare boolean ``--a.b`` into settings (unknown keys are
    reported later, together with every other problem)."""
    out: list[Setting] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"command line: unexpected argument '{arg}'; options look like --section.key value"
            )
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            out.append(Setting(CLI, key, value, True))
            i += 1
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_value = nxt is not None and (not nxt.startswith("--") or _looks_numeric(nxt))
        if _is_bool_key(body) and (nxt is None or nxt.lower() not in _TRUE | _FALSE):
            takes_value = False
            out.append(Setting(CLI, body, "true", True))
        elif takes_value:
            out.append(Setting(CLI, body, nxt, True))
        elif _is_bool_key(body) is None:  # unknown: reported with the other problems
            out.append(Setting(CLI, body, "true", True))
        else:
            tp = all_keys().get(body) or config_aliases.old_type(body, all_keys())
            raise ConfigError(f"command line: --{body} needs a value ({_type_name(tp)})")
        i += 2 if takes_value else 1
    return out


CLI = "command line"


def _is_bool_key(dotted: str) -> bool | None:
    """Whether the key (current or old name) is a boolean; None when the key is unknown."""
    keys = all_keys()
    tp = keys.get(dotted) or config_aliases.old_type(dotted, keys)
    return None if tp is None else _strip_optional(tp)[0] is bool


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _load_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"job.config_file: '{path}' does not exist or is not a file; give a TOML file such as train_configs/debug_model.toml"
        )
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file: '{path}' is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read '{path}': {e.strerror}") from None


def toml_settings(path: str, problems: Problems) -> list[Setting]:
    """A TOML file's keys as settings; nested tables (``[quantize.linear.float8]``) give dotted
    keys. Top-level values are problems."""
    out: list[Setting] = []

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif not prefix:
                problems.add(f"{path}: '{key}' must be in a [section] table, not a top-level value")
            else:
                out.append(Setting(path, f"{prefix}{key}", value))

    walk(_load_toml(path), "")
    return out


# ----------------------------------------------------------------------------- applying settings


class _Builder:
    """Applies settings in order (defaults < TOML < command line) to a JobConfig, through the
    alias table, recording where each key was set and collecting every problem."""

    def __init__(self, cfg: JobConfig, problems: Problems):
        self.cfg, self.problems = cfg, problems
        self.keys = all_keys(type(cfg))
        self.sections = _sections(type(cfg))
        self.order: dict[str, int] = {}  # current key -> when it was last set
        self.deferred: list[tuple[int, Setting, Any]] = []
        self.implied: list[tuple[int, Setting, dict[str, Any]]] = []

    def apply(self, n: int, s: Setting) -> None:
        alias = config_aliases.ALIASES.get(s.written)
        if alias is None and s.written not in self.keys:
            raise ConfigError(self._unknown(s))
        if alias is None:
            self._set(n, s, s.written, self._typed(s, self.keys[s.written]))
            return
        value = self._typed(s, alias.old_type or self.keys[alias.new])
        if alias.only is not None and value not in alias.only:
            raise ConfigError(f"{s.where()}: {value!r}: {alias.why}")
        self._warn(s, alias.warning(s.where(), s.origin))
        if alias.compute is not None:  # needs other keys: done once every layer is applied
            self.deferred.append((n, s, value))
            return
        if alias.new is None:
            return
        if alias.convert is not None:
            value = alias.convert(value, self._get(alias.new))
        self._set(n, s, alias.new, value)
        for key, extra in (alias.also(value) if alias.also else {}).items():
            self._set(n, s, key, extra)

    def finish(self) -> None:
        for n, s, extra in self.implied:  # keys an old flavor name implies, unless set later
            for key, value in extra.items():
                if self.order.get(key, -1) <= n:
                    self._set(n, s, key, value)
        for n, s, value in self.deferred:
            alias = config_aliases.ALIASES[s.written]
            if alias.new is not None and self.order.get(alias.new, -1) > n:
                continue  # the current key was set later (higher precedence)
            with self.problems.collect():
                try:
                    computed = alias.compute(value, self.cfg)
                except ConfigError as e:  # where the old key was set, as every other line
                    raise ConfigError(f"{s.where()}: {e}") from None
                if alias.new is not None:
                    self._set(n, s, alias.new, computed)

    def _typed(self, s: Setting, tp: Any) -> Any:
        try:
            return _convert(s.raw, tp, s.from_cli)
        except ConfigError as e:
            raise ConfigError(f"{s.where()}: {e}") from None

    def _get(self, dotted: str) -> Any:
        return getattr(*_owner(self.cfg, dotted))

    def _set(self, n: int, s: Setting, dotted: str, value: Any) -> None:
        if dotted == "model.flavor" and value in config_aliases.FLAVOR_ALIASES:
            value = self._old_flavor(n, s, value)
        renamed = config_aliases.VALUE_ALIASES.get(dotted, {})
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str) and item in renamed:
                self._warn(s, f"{s.where()}: {item!r} is now {renamed[item]!r}")
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = list(dict.fromkeys(renamed.get(v, v) for v in value))
        elif isinstance(value, str):
            value = renamed.get(value, value)
        setattr(*_owner(self.cfg, dotted), value)
        self.order[dotted] = n
        self.cfg.origins[dotted] = s

    def _old_flavor(self, n: int, s: Setting, old: str) -> str:
        """An upstream flavor name that means a flavor here plus other keys (applied in
        ``finish`` unless a later setting gives them): the flavor, and one warning line."""
        flavor, extra = config_aliases.FLAVOR_ALIASES[old]
        self.implied.append((n, s, extra))
        keys = " with ".join(
            [f"model.flavor = {flavor!r}", *(f"{k} = {v!r}" for k, v in extra.items())]
        )
        self._warn(s, f"{s.where()}: {old!r} is upstream's debug model with document masking; "
                   f"here it is {keys} (FlexAttention on CUDA, SDPA with a document mask on CPU)")  # fmt: skip
        return flavor

    def _warn(self, s: Setting, line: str) -> None:
        if line not in self.cfg.warnings:
            self.cfg.warnings.append(line)

    def _unknown(self, s: Setting) -> str:
        if "." not in s.written:
            return f"{s.where()}: not of the form section.key (see python train.py --help)"
        section = s.written.split(".", 1)[0]
        hint = config_aliases.suggest(s.written, self.keys)
        if hint:
            return f"{s.where()}: unknown key; did you mean '{hint}'?"
        return f"{s.where()}: unknown key; see python train.py --help for the keys of [{section}]"

    def in_known_sections(self, settings: list[Setting]) -> list[Setting]:
        """The settings whose section exists (here, or as an old upstream section). A section
        that does not is one problem line per file (or for the command line), with the section
        it most likely meant; its keys are not judged one by one."""
        kept: list[Setting] = []
        unknown: dict[tuple[str, str], list[Setting]] = {}
        for s in settings:
            section = s.written.split(".", 1)[0]
            if "." not in s.written or section in self.sections:
                kept.append(s)
            elif config_aliases.is_old_section(section):
                kept.append(s)
            else:
                unknown.setdefault((s.origin, section), []).append(s)
        for (origin, section), group in unknown.items():
            where = origin
            if origin == CLI:
                where += ": " + ", ".join(f"--{s.written}" for s in group)
            self.problems.add(
                f"{where}: unknown section [{section}]; {self._meant(section, group)}"
            )
        return kept

    def _meant(self, section: str, group: list[Setting]) -> str:
        """``did you mean [x]?`` for an unknown section: a close name, else the one section
        holding most of its keys (more than half); else the list of sections."""
        close = difflib.get_close_matches(section, list(self.sections), n=1, cutoff=0.75)
        if not close:
            names = {s.written.split(".", 1)[1] for s in group}
            fits = {sec: sum(f"{sec}.{k}" in self.keys for k in names) for sec in self.sections}
            best = sorted(fits, key=lambda sec: -fits[sec])[:2]
            if 2 * fits[best[0]] > len(names) and fits[best[0]] > fits[best[1]]:
                close = best[:1]
        if close:
            return f"did you mean [{close[0]}]?"
        return f"sections: {', '.join(self.sections)}"


def parse_args(
    argv: list[str] | None = None, *, need_files: bool = True, problems: Problems | None = None
) -> JobConfig:
    """Build and validate a JobConfig from defaults, ``--job.config_file`` and CLI overrides.

    Every problem found is reported at once (ConfigErrors, one line each), or, when ``problems``
    is given, added to it (the config is then returned as far as it could be built, so that
    later checks can report theirs too). Old upstream key names are applied through the alias
    table and leave one line each in ``cfg.warnings``. ``need_files=False`` skips the checks that
    input files exist (for tools that only read the configuration, like the memory estimate)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = split_cli(argv)
    found = Problems() if problems is None else problems
    config_file = next((s.raw for s in reversed(cli) if s.written == "job.config_file"), None)
    settings = toml_settings(config_file, found) if config_file else []
    settings += [s for s in cli if s.written != "job.config_file"]
    cfg = _config_class(settings, found)()
    builder = _Builder(cfg, found)
    for n, s in enumerate(builder.in_known_sections(settings)):
        with found.collect():
            builder.apply(n, s)
    builder.finish()
    cfg.job.config_file = config_file
    with found.collect():
        check_values(cfg, need_files=need_files)
    for line in config_warnings(cfg):
        if line not in cfg.warnings:
            cfg.warnings.append(line)
    if problems is None:
        found.raise_if_any()
    return cfg


def _config_class(settings: list[Setting], problems: Problems) -> type[JobConfig]:
    """JobConfig, extended by ``job.custom_config_module`` when one is given."""
    names = ("job.custom_config_module", "experimental.custom_args_module")
    module = next((s for s in reversed(settings) if s.written in names), None)
    if module is None or not module.raw:
        return JobConfig
    with problems.collect():
        return extend_job_config(str(module.raw), module.where())
    return JobConfig


def extend_job_config(module_name: str, where: str = "job.custom_config_module") -> type:
    """JobConfig merged with the ``JobConfig`` dataclass of a user's module (a dotted module name
    or a .py file): its new sections are added and its keys join ours in shared sections."""
    mod = import_user_module(module_name, where, "a JobConfig dataclass")
    custom = getattr(mod, "JobConfig", None)
    if not dataclasses.is_dataclass(custom):
        raise ConfigError(f"{where}: '{module_name}' defines no JobConfig dataclass")
    ours = _sections()
    merged = []
    for name, section_cls in _sections(custom).items():
        if name in ours and section_cls is not ours[name]:
            section_cls = dataclasses.make_dataclass(
                ours[name].__name__, [], bases=(section_cls, ours[name])
            )
        merged.append((name, section_cls, field(default_factory=section_cls)))
    return dataclasses.make_dataclass("JobConfig", merged, bases=(JobConfig,))


def import_user_module(name: str, where: str, what: str) -> types.ModuleType:
    """A user's module, by dotted name or .py file path; ConfigError naming ``where`` if it
    cannot be imported (``what``: what the module should provide, for the message)."""
    try:
        if not name.endswith(".py"):
            return importlib.import_module(name)
        module_name = os.path.basename(name)[:-3]
        spec = importlib.util.spec_from_file_location(module_name, name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # so that its dataclasses resolve their annotations
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError, SyntaxError) as e:
        raise ConfigError(
            f"{where}: cannot import '{name}' ({e}); give an importable module name or a .py "
            f"file that provides {what}"
        ) from None


def locate(cfg: JobConfig, line: str) -> str:
    """Put where a key was set in front of a problem line that starts with ``section.key:``:
    ``FILE: key`` (its old name too, when an alias set it) or ``command line: --key``."""
    key, sep, rest = line.partition(": ")
    setting = cfg.origins.get(key) if sep else None
    if setting is None:
        if sep and key in all_keys(type(cfg)):
            return f"{key} (default): {rest}"
        return line
    if setting.written != key:
        return f"{setting.where()} (now {key}): {rest}"
    return f"{setting.where()}: {rest}"


def located(cfg: JobConfig, e: ConfigError) -> ConfigError:
    """``e`` with every line passed through :func:`locate`."""
    lines = [locate(cfg, line) for line in str(e).splitlines()]
    return ConfigErrors(lines) if len(lines) > 1 else ConfigError(lines[0])


# ----------------------------------------------------------------------------- validation


def _check_bounds(cfg: JobConfig, problems: Problems) -> None:
    for section, cls in _sections(type(cfg)).items():
        for key, (f, _) in _keys(cls).items():
            value = getattr(*_owner(cfg, f"{section}.{key}"))
            meta, name = f.metadata, f"{section}.{key}"
            if value is None:
                continue
            with problems.collect():
                for item in value if isinstance(value, list) else [value]:
                    if meta.get("choices") and item not in meta["choices"]:
                        valid = ", ".join(str(c) for c in meta["choices"])
                        raise ConfigError(f"{name}: {item!r} is not one of: {valid}")
                if meta.get("ge") is not None and value < meta["ge"]:
                    raise ConfigError(f"{name}: {value} must be >= {meta['ge']}")
                if meta.get("gt") is not None and value <= meta["gt"]:
                    raise ConfigError(f"{name}: {value} must be > {meta['gt']}")
                if meta.get("le") is not None and value > meta["le"]:
                    raise ConfigError(f"{name}: {value} must be <= {meta['le']}")


def check_values(cfg: JobConfig, *, need_files: bool = True) -> None:
    """Checks that need no process group, model or data: every problem, one line each, where
    each key was set in front (ConfigError / ConfigErrors)."""
    problems = Problems()
    _check_bounds(cfg, problems)
    for check in _CHECKS:
        with problems.collect():
            check(cfg)
    if need_files:
        with problems.collect():
            _check_files(cfg)
    if problems.lines:
        raise located(cfg, ConfigErrors(problems.lines))


def config_warnings(cfg: JobConfig) -> list[str]:
    """Settings that are valid but probably not meant, one line each, where each key was set in
    front: a warm-up that outlasts training (the learning rate never reaches optimizer.lr, and
    the schedule's stable and decay phases never come)."""
    t, lr = cfg.training, cfg.lr_scheduler
    if t.steps < 1 or lr.warmup_steps < 1 or (lr.total_steps or 1) < 1:
        return []  # invalid values are reported as errors
    warmup = min(lr.warmup_steps, lr.total_steps or t.steps)  # as lr_scheduling.lr_factor
    if warmup < t.steps:
        return []
    last = t.steps / (warmup + 1)
    return [
        locate(
            cfg,
            f"lr_scheduler.warmup_steps: {lr.warmup_steps} warm-up steps, but training.steps is "
            f"{t.steps}: the whole run is warm-up, the learning rate rising to {last:.0%} of "
            "optimizer.lr at the last step, never reaching it or decaying; make warmup_steps "
            "smaller than training.steps",
        )
    ]


def _check_wandb(cfg: JobConfig) -> None:
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb: the wandb package is not installed; pip install wandb, or "
            "leave it false"
        )


def _check_profiling(cfg: JobConfig) -> None:
    pr = cfg.profiling
    if pr.enable_profiling and pr.profiler_warmup + pr.profiler_active > pr.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup: profiler_warmup + profiler_active ({pr.profiler_warmup} "
            f"+ {pr.profiler_active}) must be <= profiling.profile_freq ({pr.profile_freq})"
        )


def _check_checkpoint(cfg: JobConfig) -> None:
    ck, problems = cfg.checkpoint, Problems()
    if ck.initial_load_in_hf and not (ck.initial_load_path or cfg.model.hf_assets_path):
        problems.add(
            "checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path or "
            "model.hf_assets_path (a Hugging Face model folder with config.json and *.safetensors)"
        )
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        problems.add(
            "checkpoint.initial_load_model_only: must be true with initial_load_in_hf (Hugging "
            "Face folders hold model weights only)"
        )
    for key in ("initial_load_path", "last_save_in_hf"):
        if getattr(ck, key) and not ck.enable:
            problems.add(f"checkpoint.{key}: needs checkpoint.enable = true")
    if ck.create_seed_checkpoint and not ck.enable:
        problems.add(
            "checkpoint.create_seed_checkpoint: needs checkpoint.enable = true (the seed is "
            "written to the checkpoint folder)"
        )
    problems.raise_if_any()


def save_config(cfg: JobConfig) -> str:
    """``job.save_config_file`` under the dump folder: the resolved config as TOML; its path."""
    path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(cfg.to_toml())
    return path


def global_batch(local_batch_size: int, global_batch_size: int, dp: int = 1) -> tuple[int, int]:
    """``(global batch, gradient accumulation steps)`` of ``local_batch_size`` sequences per
    rank on ``dp`` data-parallel ranks; ``global_batch_size`` -1 means one local batch per rank.
    The one place the batch arithmetic is checked (config, job plan and data loader call it)."""
    per_step = local_batch_size * dp
    total = per_step if global_batch_size == -1 else global_batch_size
    if total < 1:
        raise ConfigError(
            f"training.global_batch_size: {global_batch_size} must be -1 (derived) or >= 1"
        )
    if total % per_step:
        times = (
            "" if dp == 1 else f" x data-parallel degree = {local_batch_size} x {dp} = {per_step}"
        )
        raise ConfigError(
            f"training.global_batch_size: {total} must be a multiple of "
            f"training.local_batch_size{times or f' ({local_batch_size})'}"
        )
    return total, total // per_step


def _check_batch(cfg: JobConfig) -> None:
    t = cfg.training
    if t.local_batch_size >= 1:  # else reported by the bounds check
        global_batch(t.local_batch_size, t.global_batch_size)


def _check_debug(cfg: JobConfig) -> None:
    if cfg.debug.deterministic and cfg.debug.seed is None:
        raise ConfigError("debug.deterministic: needs debug.seed to be set (e.g. --debug.seed 42)")


def _check_files(cfg: JobConfig) -> None:
    m, problems = cfg.model, Problems()
    if m.hf_assets_path and not os.path.isdir(m.hf_assets_path):
        problems.add(
            f"model.hf_assets_path: '{m.hf_assets_path}' is not a folder; give a Hugging Face "
            "model folder (see scripts/download_hf_assets.py)"
        )
    path, key = m.tokenizer_source()
    if key == "model.tokenizer_path" and not os.path.exists(path):
        problems.add(
            f"model.tokenizer_path: '{path}' does not exist; give a tokenizer file (tiktoken, "
            "SentencePiece or tokenizer.json) or a Hugging Face model folder (see "
            "scripts/download_hf_assets.py)"
        )
    problems.raise_if_any()


_CHECKS = (_check_wandb, _check_profiling, _check_checkpoint, _check_batch, _check_debug)


# ----------------------------------------------------------------------------- help


def help_text() -> str:
    out = [
        "usage: python train.py [--job.config_file FILE.toml] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --a.b, --a.b=true|false.",
        "Lists: comma-separated (--model.converters a,b). Optional keys: 'none' unsets.",
        "",
    ]
    for section, cls in _sections().items():
        out.append(f"[{section}]")
        for key, (f, tp) in _keys(cls).items():
            default = _default_of(f)
            shown = "unset" if default is None else _toml_value(default)
            extra = ""
            if f.metadata.get("choices"):
                extra = f" {{{'|'.join(str(c) for c in f.metadata['choices'])}}}"
            out.append(f"  --{section}.{key}  ({_type_name(tp)}, default {shown}){extra}")
            out.append(f"      {f.metadata.get('help', '')}")
        out.append("")
    return "\n".join(out)
