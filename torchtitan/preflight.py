"""Every check that needs no process group: run by train.py, and by the launcher before torchrun.

``python -m torchtitan.preflight --world-size N [train.py arguments]`` exits 0 when the job can
start on N processes, or prints one ``error: ...`` line and exits 2, so that a bad config is
reported once, before torchrun starts any worker (and without torchrun's failure report).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan import utils
from torchtitan.config_manager import JobConfig, parse_args
from torchtitan.datasets.hf_datasets import check_dataset_config
from torchtitan.errors import ConfigError, TorchTitanError
from torchtitan.float8 import check_converters
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_llama import PipelinePlan, check_pipeline_config
from torchtitan.train_spec import TrainSpec, get_model_args, get_train_spec


@dataclass
class Plan:
    """What the checks resolved: the parallel layout, the model family and its arguments."""

    dims: ParallelDims
    spec: TrainSpec
    model_args: Any
    grad_accum_steps: int
    global_batch_size: int
    pipeline: PipelinePlan | None = None  # set when parallelism.pipeline_parallel_degree > 1


def check(job_config: JobConfig, world_size: int) -> Plan:
    p, t = job_config.parallelism, job_config.training
    if job_config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint: runs on one process (NGPU=1), not {world_size}; "
            "the seed then starts runs of any layout"
        )
    _check_device_features(job_config, utils.device_type)
    if job_config.checkpoint.create_seed_checkpoint:  # the whole model in one process
        dims = ParallelDims(1, 1, 1, 1, 1, world_size=1)
    else:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=world_size,
        )
    check_dataset_config(t.dataset, t.dataset_path)
    _check_validation(job_config, dims)
    spec = get_train_spec(job_config.model.name)
    model_args = _model_args(job_config)
    _check_model_fits_layout(dims, model_args)
    _check_sequence_split(dims, t.seq_len)
    pipeline = check_pipeline_config(job_config, model_args, dims) if dims.pp > 1 else None
    per_step = t.local_batch_size * dims.dp
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(
            f"training.global_batch_size: {global_batch} must be a multiple of training.local_batch_size "
            f"x data-parallel degree = {t.local_batch_size} x {dims.dp} = {per_step}"
        )
    return Plan(dims, spec, model_args, global_batch // per_step, global_batch, pipeline)


def _model_args(job_config: JobConfig) -> Any:
    """The flavor's model arguments with the ``model.*`` overrides applied."""
    m = job_config.model
    flavor = get_model_args(m.name, m.flavor)
    return dataclasses.replace(
        flavor, norm_type=m.norm_type, n_layers=m.n_layers or flavor.n_layers
    )


def _check_model_fits_layout(dims: ParallelDims, args: Any) -> None:
    key = "parallelism.tensor_parallel_degree"
    sizes = (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("dim", args.dim))
    for what, n in sizes + (("feed-forward hidden size", args.ffn_hidden_dim()),):
        if n % dims.tp:
            raise ConfigError(
                f"{key}: {dims.tp} does not divide the model's {what} ({n}); use a divisor of it"
            )


def _check_validation(job_config: JobConfig, dims: ParallelDims) -> None:
    v, t = job_config.validation, job_config.training
    if not v.enable:
        return
    try:
        check_dataset_config(v.dataset, v.dataset_path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("training.", "validation.")) from e
    seq_len, batch = v.seq_len or t.seq_len, v.local_batch_size or t.local_batch_size
    if seq_len > t.seq_len:
        raise ConfigError(
            f"validation.seq_len: {seq_len} is longer than training.seq_len ({t.seq_len}), the "
            "model's rotary table; use at most that"
        )
    fixed = [f"{n}={d}" for n, d in (("pp", dims.pp), ("cp", dims.cp)) if d > 1]
    if fixed and (seq_len, batch) != (t.seq_len, t.local_batch_size):
        raise ConfigError(
            f"validation.seq_len / local_batch_size: with {' '.join(fixed)} validation batches "
            f"must have the training shape ({t.local_batch_size} x {t.seq_len}); leave both 0"
        )


def _check_sequence_split(dims: ParallelDims, seq_len: int) -> None:
    """Context parallel cuts each sequence into 2 x cp chunks; sequence parallel then splits a
    rank's part over the TP ranks."""
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        raise ConfigError(
            f"training.seq_len: {seq_len} must be divisible by 2 x "
            f"parallelism.context_parallel_degree = {2 * dims.cp} (each rank holds two chunks)"
        )
    if dims.tp > 1 and (seq_len // dims.cp) % dims.tp:
        raise ConfigError(
            f"training.seq_len: {seq_len} / context_parallel_degree {dims.cp} = "
            f"{seq_len // dims.cp} tokens per rank must be divisible by "
            f"parallelism.tensor_parallel_degree = {dims.tp} (sequence parallel splits them)"
        )


def _check_device_features(job_config: JobConfig, device_type: str) -> None:
    """Features that need CUDA GPUs fail here, on a CPU machine, with the key that asked for them."""
    p = job_config.parallelism
    tp = p.tensor_parallel_degree
    check_converters(job_config, device_type, tp)
    _check_norm_type(job_config.model.norm_type, device_type)
    if job_config.parallelism.enable_async_tensor_parallel:
        key = "parallelism.enable_async_tensor_parallel"
        if device_type != "cuda":
            raise ConfigError(
                f"{key}: async tensor parallel needs CUDA GPUs (symmetric memory); set it false on CPU"
            )
        if tp == 1 or not job_config.compile.compiles("model"):
            raise ConfigError(
                f"{key}: needs parallelism.tensor_parallel_degree > 1 and compiled blocks "
                f"(compile.enable = true, 'model' in compile.components); got tp={tp}, "
                f"compile.enable={job_config.compile.enable}, "
                f"compile.components={job_config.compile.components}"
            )


def _check_norm_type(norm_type: str, device_type: str) -> None:
    """fused_rmsnorm is a Triton kernel: CUDA only. It works with tensor parallel (sequence
    parallel norms run it on each rank's local rows), so the layout is not restricted."""
    if norm_type != "fused_rmsnorm":
        return
    key = "model.norm_type"
    if device_type != "cuda":
        raise ConfigError(
            f"{key}: fused_rmsnorm needs a CUDA GPU (Triton); use rmsnorm or compiled_rmsnorm "
            f"on {device_type}"
        )
    # Only where the kernel will really run: a memory estimate for a CUDA target may be made on a
    # machine without GPU or triton.
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            f"{key}: fused_rmsnorm needs the triton package, which is not installed: "
            "pip install triton, or use rmsnorm or compiled_rmsnorm"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size = int(argv[1])
        argv = argv[2:]
    if "-h" in argv or "--help" in argv:
        return 0  # train.py prints the help itself
    try:
        job_config = parse_args(argv)
        plan = check(job_config, world_size)
        plan.spec.build_tokenizer_fn(job_config.model.tokenizer_path)
    except TorchTitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
