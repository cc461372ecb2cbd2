"""JobConfig: precedence, CLI forms, help, and every validation error (train.py's own --help and
error lines, from a process, are in tests/e2e/test_config.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from repo_paths import DEBUG_TOML, ROOT, TOKENIZER, TOKENIZER_ASSETS

from torchtitan.config.help import help_text
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.errors import ConfigError


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text + f'\n[model]\ntokenizer_path = "{TOKENIZER}"\n')
    return str(path)


def test_defaults_are_typed_and_documented():
    cfg = parse_args(["--model.tokenizer_path", TOKENIZER])
    assert cfg.training.steps == 10000 and cfg.training.local_batch_size == 8
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.debug.seed is None
    text = help_text()
    for key in (
        "--training.steps",
        "--lr_scheduler.decay_type",
        "--checkpoint.async_mode",
        "--activation_checkpoint.selective_ac_option",
        "--validation.freq",
        "--profiling.profile_freq",
    ):
        assert key in text
    assert "{linear|sqrt|cosine}" in text


def test_precedence_defaults_toml_cli(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.job.config_file == path


def test_cli_forms(tmp_path):
    path = _toml(tmp_path, "")
    cfg = parse_args(
        [
            f"--job.config_file={path}",
            "--training.steps=3",
            "--metrics.enable_tensorboard",
            "--job.print_config=true",
            "--metrics.disable_color_printing",
            "false",
            "--checkpoint.exclude_from_loading",
            "a, b",
            "--optimizer.lr",
            "1e-4",
            "--debug.seed",
            "0",
            "--lr_scheduler.decay_ratio",
            "0.5",
        ]
    )
    assert cfg.training.steps == 3
    assert cfg.metrics.enable_tensorboard is True and cfg.job.print_config is True
    assert cfg.metrics.disable_color_printing is False
    assert cfg.checkpoint.exclude_from_loading == ["a", "b"]
    assert cfg.optimizer.lr == 1e-4 and cfg.debug.seed == 0
    assert cfg.lr_scheduler.decay_ratio == 0.5


def test_list_from_cli_and_toml(tmp_path):
    path = _toml(tmp_path, '[checkpoint]\nexclude_from_loading = ["dataloader", "optimizer"]\n')
    assert parse_args(["--job.config_file", path]).checkpoint.exclude_from_loading == [
        "dataloader",
        "optimizer",
    ]
    cfg = parse_args(
        ["--job.config_file", path, "--checkpoint.exclude_from_loading", "lr_scheduler,dataloader"]
    )
    assert cfg.checkpoint.exclude_from_loading == ["lr_scheduler", "dataloader"]


def test_optional_key_can_be_unset(tmp_path):
    path = _toml(tmp_path, '[training]\ndataset_path = "x"\n')
    assert (
        parse_args(
            ["--job.config_file", path, "--training.dataset_path", "none"]
        ).training.dataset_path
        is None
    )


def test_to_toml_round_trips(tmp_path):
    cfg = parse_args(
        ["--model.tokenizer_path", TOKENIZER, "--training.steps", "5", "--debug.seed", "3"]
    )
    path = tmp_path / "dump.toml"
    path.write_text(cfg.to_toml())
    again = parse_args(["--job.config_file", str(path)])
    again.job.config_file = None
    assert again == cfg


def test_debug_config_parses():
    cfg = parse_args(["--job.config_file", DEBUG_TOML])
    assert cfg.model.flavor == "debugmodel" and cfg.training.dataset == "python_docs"
    assert isinstance(cfg, JobConfig)


@pytest.mark.parametrize(
    "toml, args, expected",
    [
        ("[trainig]\nsteps = 1\n", [], "unknown section [trainig]; did you mean [training]"),
        ("[trainig]\nxyz = 1\n", [], "unknown section [trainig]; did you mean [training]"),
        (
            "[training]\nstep = 1\n",
            [],
            "training.step: unknown key; did you mean 'training.steps'",
        ),
        ("[training]\nsteps = 'ten'\n", [], "training.steps: 'ten' is not a valid int"),
        ("[training]\nsteps = 1.5\n", [], "training.steps: 1.5 is not a valid int"),
        ("[training]\nsteps = true\n", [], "training.steps: True is not a valid int"),
        ("[job]\ndescription = 3\n", [], "job.description: 3 is not a valid str"),
        ("steps = 3\n", [], "'steps' must be in a [section] table"),
        ("", ["--training.steps", "0"], "training.steps: 0 must be >= 1"),
        ("", ["--training.steps", "x"], "training.steps: 'x' is not a valid int"),
        ("", ["--optimizer.lr", "0"], "optimizer.lr: 0.0 must be > 0"),
        (
            "",
            ["--lr_scheduler.decay_type", "exp"],
            "lr_scheduler.decay_type: 'exp' is not one of: linear, sqrt, cosine",
        ),
        (
            "",
            ["--lr_scheduler.min_lr_factor", "1.5"],
            "lr_scheduler.min_lr_factor: 1.5 must be <= 1",
        ),
        ("", ["--debug.seed", str(2**32)], "debug.seed: 4294967296 must be <= 4294967295"),
        ("", ["--debug.seed", "-1"], "debug.seed: -1 must be >= 0"),
        (
            "",
            ["--metrics.enable_tensorboard", "maybe"],
            "command line: unexpected argument 'maybe'",
        ),
        ("", ["--training.steps"], "--training.steps needs a value (int)"),
        ("", ["--training.nope", "1"], "command line: --training.nope: unknown key"),
        ("", ["--steps", "1"], "--steps: not of the form section.key"),
        ("", ["steps"], "unexpected argument 'steps'"),
        ("", ["--debug.deterministic"], "debug.deterministic: needs debug.seed"),
        (
            "",
            ["--training.global_batch_size", "12"],
            "training.global_batch_size: 12 must be a multiple of training.local_batch_size (8)",
        ),
        ("", ["--training.global_batch_size", "0"], "training.global_batch_size: 0 must be -1"),
        (
            "",
            ["--model.tokenizer_path", "/no/such/tok.model"],
            "model.tokenizer_path: '/no/such/tok.model' does not exist",
        ),
        ("", ["--lora.enable"], "lora.enable: needs checkpoint.enable = true"),
        (
            "",
            ["--lora.enable", "--checkpoint.enable"],
            "lora.enable: needs a base model to adapt: checkpoint.initial_load_path",
        ),
        ("", ["--lora.rank", "0"], "lora.rank: 0 must be >= 1"),
        (
            "",
            ["--training.chat_template", "/no/such/chat.jinja"],
            "training.chat_template: '/no/such/chat.jinja' does not exist",
        ),
        (
            "",
            ["--checkpoint.last_save_in_hf"],
            "checkpoint.last_save_in_hf: needs checkpoint.enable = true",
        ),
        (
            "",
            ["--checkpoint.enable", "--checkpoint.initial_load_in_hf"],
            "checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path",
        ),
        (
            "",
            ["--activation_checkpoint.mode", "partial"],
            "activation_checkpoint.mode: 'partial' is not one of: none, full, selective",
        ),
        (
            "",
            ["--parallelism.fsdp_reshard_after_forward", "sometimes"],
            "is not one of: default, always, never",
        ),
        (
            '[compile]\ncomponents = ["model", "optimizer"]\n',
            [],
            "compile.components: 'optimizer' is not one of: model, loss",
        ),
        (
            "",
            ["--compile.backend", "cudagraphs"],
            "--compile.backend: 'cudagraphs' is not one of: inductor, aot_eager, eager",
        ),
    ],
)
def test_validation_errors(tmp_path, toml, args, expected):
    path = _toml(tmp_path, toml)
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", path, *args])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="job.config_file: '/nope.toml' does not exist"):
        parse_args(["--job.config_file", "/nope.toml"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"job.config_file: '.*bad.toml' is not valid TOML"):
        parse_args(["--job.config_file", str(bad)])


def test_a_misspelled_section_is_one_line_per_file(tmp_path, capsys):
    from torchtitan.train import preflight

    path = _toml(
        tmp_path, '[optimiser]\nname = "AdamW"\nlr = 3e-4\neps = 1e-8\nweight_decay = 0.1\n'
    )
    cli = ["--optimiser.lr", "1", "--optimiser.eps", "2", "--opt.lr", "1", "--zzz.name", "x"]
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", path, *cli])
    assert str(e.value).splitlines() == [
        f"{path}: unknown section [optimiser]; did you mean [optimizer]?",
        "command line: --optimiser.lr, --optimiser.eps: unknown section [optimiser]; did you "
        "mean [optimizer]?",
        # no name close to 'opt': the section that holds its keys
        "command line: --opt.lr: unknown section [opt]; did you mean [optimizer]?",
        "command line: --zzz.name: unknown section [zzz]; sections: job, model, float8, "
        "optimizer, lr_scheduler, training, metrics, parallelism, moe, checkpoint, "
        "activation_checkpoint, compile, profiling, validation, eval, lora, fault_tolerance, debug, comm, resilience",
    ]
    assert preflight.main(["--job.config_file", path]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: unknown section [optimiser]; did you mean [optimizer]?\n"
    )


def test_unknown_keys_of_known_and_old_sections_are_judged_one_by_one(tmp_path):
    path = _toml(tmp_path, "[training]\nstepz = 1\n[experimental]\nnope = 1\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", path])
    assert str(e.value).splitlines() == [
        f"{path}: training.stepz: unknown key; did you mean 'training.steps'?",
        f"{path}: experimental.nope: unknown key; see python train.py --help for the keys of "
        "[experimental]",
    ]


def test_a_warmup_that_outlasts_training_is_one_warning(tmp_path, capsys):
    from torchtitan.optim.lr_scheduling import lr_factor
    from torchtitan.train import preflight

    path = _toml(
        tmp_path, "[lr_scheduler]\nwarmup_steps = 10\ndecay_ratio = 0.5\n[training]\nsteps = 10\n"
    )
    cfg = parse_args(["--job.config_file", path])
    assert cfg.warnings == [
        f"{path}: lr_scheduler.warmup_steps: 10 warm-up steps, but training.steps is 10: the "
        "whole run is warm-up, the learning rate rising to 91% of optimizer.lr at the last "
        "step, never reaching it or decaying; make warmup_steps smaller than training.steps"
    ]
    assert max(lr_factor(s, total_steps=10, cfg=cfg.lr_scheduler) for s in range(1, 11)) < 1
    assert preflight.main(["--job.config_file", path]) == 0
    assert capsys.readouterr().err == f"warning: {cfg.warnings[0]}\n"
    # one step more, or a schedule that ends sooner: the peak is reached, nothing is said (with
    # decay_ratio < 1: a stable phase, at the peak, follows the warm-up)
    for extra in (["--training.steps", "11"], ["--lr_scheduler.total_steps", "9"]):
        cfg = parse_args(["--job.config_file", path, *extra])
        steps = cfg.training.steps
        total = cfg.lr_scheduler.total_steps or steps
        assert (
            max(lr_factor(s, total_steps=total, cfg=cfg.lr_scheduler) for s in range(1, steps + 1))
            == 1
        )
        assert cfg.warnings == []
    cfg = parse_args(["--model.tokenizer_path", TOKENIZER, "--training.steps", "50"])
    assert cfg.warnings == [
        "lr_scheduler.warmup_steps (default): 200 warm-up steps, but training.steps is 50: the "
        "whole run is warm-up, the learning rate rising to 98% of optimizer.lr at the last "
        "step, never reaching it or decaying; make warmup_steps smaller than training.steps"
    ]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "train_configs").glob("*.toml")), ids=lambda p: p.name
)
def test_every_shipped_config_passes_preflight(path):
    from torchtitan.train.plan import plan_job

    kind = "sentencepiece" if "llama2" in path.name else "tiktoken"
    tok = str(TOKENIZER_ASSETS / f"{kind}.model")
    cfg = parse_args(["--job.config_file", str(path), "--model.tokenizer_path", tok])
    assert cfg.warnings == []
    # The smallest world each config is written for: 8 GPUs, or nodes of them for TP x FSDP (x PP)
    world = {
        "llama3_70b.toml": 64,
        "llama2_70b.toml": 64,
        "llama3_405b.toml": 256,
        "qwen3_moe_30b_a3b.toml": 16,
        "qwen3_moe_235b_a22b.toml": 128,
        "llama4_17bx16e.toml": 64,
        "llama4_17bx128e.toml": 256,
        "deepseek_v3_671b.toml": 512,
        "gpt_oss_120b.toml": 64,
    }
    world_size = world.get(path.name, 8)
    plan = plan_job(cfg, world_size=world_size)
    d = plan.dims
    assert d.dp_shard * d.tp * d.pp == world_size and d.dp_shard >= 2
    assert plan.grad_accum_steps == 1
    assert cfg.training.seq_len <= plan.model_args.max_seq_len


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--model.converters", "int4"],
            "model.converters: unknown converter 'int4'; valid: float8",
        ),
        (
            ["--parallelism.enable_async_tensor_parallel"],
            "parallelism.enable_async_tensor_parallel: async tensor parallel needs CUDA GPUs",
        ),
        (["--float8.recipe_name", "int8"], "float8.recipe_name: 'int8' is not one of"),
    ],
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine reports")
def test_gpu_only_features_fail_clearly_on_cpu(args, expected):
    from torchtitan.train.plan import plan_job

    with pytest.raises(ConfigError) as e:
        plan_job(parse_args(args), world_size=1)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine reports")
def test_float8_on_cpu_needs_cpu_float8_matmuls(monkeypatch):
    from torchtitan.quantization import float8
    from torchtitan.train.plan import plan_job

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao (dev-requirements.txt): its absence is refused first")
    cfg = parse_args(["--model.converters", "float8"])
    if float8.cpu_float8_matmul_works():  # torch 2.13's CPU build: allowed, for numerics checks
        plan_job(cfg, world_size=1)
    monkeypatch.setattr(float8, "cpu_float8_matmul_works", lambda: False)
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=1)
    assert "model.converters: float8 needs a CUDA GPU" in str(e.value)
    assert "\n" not in str(e.value)


def test_model_n_layers_overrides_the_flavor():
    from torchtitan.train.plan import plan_job

    assert plan_job(parse_args([]), world_size=1).model_args.n_layers == 6  # debugmodel's own
    plan = plan_job(parse_args(["--model.n_layers", "2"]), world_size=1)
    assert plan.model_args.n_layers == 2 and plan.model_args.dim == 256
    with pytest.raises(ConfigError, match="parallelism.pipeline_parallel_degree"):
        plan_job(
            parse_args(["--model.n_layers", "1", "--parallelism.pipeline_parallel_degree", "2"]), 2
        )


def test_compile_components_choose_what_is_compiled():
    c = parse_args(["--compile.enable", "--compile.components", "loss"]).compile
    assert c.compiles("loss") and not c.compiles("model")
    assert not parse_args(["--compile.components", "model,loss"]).compile.compiles("model")
    assert parse_args(["--compile.enable"]).compile.components == ["model", "loss"]


def test_compile_backend_is_passed_on_and_named_where_not_inductor(monkeypatch):
    import torch.nn as nn

    from torchtitan.distributed import parallelize

    assert parse_args([]).compile.backend == "inductor"
    assert parse_args(["--compile.enable"]).compile.described() == "torch.compile"
    c = parse_args(["--compile.enable", "--compile.backend", "aot_eager"]).compile
    assert c.described() == "torch.compile (aot_eager)"
    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(kw["backend"]))
    monkeypatch.setattr(parallelize, "blocks", lambda model: [nn.Linear(2, 2)] * 3)
    parallelize.compile_blocks(nn.Module(), c, experts_all_to_all=False)
    assert seen == ["aot_eager"] * 3
