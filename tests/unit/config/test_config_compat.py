"""Coming over from upstream: old key names, hints, every problem at once, the check's own options.

No processes: the parser, ``preflight.main`` and the migration script are called in-process.
"""

from __future__ import annotations

import importlib.util
import sys
import typing
from pathlib import Path

import pytest
from repo_paths import ROOT, TOKENIZER
from sized_tokenizers import llama3_sized_tiktoken

from torchtitan.config import compat as config_aliases
from torchtitan.config.compat import ALIASES
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import all_keys, strip_optional
from torchtitan.errors import ConfigError
from torchtitan.train import plan as job_plan
from torchtitan.train import preflight

sys.path.insert(0, str(ROOT / "scripts"))

# A valid value for old keys whose type alone does not give one.
SAMPLES = {
    "training.data_parallel_degree": -1,
    "training.data_parallel_shard_degree": -1,
    "experimental.data_parallel_shard_degree": -1,
    "training.warmup_pct": 0.25,
    "training.fp8_linear": "dynamic",
    "training.fp8_linear_type": "dynamic",
    "training.checkpoint_folder": "ckpt",
    "training.checkpoint_interval_type": "seconds",
    "training.fsdp_reshard_after_forward": "never",
    "experimental.fsdp_reshard_after_forward": "never",
    "training.pipeline_parallel_schedule": "GPipe",
    "experimental.pipeline_parallel_schedule": "interleaved_1f1b",
    "training.pipeline_parallel_split_points": ["layers.2"],
    "experimental.pipeline_parallel_split_points": ["layers.2"],
    "experimental.pipeline_parallel_microbatches": 4,
    "parallelism.pipeline_parallel_microbatches": 4,
    "experimental.custom_model_path": "json",
    "experimental.custom_import": "json",
    "experimental.custom_args_module": None,  # needs a module with a JobConfig: tested below
    "parallelism.module_fqns_per_model_part": [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ],
    "quantize.linear.float8.recipe_name": "rowwise",
    "quantize.linear.float8.filter_fqns": ["output", "layers.0.attention.wq"],
    "training.enable_async_tensor_parallel": False,
    "experimental.enable_async_tensor_parallel": False,
    "training.enable_fsdp_fp8_all_gather": False,
    "training.enable_fsdp_float8_all_gather": False,
    "quantize.linear.float8.enable_fsdp_float8_all_gather": False,
    "training.precompute_float8_dynamic_scale_for_fsdp": False,
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": False,
    "training.enable_float8_linear": True,
    "float8.enable_float8_linear": True,
}


def _sample(old: str, alias: config_aliases.Alias):
    if old in SAMPLES:
        return SAMPLES[old]
    if alias.only is not None:
        return alias.only[0]
    tp = alias.old_type or all_keys()[alias.new]
    base = strip_optional(tp)[0]
    if base is list:
        return ["layers.0.moe"]
    if base is bool:
        return True
    if base is int:
        return 2
    if base is float:
        return 0.5
    if typing.get_origin(base) is list:
        return ["output"]
    return "steps"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _file(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    line = f'tokenizer_path = "{TOKENIZER}"\n'
    if "[model]\n" in text:
        path.write_text(text.replace("[model]\n", "[model]\n" + line, 1))
    else:
        path.write_text(text + "\n[model]\n" + line)
    return str(path)


def _get(cfg, dotted: str):
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize(
    "old", [k for k, a in ALIASES.items() if SAMPLES.get(k, 0) is not None and a.only != ()]
)
def test_every_old_key_loads_and_warns_once_naming_the_new_key(tmp_path, old):
    alias = ALIASES[old]
    value = _sample(old, alias)
    section, key = old.rsplit(".", 1)
    text = (
        f"[training]\nsteps = 20\nlocal_batch_size = 8\n[{section}]\n{key} = {_toml_value(value)}\n"
    )
    if section == "training":
        text = f"[{section}]\n{key} = {_toml_value(value)}\n[lr_scheduler]\nwarmup_steps = 2\n"
    if old == "training.deterministic":
        text += "[debug]\nseed = 1\n"
    path = _file(tmp_path, text)
    cfg = parse_args(["--job.config_file", path])
    mine = [w for w in cfg.warnings if f": {old}:" in w and "' is now '" not in w]
    assert len(mine) == 1, cfg.warnings
    if alias.new is None:
        assert "no effect" in mine[0] or "ignored" in mine[0]
        return
    assert f"old name of {alias.new}" in mine[0] and "migrate_config.py" in mine[0]
    if alias.convert is None and alias.compute is None and old not in SAMPLES:
        assert _get(cfg, alias.new) == value  # a plain rename carries the value over
    # the same key on the command line works too, and says to write the current name
    if not isinstance(value, list):
        raw = _toml_value(value).strip('"')
        cfg = parse_args(["--job.config_file", path, f"--{old}={raw}"])
        assert any(f"write --{alias.new} instead" in w for w in cfg.warnings)


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("[training]\nbatch_size = 3\n", "training.local_batch_size", 3),
        ("[training]\ncompile = true\n", "compile.enable", True),
        ("[training]\nwarmup_steps = 7\n", "lr_scheduler.warmup_steps", 7),
        ("[training]\nsteps = 40\nwarmup_pct = 0.25\n", "lr_scheduler.warmup_steps", 10),
        ("[lr_scheduler]\nlr_min = 0.1\n", "lr_scheduler.min_lr_factor", 0.1),
        ("[job]\nprint_args = true\n", "job.print_config", True),
        ("[metrics]\nenable_color_printing = true\n", "metrics.disable_color_printing", False),
        ("[metrics]\nenable_color_printing = false\n", "metrics.disable_color_printing", True),
        ("[metrics]\nrank_0_only = false\n", "metrics.save_for_all_ranks", True),
        ("[training]\nenable_loss_parallel = false\n", "parallelism.disable_loss_parallel", True),
        ("[training]\ndata_parallel_degree = 2\n", "parallelism.data_parallel_shard_degree", 2),
        ("[training]\nsequence_parallel_degree = 2\n", "parallelism.tensor_parallel_degree", 2),
        ("[experimental]\ncontext_parallel_degree = 2\n", "parallelism.context_parallel_degree", 2),
        ("[checkpoint]\nenable_checkpoint = true\n", "checkpoint.enable", True),
        ("[checkpoint]\ninterval_type = 'seconds'\n", "checkpoint.interval_type", "seconds"),
        ("[checkpoint]\nmodel_weights_only = true\n", "checkpoint.last_save_model_only", True),
        ("[training]\ncheckpoint_folder = 'c'\n", "checkpoint.enable", True),
        ("[training]\ncheckpoint_folder = 'c'\n", "checkpoint.folder", "c"),
        ("[training]\ncheckpoint_folder = ''\n", "checkpoint.enable", False),
        ("[training]\nfp8_linear = 'dynamic'\n", "model.converters", ["float8"]),
        ("[training]\nfp8_linear = ''\n", "model.converters", []),
        ("[float8]\nenable_float8_linear = true\n", "model.converters", ["float8"]),
        ("[model]\nconverters = ['quantize.linear.float8']\n", "model.converters", ["float8"]),
        ("[model]\nname = 'llama'\nflavor = '7B'\n", "model.name", "llama2"),
        ("[quantize.linear.float8]\nrecipe_name = 'rowwise'\n", "float8.recipe_name", "rowwise"),
        ("[optimizer]\nfused = false\n", "optimizer.implementation", "foreach"),
        ("[training]\nenable_selective_ac = true\n", "activation_checkpoint.mode", "selective"),
        ("[profiling]\nprofile_every_x_iter = 5\n", "profiling.profile_freq", 5),
        ("[profiling]\nrun_profiler = true\n", "profiling.enable_profiling", True),
        ("[training]\nseed = 3\n", "debug.seed", 3),
        ("[validation]\nenabled = false\n", "validation.enable", False),
        (
            "[training]\nlocal_batch_size = 8\n[experimental]\npipeline_parallel_microbatches = 4\n",
            "parallelism.pipeline_parallel_microbatch_size",
            2,
        ),
        (
            "[experimental]\npipeline_parallel_schedule = 'interleaved_1f1b'\n",
            "parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ),
    ],
)
def test_old_values_arrive_converted(tmp_path, text, key, expected):
    cfg = parse_args(["--job.config_file", _file(tmp_path, text)])
    assert _get(cfg, key) == expected


def test_precedence_holds_through_aliases(tmp_path):
    path = _file(tmp_path, "[training]\nbatch_size = 3\nsteps = 40\nwarmup_pct = 0.5\n")
    cfg = parse_args(["--job.config_file", path, "--training.local_batch_size", "5"])
    assert cfg.training.local_batch_size == 5  # the command line beats the file's old name
    assert cfg.lr_scheduler.warmup_steps == 20
    cfg = parse_args(["--job.config_file", path, "--lr_scheduler.warmup_steps", "4"])
    assert cfg.lr_scheduler.warmup_steps == 4  # a computed alias yields to a later current key


def test_refused_values_of_features_not_built_say_why(tmp_path):
    path = _file(
        tmp_path,
        "[parallelism]\nexpert_parallel_comm_backend = 'deepep'\n"
        "[training]\nenable_cpu_offload = true\nfp8_linear = 'delayed'\n",
    )
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", path])
    lines = str(e.value).splitlines()
    assert len(lines) == 3
    assert f"{path}: parallelism.expert_parallel_comm_backend: 'deepep': DeepEP " in lines[0]
    assert lines[0].endswith("all-to-all is 'standard'")
    assert "training.enable_cpu_offload: True: FSDP CPU offload is not supported" in lines[1]
    assert "training.fp8_linear: 'delayed': 2024's fp8_linear takes" in lines[2]


@pytest.mark.parametrize(
    ("written", "hint"),
    [
        ("training.stepz", "training.steps"),
        ("training.warmup_step", "lr_scheduler.warmup_steps"),
        ("checkpoint.enable_checkpoints", "checkpoint.enable"),
        ("training.compiled", "compile.enable"),
        ("training.enable_tensorboard", "metrics.enable_tensorboard"),
        ("training.tensor_parallel_degre", "parallelism.tensor_parallel_degree"),
        ("metrics.disable_colour_printing", "metrics.disable_color_printing"),
        # an old name whose value is negated is offered as itself, never as its opposite
        ("metrics.enable_colour_printing", "metrics.enable_color_printing"),
        ("job.print_arg", "job.print_config"),
    ],
)
def test_hints_look_across_sections_and_old_names(tmp_path, written, hint):
    section, key = written.split(".")
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", _file(tmp_path, f"[{section}]\n{key} = 1\n")])
    assert f"did you mean '{hint}'?" in str(e.value)


@pytest.mark.parametrize(
    ("written", "never"),
    [
        ("lr_scheduler.max_lr_factor", "min_lr_factor"),
        ("checkpoint.enable_checkpointing_now", "create_seed_checkpoint"),
        ("training.warmup", "training.steps"),
        ("metrics.enable_colour_printing", "disable_color_printing"),
        ("training.compile_model", "seq_len"),
    ],
)
def test_hints_never_offer_a_key_of_other_or_opposite_meaning(tmp_path, written, never):
    section, key = written.split(".")
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", _file(tmp_path, f"[{section}]\n{key} = 1\n")])
    assert never not in str(e.value)


def test_unknown_section_gets_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", _file(tmp_path, "[trainnig]\nsteps = 1\nseq_len = 2\n")])
    assert str(e.value).splitlines() == [
        f"{tmp_path / 'job.toml'}: unknown section [trainnig]; did you mean [training]?"
    ]


def _preflight(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    rc = preflight.main(list(args))
    err = capsys.readouterr().err.splitlines()
    return rc, [e for e in err if e.startswith("error: ")], [e for e in err if e.startswith("warn")]


def test_every_problem_in_one_run_one_line_each(tmp_path, capsys):
    path = _file(
        tmp_path,
        "[training]\nstepz = 10\nsteps = 'ten'\nlocal_batch_size = 0\ndataset = 'c4_test'\n"
        "[optimizer]\nname = 'SGD'\n[checkpoint]\nenable_checkpoint = 'yes'\n",
    )
    rc, errors, _ = _preflight(
        capsys,
        "--job.config_file",
        path,
        "--parallelism.tensor_parallel_degree=3",
        "--job.dump_folder",
        "/proc/torchtitan-cannot-write",
    )
    assert rc == 2
    want = [
        f"{path}: training.stepz: unknown key; did you mean 'training.steps'?",
        f"{path}: training.steps: 'ten' is not a valid int",
        f"{path}: checkpoint.enable_checkpoint: 'yes' is not a valid bool",
        f"{path}: optimizer.name: 'SGD' is not one of: AdamW, Adam",
        f"{path}: training.local_batch_size: 0 must be >= 1",
        "command line: --job.dump_folder: '/proc/torchtitan-cannot-write' cannot be created",
        "command line: --parallelism.tensor_parallel_degree: 3 does not divide the world size 1",
        f"{path}: training.dataset: 'c4_test' is upstream's in-repo",
    ]
    for line in want:
        assert sum(e.startswith(f"error: {line}") for e in errors) == 1, (line, errors)
    assert len(errors) == len(want)


def test_layout_errors_name_the_degree_the_user_typed(capsys):
    rc, errors, _ = _preflight(capsys, "--parallelism.pipeline_parallel_degree", "64")
    assert rc == 2 and errors == [
        "error: command line: --parallelism.pipeline_parallel_degree: 64 does not divide the "
        "world size 1 (data_parallel_shard_degree -1 takes the rest); use degrees whose product "
        "divides 1"
    ]
    rc, errors, _ = _preflight(
        capsys,
        "--world-size",
        "4",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "4",
    )
    assert rc == 2 and len(errors) == 1
    assert errors[0].startswith("error: command line: --parallelism.data_parallel_shard_degree: ")
    assert "tensor_parallel_degree=2 = 8, but the world size is 4" in errors[0]


def test_an_alias_set_key_is_named_as_written(tmp_path, capsys):
    path = _file(tmp_path, "[training]\nbatch_size = 0\n")
    rc, errors, _ = _preflight(capsys, "--job.config_file", path)
    assert errors == [
        f"error: {path}: training.batch_size (now training.local_batch_size): 0 must be >= 1"
    ]


def test_a_published_flavor_refuses_a_tokenizer_of_another_size(tmp_path, capsys):
    rc, errors, _ = _preflight(capsys, "--model.flavor", "8B")
    assert rc == 2 and errors == [
        "error: model.tokenizer_path (default): the tokenizer 'tests/assets/tokenizer/"
        "tiktoken.model' has 2,256 tokens, but llama3 8B has a vocabulary of 128,256; use the "
        "model's own tokenizer, or set model.vocab_size_from_tokenizer = true to size the "
        "embedding from this one"
    ]
    assert _preflight(capsys, "--model.flavor", "8B", "--model.vocab_size_from_tokenizer")[0] == 0
    assert _preflight(capsys, "--model.flavor", "debugmodel")[0] == 0  # sized by its tokenizer
    sized = llama3_sized_tiktoken(tmp_path / "tokenizer.model")
    assert _preflight(capsys, "--model.flavor", "8B", "--model.tokenizer_path", str(sized))[0] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--model.norm_type", "fused_rmsnorm"],
        [
            "--parallelism.enable_async_tensor_parallel",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--compile.enable",
        ],
    ],
)
def test_device_type_cuda_judges_gpu_features_as_on_a_gpu(capsys, args):
    args = ["--world-size", "2", *args] if "2" in args else args
    rc, errors, _ = _preflight(capsys, *args)
    assert rc == 2 and "CUDA" in errors[0]  # this machine has no GPU
    # judged as on a GPU; the config is the question here, not the step's memory
    rc, errors, _ = _preflight(capsys, "--device-type", "cuda", "--memory-check", "floor", *args)
    assert (rc, errors) == (0, [])


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_device_type_cuda_accepts_float8_without_a_gpu(capsys):
    args = ["--device-type", "cuda", "--memory-check", "floor", "--model.converters", "float8"]
    assert _preflight(capsys, *args)[0] == 0


def test_dump_folder_that_cannot_be_written_is_one_line(capsys):
    rc, errors, _ = _preflight(capsys, "--job.dump_folder", "/proc/nope/out")
    assert rc == 2 and len(errors) == 1 and "job.dump_folder: '/proc/nope/out' cannot" in errors[0]


def test_custom_config_module_adds_sections_and_keys(tmp_path):
    module = tmp_path / "my_config.py"
    module.write_text(
        "from dataclasses import dataclass, field\n\n"
        "@dataclass\nclass Extra:\n    alpha: float = 0.5\n\n"
        "@dataclass\nclass Training:\n    my_flag: bool = False\n\n"
        "@dataclass\nclass JobConfig:\n"
        "    extra: Extra = field(default_factory=Extra)\n"
        "    training: Training = field(default_factory=Training)\n"
    )
    path = _file(tmp_path, f"[job]\ncustom_config_module = '{module}'\n[extra]\nalpha = 2.0\n")
    cfg = parse_args(["--job.config_file", path, "--training.my_flag", "--training.steps", "3"])
    assert cfg.extra.alpha == 2.0 and cfg.training.my_flag is True and cfg.training.steps == 3
    old = _file(tmp_path, f"[experimental]\ncustom_args_module = '{module}'\n[extra]\nalpha = 1\n")
    assert parse_args(["--job.config_file", old]).extra.alpha == 1.0


def test_custom_import_is_imported_by_the_check(tmp_path, capsys):
    module = tmp_path / "my_model.py"
    module.write_text("import os\nos.environ['TORCHTITAN_TEST_IMPORTED'] = '1'\n")
    assert _preflight(capsys, "--job.custom_import", str(module))[0] == 0
    import os

    assert os.environ.pop("TORCHTITAN_TEST_IMPORTED") == "1"
    rc, errors, _ = _preflight(capsys, "--job.custom_import", "no_such_module_xyz")
    assert rc == 2 and "job.custom_import: cannot import 'no_such_module_xyz'" in errors[0]


@pytest.mark.parametrize(
    ("points", "stages", "schedule", "pp"),
    [
        ("layers.1,layers.4", ((0,), (1, 2, 3), (4, 5)), "GPipe", 3),
        ("layers.2,layers.3,layers.5", ((0, 1), (2,), (3, 4), (5,)), "Interleaved1F1B", 2),
    ],
)
def test_pipeline_split_points_set_the_stages(points, stages, schedule, pp):
    cfg = parse_args(
        [
            "--model.n_layers",
            "6",
            "--parallelism.pipeline_parallel_split_points",
            points,
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            str(pp),
        ]
    )
    plan = job_plan.plan_job(cfg, world_size=pp)
    assert plan.pipeline.stage_layers == stages


def test_pipeline_split_points_that_do_not_fit_the_schedule_are_refused():
    cfg = parse_args(
        [
            "--model.n_layers",
            "6",
            "--parallelism.pipeline_parallel_split_points",
            "layers.2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ]
    )
    with pytest.raises(ConfigError) as e:
        job_plan.plan_job(cfg, world_size=2)
    assert "1 split points make 2 stages" in str(e.value) and "a multiple of 2" in str(e.value)
