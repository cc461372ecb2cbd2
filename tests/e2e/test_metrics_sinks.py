"""Where the metrics go: Weights & Biases (offline) next to TensorBoard, and every rank's own
metrics with metrics.save_for_all_ranks. (The config check is in
tests/unit/observability/test_metrics_sinks.py.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from launcher import launch, pooled

from torchtitan.observability.tb_events import read_scalars

SHORT = [
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
]


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log-style 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += room
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.mark.slow
def test_wandb_offline_logs_the_same_scalars_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = launch(tmp_path, *SHORT, "--metrics.enable_wandb", ngpu=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Weights & Biases run" in out.stdout
    [run_file] = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[items["_step"]] = items
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    tb = read_scalars(tmp_path / "out")
    assert sorted(history) == sorted(tb) == [1, 2, 3]
    for step, loss in tb.items():
        assert history[step]["loss"] == pytest.approx(loss, rel=1e-6)
        assert {"grad_norm", "lr", "throughput/tps"} <= set(history[step])
    assert config["training"]["steps"] == 3 and config["metrics"]["enable_wandb"] is True


@pytest.mark.slow
def test_every_rank_writes_its_own_tensorboard_run(pools, tmp_path):
    out = pooled(pools, tmp_path, *SHORT, "--metrics.save_for_all_ranks", ngpu=2)
    assert out.returncode == 0, out.stderr[-3000:]
    per_rank = [read_scalars(tmp_path / "out" / "tb" / f"rank_{r}") for r in (0, 1)]
    assert sorted(per_rank[0]) == [1, 2, 3]
    assert per_rank[0] == per_rank[1]  # the logged loss is the data-parallel mean on every rank
    tps = [read_scalars(tmp_path / "out" / "tb" / f"rank_{r}", "throughput/tps") for r in (0, 1)]
    assert all(v > 0 for d in tps for v in d.values())
    # every rank's log in its own file; the console shows LOG_RANK's (default 0) only
    logs = [(tmp_path / "out" / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)]
    assert "step: 3 " in logs[0] and "step: " not in logs[1]
    assert all("world_size=2" in log and "Parameters on this rank" in log for log in logs)
    assert "[rank1]" not in out.stdout
