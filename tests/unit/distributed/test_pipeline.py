"""Pipeline parallelism, in-process: the stage split and its validation. Exact gradients of every
schedule (tests/helpers/pp_worker.py in 2 processes) and train.py runs in 2 and 4 CPU processes
are in tests/e2e/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from repo_paths import DEBUG_TOML, TOKENIZER

from torchtitan.config.parse import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.param_init import layout_invariant_init
from torchtitan.distributed.pipeline import (
    PipelinePlan,
    split_layers,
    split_model,
)
from torchtitan.errors import ConfigError
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.train.plan import pipeline_plan, plan_job

DEBUG_ARGS = ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2256)


def _job(*args: str):
    return parse_args(["--job.config_file", DEBUG_TOML, "--model.tokenizer_path", TOKENIZER, *args])


def _dims(pp: int = 2, dp_replicate: int = 1, dp_shard: int = 1) -> ParallelDims:
    world = pp * dp_replicate * dp_shard
    return ParallelDims(dp_replicate, dp_shard, cp=1, tp=1, pp=pp, world_size=world)


def _plan(*args: str, pp: int = 2, model_args: ModelArgs = DEBUG_ARGS) -> PipelinePlan:
    return pipeline_plan(_job(*args), model_args, _dims(pp))


def test_split_layers_even_then_extra_layers_first():
    assert split_layers(6, 2) == ((0, 1, 2), (3, 4, 5))
    assert split_layers(7, 3) == ((0, 1, 2), (3, 4), (5, 6))
    assert split_layers(6, 4) == ((0, 1), (2, 3), (4,), (5,))


def test_split_layers_counts_embedding_and_output_as_upstream_does():
    # 6 blocks + 1 (embedding) + 1 (norm + output) = 8 counted layers
    assert split_layers(6, 2, 1, 1) == ((0, 1, 2), (3, 4, 5))
    assert split_layers(6, 4, 1, 1) == ((0,), (1, 2), (3, 4), (5,))
    # 8 stages of one: the first holds only the embedding, the last only norm + output
    assert split_layers(6, 8, 1, 1) == ((), (0,), (1,), (2,), (3,), (4,), (5,), ())
    assert split_layers(7, 3, 1, 1) == ((0, 1), (2, 3, 4), (5, 6))
    assert split_layers(32, 4, 1, 1) == (
        tuple(range(8)),
        tuple(range(8, 17)),
        tuple(range(17, 25)),
        tuple(range(25, 32)),
    )
    assert split_layers(6, 1, 1, 1) == (tuple(range(6)),)
    with pytest.raises(ValueError):
        split_layers(6, 4, 3, 0)  # a stage holds 2 counted layers, the embedding counts as 3


@pytest.mark.parametrize(
    "schedule, pp, layers_per_stage, stages_per_rank",
    [
        ("1F1B", 2, None, [[0], [1]]),
        ("gpipe", 3, None, [[0], [1], [2]]),
        ("GPipe", 2, 4, [[0], [1]]),  # upstream's pp_dp_1f1b: ceil(8 / 4) = 2 stages
        ("Interleaved1F1B", 2, None, [[0, 2], [1, 3]]),
        ("Interleaved1F1B", 4, None, [[0, 4], [1, 5], [2, 6], [3, 7]]),  # upstream's PP 4 case
        ("interleaved1f1b", 2, 1, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("LoopedBFS", 2, 2, [[0, 2], [1, 3]]),
        ("InterleavedZeroBubble", 4, None, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("ZBVZeroBubble", 2, None, [[0, 3], [1, 2]]),
        ("DualPipeV", 4, 1, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_stages_per_rank(schedule, pp, layers_per_stage, stages_per_rank):
    args = ["--parallelism.pipeline_parallel_schedule", schedule]
    if layers_per_stage is not None:
        args += ["--parallelism.pipeline_parallel_layers_per_stage", str(layers_per_stage)]
    plan = _plan(*args, pp=pp)
    assert plan.schedule.lower() == schedule.lower()
    assert [plan.stages_of(r) for r in range(pp)] == stages_per_rank
    assert sum(len(layers) for layers in plan.stage_layers) == 6
    assert all(plan.stage_rank(s) == r for r, ss in enumerate(stages_per_rank) for s in ss)


def test_plan_layout_microbatches_and_log_line():
    plan = _plan(
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    )
    assert plan.stage_layers == ((0,), (1, 2), (3, 4), (5,))
    assert (plan.microbatch_size, plan.n_microbatches) == (2, 4)
    text = plan.describe()
    assert text.startswith("Pipeline schedule Interleaved1F1B: 4 stages on pp=2 ranks")
    assert "stage 0 (pp rank 0): tok_embeddings + layer 0;" in text
    assert "stage 3 (pp rank 1): layer 5 + norm + output" in text
    # without counting the embedding and the output (0, 0): the blocks alone split evenly
    even = _plan(
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        f"--{_KEY}first_stage_less_layers",
        "0",
        f"--{_KEY}last_stage_less_layers",
        "0",
    )
    assert even.stage_layers == ((0, 1), (2, 3), (4,), (5,))


def test_upstream_pp4_interleaved_split_has_embedding_and_output_only_stages():
    plan = _plan("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", pp=4)
    assert plan.stage_layers == ((), (0,), (1,), (2,), (3,), (4,), (5,), ())
    text = plan.describe()
    assert "stage 0 (pp rank 0): tok_embeddings;" in text
    assert text.endswith("stage 7 (pp rank 3): norm + output")


_KEY = "parallelism.pipeline_parallel_"


@pytest.mark.parametrize(
    "args, dims, expected",
    [
        (
            [f"--{_KEY}schedule", "ZigZag"],
            {},
            f"{_KEY}schedule: unknown schedule 'ZigZag'; valid: GPipe, 1F1B, Interleaved1F1B",
        ),
        (
            [f"--{_KEY}layers_per_stage", "3"],
            {},
            f"{_KEY}layers_per_stage: 3 makes 3 stages of the model's 8 layers as stages count "
            "them (6 + 1 for the embedding + 1 for norm + output), but the 1F1B schedule runs "
            "exactly one stage per rank on pipeline_parallel_degree=2 ranks (2 stages); use 4",
        ),
        (
            [f"--{_KEY}layers_per_stage", "3", f"--{_KEY}schedule", "Interleaved1F1B"],
            {},
            "the Interleaved1F1B schedule runs stages per rank on pipeline_parallel_degree=2 "
            "ranks (4 stages); use a size that gives a multiple of it",
        ),
        (
            [f"--{_KEY}layers_per_stage", "1"],
            {},
            f"{_KEY}layers_per_stage: 1 makes 8 stages of the model's 8 layers",
        ),
        (
            [f"--{_KEY}layers_per_stage", "1", f"--{_KEY}schedule", "ZBVZeroBubble"],
            {},
            "the ZBVZeroBubble schedule runs exactly two stages per rank on "
            "pipeline_parallel_degree=2 ranks (4 stages); use 2",
        ),
        (
            [f"--{_KEY}schedule", "Interleaved1F1B"],
            {"pp": 5},
            f"{_KEY}degree: 5 with the Interleaved1F1B schedule needs 10 stages (2 per rank), "
            "more than the model's 8 layers as stages count them (6 + 1 for the embedding + 1 "
            "for norm + output)",
        ),
        (
            [f"--{_KEY}schedule", "Interleaved1F1B", f"--{_KEY}first_stage_less_layers", "3"],
            {},
            f"{_KEY}first_stage_less_layers: 3 is more than the 2 counted layers each of the 4 "
            "stages holds; use at most 2",
        ),
        (
            [f"--{_KEY}schedule", "PipelineScheduleMulti"],
            {},
            f"{_KEY}schedule: PipelineScheduleMulti runs the order of a CSV file; set "
            f"{_KEY}schedule_csv",
        ),
        (
            [f"--{_KEY}microbatch_size", "3"],
            {},
            f"training.local_batch_size: 8 is not divisible by {_KEY}microbatch_size=3",
        ),
        (
            [f"--{_KEY}microbatch_size", "8"],
            {},
            f"{_KEY}microbatch_size: 8 cuts training.local_batch_size=8 into 1 micro-batches, "
            "but the 1F1B schedule needs at least one per stage (2)",
        ),
        (
            [f"--{_KEY}schedule", "DualPipeV", "--training.local_batch_size", "2"],
            {},
            "the DualPipeV schedule needs at least one per stage (4)",
        ),
        (
            [f"--{_KEY}schedule", "Interleaved1F1B", "--training.local_batch_size", "5"],
            {},
            "into 5 micro-batches, but the Interleaved1F1B schedule needs a count of at most",
        ),
        (
            [f"--{_KEY}schedule", "InterleavedZeroBubble", "--compile.enable"],
            {},
            "InterleavedZeroBubble splits backward into input and weight parts, which "
            "torch.compile does not support",
        ),
        (
            [
                f"--{_KEY}schedule",
                "ZBVZeroBubble",
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "op",
            ],
            {},
            "per-op selective activation checkpointing cannot replay twice",
        ),
    ],
)
def test_pipeline_config_errors(args, dims, expected):
    with pytest.raises(ConfigError) as e:
        pipeline_plan(_job(*args), DEBUG_ARGS, _dims(**dims))
    assert expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_tied_embeddings_cannot_be_split():
    job = _job("--model.flavor", "1B", "--parallelism.pipeline_parallel_degree", "2")
    with pytest.raises(ConfigError, match=r"llama3 1B ties its input and output embeddings"):
        plan_job(job, world_size=2)


def test_preflight_plans_the_pipeline():
    plan = plan_job(_job("--parallelism.pipeline_parallel_degree", "2"), world_size=4)
    assert plan.dims.pp == 2 and plan.dims.dp_shard == 2
    assert plan.pipeline is not None and plan.pipeline.num_stages == 2
    assert plan_job(_job(), world_size=2).pipeline is None
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage: 3 makes 3 stages"):
        plan_job(
            _job(
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "3",
            ),
            world_size=2,
        )


def _materialize(model: torch.nn.Module) -> torch.nn.Module:
    model.to_empty(device="cpu")
    with torch.no_grad(), layout_invariant_init(model, 3):
        model.init_weights()
    return model


@pytest.mark.parametrize(
    "schedule, pp", [("1F1B", 2), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("LoopedBFS", 4)]
)
def test_stages_keep_names_weights_and_compose_to_the_full_model(schedule, pp):
    args = ModelArgs(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    plan = _plan("--parallelism.pipeline_parallel_schedule", schedule, model_args=args, pp=pp)
    with torch.device("meta"):
        full = Transformer(args)
    stages = {}
    for rank in range(plan.pp):
        stages.update(split_model(full, plan, rank))
    assert sorted(stages) == list(range(plan.num_stages))
    names = [n for s in stages.values() for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())  # all, once each
    full = _materialize(full)
    reference = dict(full.named_parameters())
    for index, stage in stages.items():
        assert (stage.tok_embeddings is not None) == (index == 0)
        assert (stage.output is not None) == (index == plan.num_stages - 1)
        assert list(stage.layers) == [str(i) for i in plan.stage_layers[index]]
        for name, param in _materialize(stage).named_parameters():
            assert torch.equal(param, reference[name]), name
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = tokens
        for index in range(plan.num_stages):
            h = stages[index](h)
        torch.testing.assert_close(h, full(tokens))
