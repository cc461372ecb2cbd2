"""The benchmarks run the real paths and report consistent numbers (no timing thresholds:
performance is shown by the benchmarks themselves, see docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launcher import train_env
from repo_paths import ROOT, load_script

SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "64"]


def _bench(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        env=train_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_train_throughput_table_from_the_real_runs(tmp_path):
    out = _bench(
        tmp_path,
        "train_throughput.py",
        "--steps",
        "5",
        "--warmup",
        "2",
        "--json",
        "--setting",
        "base=",
        "--setting",
        "broken=--training.local_batch_size 0",
        "--setting",
        "seed7=--debug.seed 7",
        "--",
        *SMALL,
    )
    assert out.returncode == 1, out.stderr[-2000:]  # one setting failed, and says why
    rows = {r["setting"]: r for r in json.loads(out.stdout)["rows"]}
    assert "training.local_batch_size" in rows["broken"]["error"]
    base = rows["base"]
    assert base["steps_measured"] == 3 and base["mfu_pct"] is None  # CPU: no MFU
    assert base["tokens_per_s_per_device"] > 0 and base["step_time_s"] > 0
    # tokens per step (2 x 64) over the step time is the logged rate, up to step-to-step noise
    assert 0.3 < base["tokens_per_s_per_device"] * base["step_time_s"] / 128 < 3
    assert base["peak_memory_gib"] > 0.1
    # against the first setting: itself exactly; another seed initializes other weights
    assert base["speedup_vs_first"] == 1 and base["max_loss_gap_vs_first"] == 0
    other = rows["seed7"]
    assert other["max_loss_gap_vs_first"] == max(
        abs(other["losses"][s] - base["losses"][s]) for s in base["losses"]
    )
    assert other["max_loss_gap_vs_first"] > 1e-3 and sorted(map(int, other["losses"])) == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert other["speedup_vs_first"] == pytest.approx(
        other["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
    )


@pytest.mark.slow
def test_plain_loop_reports_both_step_times_and_their_ratio(tmp_path):
    out = _bench(
        tmp_path,
        "plain_loop.py",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--rounds",
        "1",
        "--json",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--metrics.log_freq",
        "2",
        *SMALL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["library_step_s"] > 0 and r["plain_step_s"] > 0 and r["steps_measured"] == 4
    assert r["ratio"] == pytest.approx(r["library_step_s"] / r["plain_step_s"])


@pytest.mark.slow
def test_startup_breakdown_covers_the_launch(tmp_path):
    out = _bench(
        tmp_path,
        "startup.py",
        "--repeats",
        "1",
        "--json",
        "--job.config_file",
        "train_configs/debug_model.toml",
        *SMALL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    phases = r["phases_s"]
    assert list(phases) == [
        "start and imports",
        "config and process group",
        "tokenizer and data",
        "model on meta",
        "parallelize and materialize",
        "optimizer, metrics, checkpoint",
        "first step",
    ]
    # the phases add up to the time from process start to the line (measured from outside too)
    assert sum(phases.values()) <= r["launch_to_first_step_s"] + 0.5
    assert sum(phases.values()) > 0.5 * r["launch_to_first_step_s"]


def test_plain_loop_refuses_steps_off_the_logging_grid(tmp_path):
    out = _bench(tmp_path, "plain_loop.py", "--steps", "7", "--warmup", "2")
    assert out.returncode == 2 and "multiples of metrics.log_freq (5)" in out.stderr


MOE_PHASES = (
    "dispatch forward",
    "combine forward",
    "combine backward",
    "dispatch backward",
    "counts forward",
)


@pytest.mark.usefixtures("one_cpu_thread")
def test_moe_kernels_table_compares_grouped_mm_with_the_loop(capsys):
    """In this process (the table of the smallest size takes a fraction of a second)."""
    bench = load_script("moe", folder="benchmarks")
    assert bench.main(["kernels", "--sizes", "tiny", "--rounds", "1", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("size"))
    assert lines[head].split() == [
        "size",
        "tokens",
        "E",
        "k",
        "dim",
        "hidden",
        "grouped",
        "ms",
        "loop",
        "ms",
        "speedup",
        "(wall)",
        "GFLOP/s",
        "max|diff|",
        "out",
        "grads",
    ]
    cells = lines[head + 1].split()
    assert cells[:6] == ["tiny", "64", "4", "2", "32", "64"]
    assert float(cells[6]) > 0 and float(cells[7]) > 0 and cells[8].endswith("x")
    # the same weights through both kernels: the same outputs and gradients (float32 rounding)
    assert float(cells[11]) < 1e-5 and float(cells[12]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, rows, mib",
    [([], 128, "0.125"), (["--parallelism.tensor_parallel_degree", "2"], 64, "0.062")],
    ids=["ep2", "ep2_tp2_whole_experts"],
)
def test_moe_volume_observed_in_an_ep_run_matches_the_computed_rows(
    tmp_path, monkeypatch, capsys, extra, rows, mib
):
    """Two gloo ranks (worker processes started by the benchmark, here in this process) train
    llama4 debug with EP 2 for 2 steps: T = 1 x 32 tokens, top-1, 4 MoE layers, dim 256,
    float32, so 128 rows (128 KiB) per phase, rank and step. With TP 2 over the same ranks and
    whole experts (the default expert_tensor_parallel_degree 1) both ranks route the same 32
    tokens and each sends its half: 64 rows."""
    for key, value in train_env(tmp_path).items():  # the workers' caches, offline
        monkeypatch.setenv(key, value)
    bench = load_script("moe", folder="benchmarks")
    rc = bench.main(
        [
            "volume",
            "--steps",
            "2",
            "--",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            *extra,
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, lines
    assert "T = 32 tokens per rank per micro-batch, top_k 1, dim 256" in lines[0]
    head = next(ln for ln in lines if ln.startswith("phase"))
    assert "rank 0 rows" in head and "rank 1 rows" in head and "rows match" in head
    table = {}
    for ln in lines:
        if ln[:18].strip() in MOE_PHASES:
            computed, observed, match = ln[18:].split("|")
            observed = observed.replace(" B", "B")  # the counts' sizes are in bytes: "256 B"
            table[ln[:18].strip()] = (computed.split(), observed.split(), match.strip())
    assert list(table) == list(MOE_PHASES)
    for phase, (computed, observed, match) in table.items():
        got, ranks = int(computed[0].replace(",", "")), [float(observed[i]) for i in (0, 3)]
        assert match.startswith("yes"), phase
        assert got == (32 if phase.startswith("counts") else rows)  # counts: 8 experts x 4 layers
        # every rank sends its own rows' copies (and their gradients back) whatever the routing;
        # how many its experts return depends on the routing, their sum over ranks does not
        if "(rank)" in match:
            assert ranks == [got, got], phase
        else:
            assert sum(ranks) == 2 * got, phase
    assert table["dispatch forward"][0][1] == mib  # 128 rows x 256 x 4 bytes = 1/8 MiB
    # the gradients come back the way the rows went
    assert table["dispatch backward"][1] == table["combine forward"][1]


def test_train_throughput_setting_may_set_its_own_process_count():
    """What ``moe.py layouts`` relies on: ``--ngpu N`` inside a setting's overrides."""
    bench = load_script("train_throughput", folder="benchmarks")
    parser = bench.argparse.ArgumentParser()
    assert bench._parse_setting(
        "ep2=--ngpu 4 --parallelism.expert_parallel_degree 2", parser, 1
    ) == ("ep2", ["--parallelism.expert_parallel_degree", "2"], 4)
    assert bench._parse_setting("base=--training.steps 3", parser, 2) == (
        "base",
        ["--training.steps", "3"],
        2,
    )
    with pytest.raises(SystemExit):
        bench._parse_setting("bad=--ngpu", parser, 1)
    rows = [
        {"setting": "one", "ngpu": 1, "error": "x"},
        {"setting": "four", "ngpu": 4, "error": "y"},
    ]
    table = bench.format_table(rows, "c.toml", 1, 5, 2)
    assert (
        "1/4 processes (per setting: [N])" in table and "one [1]" in table and "four [4]" in table
    )


@pytest.mark.slow
def test_muon_step_shares_out_the_matrices_with_the_same_result(tmp_path):
    out = _bench(tmp_path, "muon_step.py", "--ranks", "2", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # the debug model's hidden matrices, as Muon's group line counts them (docs/optimizers.md)
    assert r["ranks"] == 2 and r["matrices"] == 30 and r["parameters"] == 4_718_592, r
    assert r["equal"] is True and r["every_rank_s"] > 0 and r["shared_out_s"] > 0, r
    assert r["speedup"] == pytest.approx(r["every_rank_s"] / r["shared_out_s"])


@pytest.mark.slow
def test_gpu_suite_runs_its_parts_within_the_budget_and_reports_them(tmp_path):
    """The suite's wiring on this machine: the parts chosen run (the ceilings on CPU), each
    one's JSON lands in suite.json with its status and time, and a part that cannot start
    within the budget is skipped, not run."""
    out = tmp_path / "suite"
    env = train_env(tmp_path, PARTS="env tokenizer ceilings", T_TOTAL="300")
    run = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    suite = json.loads((out / "suite.json").read_text())
    parts = suite["parts"]
    assert list(parts) == ["env", "tokenizer", "ceilings"], run.stdout[-2000:]
    assert all(p["status"] == "ok" for p in parts.values()), parts
    assert run.returncode == 0, run.stdout[-2000:]
    import torch

    if not torch.cuda.is_available():
        assert parts["env"]["result"]["device"] == "no CUDA device"
    assert parts["ceilings"]["result"]["matmul"]["tflops"] > 0
    assert (out / "llama3.model").stat().st_size > 1_000_000  # Llama 3's 128,000 ranks
    assert "ceilings" in run.stdout and "matmul" in run.stdout
    # no budget left in the same folder: every part skipped, none with the earlier run's result
    env = train_env(tmp_path, PARTS="env ceilings", T_TOTAL="5")
    run = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    parts = json.loads((out / "suite.json").read_text())["parts"]
    assert [p["status"].startswith("skipped") for p in parts.values()] == [True, True]
    assert [p["result"] for p in parts.values()] == [None, None]
    assert run.returncode == 0, run.stdout[-2000:]
    # a part that does not exist: one line, nothing run
    env = train_env(tmp_path, PARTS="ceilings 3b_bf17")
    run = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and run.stderr.startswith("error: PARTS: unknown part '3b_bf17'")


def test_gpu_suite_report_states_errors_and_the_targets(tmp_path, capsys):
    """The report's reading of train_throughput.py rows: a run's speed against the issue's
    targets, a refused one's error line, a part skipped for the budget neither ok nor failed."""
    report = load_script("gpu_suite_report", "benchmarks")
    row = {"setting": "run", "ngpu": 1, "mfu_pct": 50.0, "peak_memory_gib": 60.0}
    runs = {
        "3b_bf16": {**row, "tokens_per_s_per_device": 10_000.0, "step_time_s": 0.8},
        "3b_float8": {**row, "tokens_per_s_per_device": 13_000.0, "step_time_s": 0.6},
        "3b_no_ac": {"setting": "run", "ngpu": 1, "error": "error: llama3 3B ... does not fit"},
    }
    status = {"3b_bf16": "ok", "3b_float8": "ok", "3b_no_ac": "failed (exit 1)"}
    for name, r in runs.items():
        (tmp_path / f"{name}.log").write_text("noise\n" + json.dumps({"rows": [r]}) + "\n")
    (tmp_path / "mla.log").write_text('{"stale": 1}\n')  # an earlier run's, the part skipped
    summary = [f"{n}\t{status[n]}\t9" for n in runs] + ["mla\tskipped (suite budget)\t0"]
    (tmp_path / "summary.tsv").write_text("\n".join(summary) + "\n")
    assert report.main([str(tmp_path)]) == 1  # 3b_no_ac failed
    out = capsys.readouterr().out
    assert "10,000 tokens/s, MFU 50.0%, peak 60.0 GiB, step 0.800 s" in out
    assert "error: llama3 3B ... does not fit" in out
    assert "3B bf16 MFU 50.0% (target 55%: not met)" in out
    assert "3B float8 / bf16 1.30x (target 1.25x: met)" in out
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["parts"]["mla"]["result"] is None
