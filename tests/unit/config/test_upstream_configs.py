"""Upstream-era train configs pass the check unedited, and migrate to files that load silently.

The files in tests/assets/upstream_configs/ hold the keys and values upstream torchtitan's
configs used in 2024 and 2025 (see the README there). Only their paths are pointed at local files,
on the command line, as a user with the real tokenizer and data would have them.
"""

from __future__ import annotations

import sys

import pytest
from repo_paths import ROOT, TOKENIZER, UPSTREAM
from sized_tokenizers import (
    LLAMA3_VOCAB,
    LLAMA4_VOCAB,
    hf_assets_folder,
    llama2_sized_sentencepiece,
    llama3_sized_tiktoken,
    llama4_sized_tiktoken,
)

from torchtitan.config.parse import parse_args
from torchtitan.data.tokenizer import LLAMA4_SPLIT_PATTERN, build_tokenizer
from torchtitan.errors import ConfigError, Problems
from torchtitan.train import preflight
from torchtitan.train.plan import plan_job

sys.path.insert(0, str(ROOT / "scripts"))

from migrate_config import migrate  # noqa: E402


@pytest.fixture(scope="module")
def local_paths(tmp_path_factory) -> dict[str, list[str]]:
    """Per config: the command-line overrides that point its paths at local files."""
    tmp = tmp_path_factory.mktemp("upstream")
    data = tmp / "data.jsonl"
    data.write_text('{"text": "a local copy of a few documents"}\n' * 4)
    llama3 = str(llama3_sized_tiktoken(tmp / "llama3.model"))
    llama3_hf = str(hf_assets_folder(tmp / "Llama-3.1-8B", LLAMA3_VOCAB))
    out = ["--job.dump_folder", str(tmp / "out")]
    llama4 = str(llama4_sized_tiktoken(tmp / "llama4.model"))
    return {
        "llama4_17bx16e_2025": [*out, "--model.tokenizer_path", llama4],
        "llama3_8b_2024": [*out, "--model.tokenizer_path", llama3],
        "llama3_8b_2024_late": [*out, "--model.tokenizer_path", llama3],
        "llama3_8b_2025_mid": [*out, "--model.tokenizer_path", llama3_hf],
        "llama3_8b_2025_late": [*out, "--model.hf_assets_path", llama3_hf],
        "llama2_7b_2024": [
            *out,
            "--model.tokenizer_path",
            str(llama2_sized_sentencepiece(tmp / "llama2.model")),
        ],
        "debug_model_2024": [
            *out,
            "--model.tokenizer_path",
            TOKENIZER,
            "--training.dataset_path",
            str(data),
        ],
        "debug_model_2025": [
            *out,
            "--model.hf_assets_path",
            str(hf_assets_folder(tmp / "debug_hf", 2000)),
            "--training.dataset_path",
            str(data),
        ],
    }


CONFIGS = sorted(p.stem for p in UPSTREAM.glob("*.toml"))


def test_every_upstream_config_is_covered(local_paths):
    assert CONFIGS == sorted(local_paths)


@pytest.mark.parametrize("name", CONFIGS)
def test_upstream_config_passes_the_check_unedited(name, local_paths, capsys):
    # the Llama 2 file asks for the fused RMSNorm kernel: judged as on the GPUs it targets; the
    # Llama 4 file's tensor parallel degree 8 on 8 nodes of 8
    device = {
        "llama2_7b_2024": ["--device-type", "cuda"],
        "llama4_17bx16e_2025": ["--world-size", "64", "--device-type", "cuda"],
    }.get(name, [])
    path = str(UPSTREAM / f"{name}.toml")
    # the config is checked, not the step's memory (traced in tests/unit/train/test_memory_fit.py)
    device += ["--memory-check", "floor"] if device else []
    rc = preflight.main([*device, "--job.config_file", path, *local_paths[name]])
    err = capsys.readouterr().err
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert all(f"warning: {path}: " in w for w in warnings)
    assert len(warnings) == len(set(warnings))  # once each
    if name != "llama3_8b_2025_late":
        assert warnings  # each older file uses at least one old name


@pytest.mark.parametrize("name", CONFIGS)
def test_migrated_config_loads_the_same_settings_without_warnings(name, local_paths, tmp_path):
    old = UPSTREAM / f"{name}.toml"
    text, changes = migrate(old.read_text(), str(old))
    new = tmp_path / f"{name}.toml"
    new.write_text(text)
    args = local_paths[name] + (["--model.norm_type", "rmsnorm"] if "llama2" in name else [])
    before = parse_args(["--job.config_file", str(old), *args])
    after = parse_args(["--job.config_file", str(new), *args])
    assert after.warnings == []
    assert len(changes) == len([w for w in before.warnings])
    strip = {"job": {"config_file"}}
    assert _without(before.to_dict(), strip) == _without(after.to_dict(), strip)
    # comments stay, including the end-of-line comment of a key that moved to another section
    for line in old.read_text().splitlines():
        if line.startswith("#"):
            assert line in text
    if "warmup_steps = 200  # lr scheduler warm up" in old.read_text():
        section = text.split("[lr_scheduler]")[1].split("\n[")[0]
        assert "warmup_steps = 200" in section and "# lr scheduler warm up" in section
    assert migrate(text, str(new))[1] == []  # nothing left to change


def _without(d: dict, strip: dict) -> dict:
    return {
        s: {k: v for k, v in keys.items() if k not in strip.get(s, ())} for s, keys in d.items()
    }


def test_migration_prints_each_change():
    old = UPSTREAM / "llama3_8b_2024.toml"
    _, changes = migrate(old.read_text(), str(old))
    assert f"{old}: training.batch_size = 1 -> training.local_batch_size = 1" in changes
    assert f'{old}: training.fp8_linear = "" -> model.converters = []' in changes
    assert f"{old}: checkpoint.enable_checkpoint = false -> checkpoint.enable = false" in changes
    assert (
        f"{old}: checkpoint.model_weights_only = false -> checkpoint.last_save_model_only = false"
        in changes
    )


# ---- Llama 4 vocabulary: tokenizers of the published size, checked as a CUDA job


@pytest.fixture(scope="module")
def llama4_tokenizers(tmp_path_factory) -> dict[str, str]:
    """Meta's tokenizer.model layout (200,000 ranks) and an HF folder whose tokenizer.json ends
    at id 201,134 (Meta's named special tokens) and whose multimodal config.json gives the
    language model's 202,048 under text_config."""
    tmp = tmp_path_factory.mktemp("llama4")
    return {
        "tiktoken": str(llama4_sized_tiktoken(tmp / "tokenizer.model")),
        "hf": str(hf_assets_folder(tmp / "Llama-4-Scout-17B-16E", 201_135, LLAMA4_VOCAB)),
    }


def test_a_llama4_tiktoken_file_gets_llama4_special_tokens(llama4_tokenizers):
    tok = build_tokenizer(llama4_tokenizers["tiktoken"])
    assert tok.n_words == LLAMA4_VOCAB == 200_000 + 2048
    assert (tok.bos_id, tok.eos_id) == (200_000, 200_001)
    assert tok.split_pattern == LLAMA4_SPLIT_PATTERN
    # Llama 4's split keeps a word's case run with its contraction ("World's"), Llama 3's not
    import regex

    assert regex.findall(LLAMA4_SPLIT_PATTERN, "HelloWorld's") == ["Hello", "World's"]
    assert build_tokenizer(llama4_tokenizers["hf"]).n_words == LLAMA4_VOCAB
    # a Llama 3 file (128,000 ranks) keeps Llama 3's 256
    assert build_tokenizer(TOKENIZER).n_words == 2000 + 256


@pytest.mark.parametrize("kind", ["tiktoken", "hf"])
@pytest.mark.parametrize("config", ["llama4_17bx16e", "llama4_17bx128e"])
def test_llama4_configs_pass_with_tokenizers_of_the_published_size(
    kind, config, llama4_tokenizers, tmp_path, capsys
):
    rc = preflight.main(
        [
            "--world-size",
            "64",
            "--device-type",
            "cuda",
            "--memory-check",  # the config, not the step's memory
            "floor",
            "--job.config_file",
            str(ROOT / "train_configs" / f"{config}.toml"),
            "--model.tokenizer_path",
            llama4_tokenizers[kind],
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    assert rc == 0, capsys.readouterr().err


# ---- upstream names of 2025 and hints


def _parse(*args: str, problems: Problems | None = None):
    return parse_args(["--model.tokenizer_path", TOKENIZER, *args], problems=problems)


def test_upstream_2025_model_and_float8_keys(tmp_path):
    cfg = _parse(
        "--global.dump_folder",
        str(tmp_path),
        "--model.use_flex_attn",
        "true",
        "--float8.moe_fqns",
        "experts",
    )
    assert cfg.job.dump_folder == str(tmp_path)
    assert any(
        "--model.use_flex_attn: no effect here (the attention kernel follows "
        "model.attn_mask_type" in w
        for w in cfg.warnings
    )
    # with the float8 converter, experts that upstream would run in float8 are refused
    problems = Problems()
    _parse("--model.converters", "float8", "--float8.moe_fqns", "experts", problems=problems)
    assert problems.lines == [
        "command line: --float8.moe_fqns: 'experts': float8 grouped matmuls for the routed "
        "experts are not built here (float8 converts nn.Linear layers; the experts run in the "
        "training dtype); leave it empty"
    ]


@pytest.mark.parametrize("flavor", ["debugmodel_flex_attn", "debugmodel_varlen_attn"])
def test_upstream_attention_flavors_are_the_debug_model_with_document_masking(flavor):
    cfg = _parse("--model.flavor", flavor)
    assert (cfg.model.flavor, cfg.model.attn_mask_type) == ("debugmodel", "block_causal")
    assert cfg.warnings == [
        f"command line: --model.flavor: '{flavor}' is upstream's debug model with document "
        "masking; here it is model.flavor = 'debugmodel' with model.attn_mask_type = "
        "'block_causal' (FlexAttention on CUDA, SDPA with a document mask on CPU)"
    ]
    # a mask type given after it (higher precedence) wins
    later = _parse("--model.flavor", flavor, "--model.attn_mask_type", "causal")
    assert later.model.attn_mask_type == "causal"


def test_qwen3_moe_flavor_names_point_at_qwen3_moe(tmp_path, capsys):
    rc = preflight.main(
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel_moe",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: command line: --model.flavor: 'debugmodel_moe' is upstream's qwen3 "
        "mixture-of-experts flavor; here it is model.name = 'qwen3_moe' with model.flavor = "
        "'debugmodel'"
    ]


@pytest.mark.parametrize("origin", ["file", "command line"])
def test_a_micro_batch_count_error_says_where_it_was_set(origin, tmp_path, capsys):
    key = "parallelism.pipeline_parallel_microbatches"
    args = [
        "--world-size",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    ]
    if origin == "file":
        toml = tmp_path / "pp.toml"
        toml.write_text("[parallelism]\npipeline_parallel_microbatches = 3\n")
        args += ["--job.config_file", str(toml)]
        where = f"{toml}: {key}"
    else:
        args += [f"--{key}", "3"]
        where = f"command line: --{key}"
    assert preflight.main(args) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert errors == [
        f"error: {where}: 3 micro-batches must divide training.local_batch_size (8); use a "
        "divisor of 8, or set parallelism.pipeline_parallel_microbatch_size"
    ]


def test_training_dataloader_keys_nest_as_upstream_writes_them(tmp_path):
    toml = tmp_path / "dl.toml"
    toml.write_text("[training.dataloader]\nnum_workers = 2\npin_memory = true\n")
    cfg = _parse("--job.config_file", str(toml), "--training.dataloader.prefetch_factor", "4")
    w = cfg.training.dataloader
    assert (w.num_workers, w.pin_memory, w.prefetch_factor) == (2, True, 4)
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())  # the resolved config reads back the same
    assert _parse("--job.config_file", str(again)).training.dataloader == w
    problems = Problems()
    _parse("--training.dataloader.num_worker", "2", problems=problems)
    assert problems.lines == [
        "command line: --training.dataloader.num_worker: unknown key; did you mean "
        "'training.dataloader.num_workers'?"
    ]


# ---- upstream's integration-test layouts (features.py, early 2026) that are not about GPUs


CSV = str(ROOT / "tests" / "assets" / "pipeline" / "split_backward_pp2.csv")
_PP = "--parallelism.pipeline_parallel_"
FEATURES = {
    "pp_looped_zero_bubble": (4, [f"{_PP}degree", "4", f"{_PP}schedule", "InterleavedZeroBubble"]),
    "pp_dp_1f1b_layers_per_stage_4": (
        4,
        [
            f"{_PP}degree",
            "2",
            f"{_PP}schedule",
            "1F1B",
            f"{_PP}layers_per_stage",
            "4",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    ),
    "pp_looped_1f1b": (4, [f"{_PP}degree", "4", f"{_PP}schedule", "Interleaved1F1B"]),
    "pp_looped_1f1b_layers_per_stage_1": (
        4,
        [f"{_PP}degree", "4", f"{_PP}schedule", "Interleaved1F1B", f"{_PP}layers_per_stage", "1"],
    ),
    "pp_custom_csv": (
        2,
        [
            f"{_PP}degree",
            "2",
            f"{_PP}schedule",
            "PipelineScheduleMulti",
            f"{_PP}schedule_csv",
            CSV,
            f"{_PP}microbatch_size",
            "2",
        ],
    ),
    "fsdp+flex_attn": (
        4,
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=full",
            "--model.flavor=debugmodel_flex_attn",
        ],
    ),
    "fsdp+varlen_attn+per_op_sac": (
        4,
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
            "--model.flavor=debugmodel_varlen_attn",
        ],
    ),
    "opt_in_bwd_tp_cp": (
        4,
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--optimizer.early_step_in_backward",
        ],
    ),
    "dataloader_kwargs": (
        2,
        [
            "--training.dataloader.num_workers",
            "2",
            "--training.dataloader.pin_memory",
            "--training.dataloader.persistent_workers",
            "--training.dataloader.prefetch_factor",
            "4",
        ],
    ),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_upstream_integration_layouts_pass_the_check(case, tmp_path, capsys):
    ngpu, args = FEATURES[case]
    rc = preflight.main(["--world-size", str(ngpu), "--job.dump_folder", str(tmp_path), *args])
    assert rc == 0, capsys.readouterr().err


# ---- optimizer.early_step_in_backward and schedule CSV files: one-line refusals


@pytest.mark.parametrize(
    "world, args, expected",
    [
        (2, [f"{_PP}degree", "2"], "a pipeline stage runs backward once per micro-batch"),
        (
            1,
            ["--training.global_batch_size", "16"],
            "training.global_batch_size 16 takes 2 backward passes",
        ),
        (2, ["--parallelism.data_parallel_replicate_degree", "2"], "DDP (parallelism."),
        (1, ["--optimizer.name", "Muon"], "Muon orthogonalizes whole matrices"),
        (
            1,
            ["--resilience.loss_spike_zscore", "3"],
            "resilience.loss_spike_zscore skips a step's update",
        ),
        (
            1,
            ["--checkpoint.enable", "--checkpoint.async_mode", "async"],
            "checkpoint.async_mode async copies the weights",
        ),
    ],
)
def test_early_step_in_backward_refuses_what_needs_the_whole_step(world, args, expected):
    cfg = _parse("--optimizer.early_step_in_backward", *args)
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=world)
    assert f"optimizer.early_step_in_backward: {expected}" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "rows, expected",
    [
        (["0F0"], "has 1 rows; give one per pipeline rank (2)"),
        (["0F0,0Q1", "1F0"], "row 1 (pp rank 0), entry 2 '0Q1' is not an action"),
        (["0F0x", "1F0"], "entry 1 '0F0x' is not an action"),
        (
            ["0F0,1F0", "1F1"],
            "entry 2 '1F0': stage 1 runs on pp rank 1 in the PipelineScheduleMulti layout",
        ),
        (["0F9", "1F0"], "the plan has stages 0-3 and micro-batches 0-3"),
        (
            ["0F0,0F1,0F2", "1F0"],
            "stage 0 runs forward on micro-batches [0, 1, 2] and backward "
            "(B or I) on [] (W on []); each of 0-3 needs one F and one B",
        ),
        (
            [
                "0B0,0F0,0F1,0F2,0F3,2F0,2F1,2F2,2F3,2B0,2B1,2B2,2B3,0B1,0B2,0B3",
                "1F0,1F1,1F2,1F3,3F0,3F1,3F2,3F3,3B0,3B1,3B2,3B3,1B0,1B1,1B2,1B3",
            ],
            "Running Full Backward for stage 0, microbatch 0 without first running Forward",
        ),
    ],
)
def test_schedule_csv_problems_are_one_line_naming_the_file(rows, expected, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    cfg = _parse(
        f"{_PP}degree",
        "2",
        f"{_PP}schedule",
        "PipelineScheduleMulti",
        f"{_PP}schedule_csv",
        str(path),
        f"{_PP}microbatch_size",
        "2",
    )
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=2)
    assert f"parallelism.pipeline_parallel_schedule_csv: '{path}'" in str(e.value)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
