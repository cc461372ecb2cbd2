"""Weighted mixtures of data sources: the blend rule, the mixed loader (layout invariance, exact
resume, per-source token counts), the ``training.datasets`` key and its bad values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from loaders import build_loader
from offline_data import ByteTokenizer, use_offline_caches

from torchtitan.config.parse import parse_args
from torchtitan.data.blend import Blend
from torchtitan.data.indexed import IndexedWriter
from torchtitan.data.mixture import mixture_specs, parse_entries
from torchtitan.errors import ConfigError
from torchtitan.observability.metrics import MetricsProcessor


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, monkeypatch):
    """No Hub access, and no writes to the user's caches."""
    hf_cache = tmp_path_factory.mktemp("hf_datasets_cache")
    use_offline_caches(monkeypatch, hf_cache)


TOK = ByteTokenizer()


# ---- the blend


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [7, 2, 1], [0.97, 0.03], [1, 1, 1, 1, 1]])
def test_blend_follows_the_weights_at_every_prefix(weights):
    blend = Blend(weights, [f"s{i}" for i in range(len(weights))])
    sources, _ = blend.take(10_000)
    share = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(weights))
    worst = 0.0
    for k, s in enumerate(sources, start=1):
        counts[s] += 1
        worst = max(worst, float(np.abs(counts - k * share).max()))
    assert worst <= 2.0, worst  # within two windows of the exact share, at every prefix
    assert np.abs(counts / 10_000 - share).max() < 0.01


def test_blend_positions_count_each_sources_windows():
    blend = Blend([2, 1], ["a", "b"])
    sources, positions = blend.take(9)
    for s in (0, 1):
        assert [p for x, p in zip(sources, positions, strict=True) if x == s] == list(
            range(sources.count(s))
        )


def test_blend_resumes_exactly_and_new_weights_apply_from_the_resume():
    a = Blend([0.6, 0.4], ["x", "y"])
    a.take(1001)
    saved = a.state()
    expected = a.take(500)
    b = Blend([0.6, 0.4], ["x", "y"])
    b.load(saved)
    assert b.take(500) == expected

    c = Blend([0.2, 0.8], ["x", "y"])  # new weights: no burst of y making up for the old deficit
    c.load(saved, warn=False)
    sources, _ = c.take(1000)
    assert abs(sources[:100].count(1) - 80) <= 2 and abs(sources.count(1) - 800) <= 2


def test_blend_refuses_a_state_of_other_sources():
    saved = Blend([1, 1], ["x", "y"]).state()
    with pytest.raises(ConfigError, match=r"saved for the sources \['x', 'y'\].*\['x', 'z'\]"):
        Blend([1, 1], ["x", "z"]).load(saved)


# ---- the mixed loader


def write_jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def write_indexed(folder: Path, docs: list[list[int]]) -> str:
    folder.mkdir()
    w = IndexedWriter(folder / "part", np.dtype(np.uint16))
    for d in docs:
        w.add(d)
    w.close()
    return str(folder)


@pytest.fixture
def three_sources(tmp_path) -> list[dict]:
    rng = np.random.default_rng(1)
    web = write_jsonl(tmp_path / "web.jsonl", [f"web page {i} " * (i % 5 + 1) for i in range(40)])
    code = write_jsonl(tmp_path / "code.jsonl", [f"def f{i}(): return {i}" for i in range(30)])
    tokens = write_indexed(tmp_path / "tok", [rng.integers(0, 256, 30).tolist() for _ in range(50)])
    return [
        {"path": web, "weight": 5, "name": "web"},
        {"path": code, "weight": 3, "name": "code"},
        {"path": tokens, "weight": 2, "name": "tok"},
    ]


def mixed(entries, *, dp: int = 1, rank: int = 0, local: int = 8):
    return build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=TOK,
        local_batch_size=local,
        global_batch_size=8,
        seq_len=12,
        dp_rank=rank,
        dp_world_size=dp,
        datasets=entries,
        seed=3,
        shuffle=True,
    )


def steps_of(entries, dp: int, local: int, steps: int, states=None) -> list[torch.Tensor]:
    loaders = [mixed(entries, dp=dp, rank=r, local=local) for r in range(dp)]
    for ld, st in zip(loaders, states or [None] * dp, strict=True):
        if st:
            ld.load_state_dict(st)
    its = [iter(ld) for ld in loaders]
    accum = 8 // (dp * local)
    return [
        torch.cat([rows_of(next(it)) for it in its for _ in range(accum)]) for _ in range(steps)
    ], loaders


def rows_of(batch) -> torch.Tensor:
    """A batch's inputs and doc_ids side by side, one row per sequence."""
    return torch.cat([batch.inputs, batch.doc_ids.long()], 1)


def test_mixture_is_the_same_for_every_layout(three_sources):
    ref, _ = steps_of(three_sources, 1, 8, 10)
    for dp, local in ((1, 2), (2, 4), (4, 1)):
        got, _ = steps_of(three_sources, dp, local, 10)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (dp, local)


def test_mixture_counts_tokens_per_source(three_sources):
    _, (ld,) = steps_of(three_sources, 1, 8, 10)
    assert ld.tokens_per_source() == {"web": 40 * 12, "code": 24 * 12, "tok": 16 * 12}


def test_mixture_resumes_exactly_on_another_layout(three_sources):
    first, loaders = steps_of(three_sources, 2, 2, 4)
    state: dict = {}
    for ld in loaders:
        state.update(ld.state_dict())
    state = json.loads(
        json.dumps({k: v if isinstance(v, int) else v.decode() for k, v in state.items()})
    )
    state = {k: v if isinstance(v, int) else v.encode() for k, v in state.items()}
    ref, _ = steps_of(three_sources, 1, 8, 9)
    resumed, _ = steps_of(three_sources, 4, 1, 5, states=[state] * 4)
    assert all(torch.equal(a, b) for a, b in zip(ref[4:], resumed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref[:4], first, strict=True))


def test_a_token_source_in_a_mixture_reads_its_own_stream(three_sources, tmp_path):
    """The m-th window the blend gives the pretokenized source is that source's window m."""
    only = mixed([three_sources[2]])
    alone = [w for w, _ in zip(iter(only), range(4), strict=False)]
    ld = mixed(three_sources)
    sources, _ = Blend([5, 3, 2], ["web", "code", "tok"]).take(8 * 6)
    rows = torch.cat([rows_of(b) for b, _ in zip(iter(ld), range(6), strict=False)])
    tok_rows = rows[[k for k, s in enumerate(sources) if s == 2]]
    assert torch.equal(tok_rows, torch.cat([rows_of(b) for b in alone])[: len(tok_rows)])


# ---- the key


def test_entries_from_toml_json_and_pairs(tmp_path, three_sources):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        "[training]\n"
        + "".join(
            f'[[training.datasets]]\npath = "{e["path"]}"\nweight = {e["weight"]}\nname = "{e["name"]}"\n'
            for e in three_sources
        )
    )
    cfg = parse_args(["--job.config_file", str(toml)], need_files=False)
    assert [s.name for s in mixture_specs(parse_entries(cfg.training.datasets))] == [
        "web",
        "code",
        "tok",
    ]
    cli = parse_args(["--training.datasets", json.dumps(three_sources[:2])], need_files=False)
    assert [s.weight for s in mixture_specs(parse_entries(cli.training.datasets))] == [5, 3]
    pairs = parse_entries(f"python_docs:0.25,{three_sources[0]['path']}:0.75")
    specs = mixture_specs(pairs)
    assert (specs[0].dataset, specs[0].weight, specs[1].path) == (
        "python_docs",
        0.25,
        three_sources[0]["path"],
    )


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"dataset": "python_docs", "weight": -1}], r"datasets\[0\].weight: -1 is negative"),
        ([{"dataset": "python_docs", "weight": 0}], "weights are all zero"),
        (
            [{"dataset": "python_docs", "wieght": 1}],
            r"datasets\[0\]: unknown key\(s\) \['wieght'\]",
        ),
        ([{"dataset": "python_docs", "path": "x"}], "exactly one of 'dataset'"),
        (
            [{"path": "/no/such/file.jsonl"}],
            r"datasets\[0\].path: '/no/such/file.jsonl' does not exist",
        ),
        (
            [{"dataset": "python_docs"}, {"dataset": "python_docs"}],
            "two entries are named 'python_docs'",
        ),
        ([{"dataset": "python_docs", "weight": "lots"}], r"weight: 'lots' is not a number"),
        ("python_docs", "is not name_or_path:weight"),
        ("[{", "not valid JSON"),
        ([], "lists no sources"),
    ],
)
def test_bad_mixtures_are_one_line(entries, message):
    with pytest.raises(ConfigError, match=message):
        mixture_specs(parse_entries(entries))


def test_metrics_show_each_sources_share(caplog):
    class Sink:
        def __init__(self):
            self.values = {}

        def write(self, values, step):
            self.values = values

    sink = Sink()
    m = MetricsProcessor(
        flops_per_token=1,
        log_freq=1,
        sinks=[sink],
        color=False,
        data_tokens=lambda: {"web": 7_000_000, "code": 3_000_000},
    )
    m.ntokens_since_last_log = 10
    with caplog.at_level("INFO"):
        m.log(1, 2.0, 1.0, 1e-3)
    assert sink.values["data/tokens/web"] == 7e6 and sink.values["data/tokens/code"] == 3e6
    assert "data: web 70.0% (7.0M tokens)  code 30.0% (3.0M tokens)" in caplog.text


def test_a_validation_mixture_is_one_pass_that_rewinds(three_sources):
    """Non-infinite (validation): the pass ends when a source runs out, the next one is the same."""
    ld = build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=TOK,
        local_batch_size=4,
        global_batch_size=8,
        seq_len=12,
        dp_rank=0,
        dp_world_size=2,
        datasets=three_sources,
        infinite=False,
        split="train",
        section="validation",
    )
    first = [rows_of(b) for b in ld]
    second = [rows_of(b) for b in ld]
    assert 0 < len(first) < 1000 and len(first) == len(second)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_state_saved_inside_a_step_resumes_only_on_its_layout(three_sources):
    first = mixed(three_sources, dp=2, rank=0, local=2)
    it = iter(first)
    for _ in range(3):  # one step (2 microbatches) and one microbatch of the next
        next(it)
    state = first.state_dict()
    expected = [next(it)[0] for _ in range(3)]
    same = mixed(three_sources, dp=2, rank=0, local=2)
    same.load_state_dict(state)
    got = iter(same)
    assert all(torch.equal(next(got)[0], e) for e in expected)
    other = mixed(three_sources, dp=2, rank=0, local=4)
    with pytest.raises(ConfigError, match=r"saved after 1 microbatch\(es\) of a step .*\[2, 2\]"):
        other.load_state_dict(state)
