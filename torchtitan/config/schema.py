"""The configuration's schema: every section and key of :class:`JobConfig`, declared with
:func:`opt` (default, one-line help, choices and bounds), and the introspection the parser, the
checks, ``--help`` and the docs generator share. Depends on nothing else in the package."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from torchtitan.config.parse import Setting

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
    num_mtp_layers: int = opt(
        -1,
        "Multi-token-prediction depths (DeepSeek-V3's num_nextn_predict_layers), overriding the "
        "flavor's (-1: the flavor's; 0: none); families with multi-token prediction only",
        ge=-1,
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
        "Local file or folder (json, jsonl, parquet, txt, save_to_disk), a pretokenized .bin/.idx corpus (prefix, file or folder), a URL of either (s3://..., copied to the local cache), or a Hub id; overrides the named dataset's source",
    )
    dataset_text_field: str | None = opt(
        None,
        "Field holding each row's text, token ids or conversation; unset = the dataset's default ('text'; 'messages' where the data has no 'text' but has 'messages')",
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
    chat_template: str | None = opt(
        None,
        "Chat template for conversation data (rows whose field holds a list of messages): a .jinja file, a tokenizer_config.json or a folder holding one; unset = the tokenizer folder's own (docs/finetuning.md)",
    )
    mtp_loss_weight: float = opt(
        0.3,
        "Weight of the mean multi-token-prediction loss in the objective (DeepSeek-V3's lambda: "
        "0.3, then 0.1 for its last 4.8T tokens); used when the model has MTP depths",
        gt=0,
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
    folder: str = opt(
        "checkpoint",
        "Checkpoint folder under job.dump_folder, or an object-storage URL (s3://bucket/prefix, "
        "any installed fsspec protocol; credentials from the environment, docs/checkpoint.md)",
    )
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
    initial_load_path: str | None = opt(
        None, "Checkpoint to start from when the folder has none (a folder or a URL)"
    )
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

    backend: str = opt(
        "inductor",
        "torch.compile backend: inductor (generated kernels), aot_eager (the captured forward and "
        "backward graphs run op by op, no code generated: for debugging and quick checks), eager",
        choices=("inductor", "aot_eager", "eager"),
    )

    def compiles(self, component: str) -> bool:
        """Whether ``component`` ('model' or 'loss') is compiled."""
        return self.enable and component in self.components

    def described(self) -> str:
        """'torch.compile', with the backend named where it is not inductor (for log lines)."""
        return "torch.compile" + ("" if self.backend == "inductor" else f" ({self.backend})")


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
    dataset_path: str | None = opt(None, "Local validation data, a URL of it, or a Hub id")
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
class Eval:
    enable: bool = opt(
        False,
        "Score multiple-choice tasks (lm-eval's acc and acc_norm) every freq steps and after "
        "the last",
    )
    tasks: list | None = opt(
        None,
        "[[eval.tasks]] tables: name (a built-in task: hellaswag, arc_easy, arc_challenge, piqa, "
        "openbookqa, winogrande, sciq; or any), path (a JSON-lines file), optional layout, "
        "doc_to_text / doc_to_choice / doc_to_target / target_delimiter (lm-eval's keys), limit "
        "(see docs/evaluation.md); on the command line JSON or name:path,...",
    )
    freq: int = opt(500, "Evaluate every N training steps (and after the last)", ge=1)
    local_batch_size: int = opt(
        0, "Requests (context + one choice) per rank per batch; 0 = training.local_batch_size", ge=0
    )
    seq_len: int = opt(
        0, "Tokens per request row (a longer request keeps its end); 0 = training.seq_len", ge=0
    )
    add_bos: bool = opt(
        True,
        "Start each context with the tokenizer's BOS token (as training documents start, and as "
        "a Hugging Face tokenizer that adds BOS encodes for lm-eval)",
    )
    save_samples: bool = opt(
        True,
        "Write each document's choice log-likelihoods and prediction to "
        "job.dump_folder/eval/step-N/TASK.jsonl (lm-eval's samples)",
    )


@dataclass
class Lora:
    enable: bool = opt(
        False,
        "Train low-rank adapters on the target linear layers, the rest of the model frozen; "
        "needs a base model (checkpoint.initial_load_path, or checkpoint.initial_load_in_hf)",
    )
    rank: int = opt(8, "Rank r of each adapter (A: r x in, B: out x r)", ge=1)
    alpha: float = opt(16.0, "The update is scaled by alpha / rank (peft's lora_alpha)", gt=0)
    dropout: float = opt(0.0, "Dropout on the adapters' input (peft's lora_dropout)", ge=0, le=0.99)
    target_modules: list = opt(
        ["wqkv", "wo", "w1", "w2", "w3"],
        "Globs over the names of the linear layers to adapt (layers.*.attention.wqkv); a name "
        "without a dot also matches the last part (wqkv: every layer's)",
    )
    merge_on_export: bool = opt(
        True,
        "With checkpoint.last_save_in_hf: also write step-N-hf with the adapters merged into "
        "the weights (an ordinary Hugging Face folder), besides the peft adapter folder "
        "step-N-peft",
    )


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False,
        "Run this job as one replica group of fault_tolerance.group_size with torchft: groups "
        "average their gradients every step (or meet every sync_steps: semi_sync_method), a "
        "group that fails is restarted and heals from a live one while the others keep "
        "training (docs/reliability.md); needs the lighthouse address in TORCHFT_LIGHTHOUSE",
    )
    replica_id: int = opt(0, "This group's index, 0 .. group_size - 1", ge=0)
    group_size: int = opt(
        0, "How many replica groups train together; the global batch is split among them", ge=0
    )
    min_replica_size: int = opt(1, "Fewest live groups a step needs to be committed", ge=1)
    process_group: str = opt(
        "gloo",
        "The collectives between groups: gloo (CPU tensors; GPU ones are copied) or nccl",
        choices=("gloo", "nccl"),
    )
    process_group_timeout_ms: int = opt(
        10000,
        "How long a collective between groups waits for a group (a dead group's step is "
        "retried without it after this)",
        ge=1,
    )
    quorum_timeout_ms: int = opt(
        0,
        "How long a group waits for the others at a quorum before it stops; 0: 60 s for groups "
        "in step, 30 min with semi_sync_method (longer than sync_steps steps plus the "
        "lighthouse's --join_timeout_ms)",
        ge=0,
    )
    semi_sync_method: str | None = opt(
        None,
        "How the groups train together: every step (unset: gradients averaged each step), "
        "diloco (each group steps alone; every sync_steps steps the average of their weight "
        "changes is one outer Nesterov-SGD step) or local_sgd (every sync_steps steps the "
        "weights are averaged)",
        choices=("diloco", "local_sgd"),
    )
    sync_steps: int = opt(
        5, "diloco / local_sgd: the groups meet every this many steps (H, the inner steps)", ge=1
    )
    outer_lr: float = opt(
        0.7, "diloco: learning rate of the outer SGD step (the DiLoCo paper's 0.7)", gt=0
    )
    outer_momentum: float = opt(
        0.9, "diloco: Nesterov momentum of the outer step (the DiLoCo paper's 0.9; 0 = none)", ge=0
    )
    fragment_update_alpha: float = opt(
        0.0,
        "diloco: after the outer step, the weights are (1 - alpha) x the new global weights "
        "+ alpha x this group's own (0 = the global weights)",
        ge=0,
        le=1,
    )


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
    eval: Eval = field(default_factory=Eval)
    lora: Lora = field(default_factory=Lora)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
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
                    lines.append(f"{key} = {toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- introspection


def sections(cls: type | None = None) -> dict[str, type]:
    cls = cls or JobConfig
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def keys(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """A section's keys; a field that is itself a dataclass (``training.dataloader``, as upstream
    nests it) gives its keys under its name: ``dataloader.num_workers``."""
    hints = typing.get_type_hints(section_cls)
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for f in dataclasses.fields(section_cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update({f"{f.name}.{k}": v for k, v in keys(hints[f.name]).items()})
        else:
            out[f.name] = (f, hints[f.name])
    return out


def owner(cfg: Any, dotted: str) -> tuple[Any, str]:
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
        for section, section_cls in sections(cls).items()
        for key, (_, tp) in keys(section_cls).items()
    }


def strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    base, optional = strip_optional(tp)
    name = "list[str]" if typing.get_origin(base) is list else base.__name__
    return f"{name} (optional)" if optional else name


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (an entry of training.datasets)
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
