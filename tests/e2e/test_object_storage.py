"""Checkpoints in object storage: ``checkpoint.folder = "s3://bucket/prefix"`` against a real
S3-compatible server (moto's, a process started by the test on localhost) through the real
``s3fs``/``boto3`` clients, two ranks over gloo through ./run_llama_train.sh. What the trainer
wrote is read back with boto3's own client. (The storage operations without a server, on
``file://`` URLs, are in tests/unit/checkpoint/test_object_storage.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from launcher import (
    FOUR_WORKER_ARGS,
    kill_all,
    launch,
    start,
    tensorboard_scalars_all_runs,
    worker_pids,
)
from s3_server import s3_server

# FOUR_WORKER_ARGS's run (later flags win), on two ranks, with checkpoints in the bucket
TRAIN = [*FOUR_WORKER_ARGS, "--training.local_batch_size=4", "--lr_scheduler.warmup_steps=2"]
ARGS = [
    *TRAIN,
    "--checkpoint.enable",
    "--checkpoint.interval=5",
    "--checkpoint.keep_latest_k=2",
    "--checkpoint.folder=s3://ckpt/run",
]


def _wait_for_line(log: Path, text: str, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"the run ended before logging {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {log} after {timeout}s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_run_killed_mid_save_resumes_exactly_from_s3(tmp_path):
    """The store stalls (SIGSTOP) just before step 10's save, and the run is SIGKILLed while
    that save hangs: no marker for step 10, whatever the server took in. The restart (async
    saves this time) removes the unmarked folder, resumes from step 5 and repeats steps 6-10
    exactly; keep_latest_k = 2 leaves steps 15 and 20; the last step's Hugging Face export is
    uploaded with config.json last."""
    log = tmp_path / "out" / "logs" / "rank_0.log"
    with s3_server() as s3:
        s3.client().create_bucket(Bucket="ckpt")
        run = start(tmp_path, *ARGS, "--training.steps", "20", ngpu=2, **s3.env)
        try:
            _wait_for_line(log, "step: 9 ", run)
            s3.freeze()
            _wait_for_line(log, "step: 10 ", run)
            time.sleep(3)  # the save of step 10 is under way, its requests unanswered
        finally:  # the workers (a session of their own under torchrun), then the launcher
            kill_all([run], pids=worker_pids(str(tmp_path)).values())
            s3.thaw()
        first = tensorboard_scalars_all_runs(tmp_path / "out")
        assert sorted(first) == list(range(1, 11))
        keys = s3.keys("ckpt")
        assert "run/step-5/COMPLETE" in keys and "run/step-10/COMPLETE" not in keys, keys
        if not any(k.startswith("run/step-10/") for k in keys):
            # the stalled server took in no whole object; a kill later in the save leaves its
            # data and metadata without the marker: put them there as such a kill would
            for name in (".metadata", "__0_0.distcp"):
                s3.client().copy_object(
                    Bucket="ckpt",
                    Key=f"run/step-10/{name}",
                    CopySource={"Bucket": "ckpt", "Key": f"run/step-5/{name}"},
                )

        out = launch(
            tmp_path,
            *ARGS,
            "--training.steps=20",
            "--checkpoint.async_mode=async",
            "--checkpoint.last_save_in_hf",
            ngpu=2,
            timeout=600,
            **s3.env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Removing incomplete checkpoint s3://ckpt/run/step-10" in out.stdout
        assert "Loaded training state from s3://ckpt/run/step-5 (step 5)" in out.stdout
        resumed = tensorboard_scalars_all_runs(tmp_path / "out")
        for step in range(6, 11):  # full precision: the same state, data position and RNG
            assert resumed[step] == first[step], (step, resumed[step], first[step])

        keys = s3.keys("ckpt")
        steps = sorted({k.split("/")[1] for k in keys})
        assert steps == ["step-15", "step-20", "step-20-hf"], keys
        marker = s3.client().get_object(Bucket="ckpt", Key="run/step-20/COMPLETE")
        info = json.loads(marker["Body"].read())
        assert info["step"] == 20 and info["world_size"] == 2
        assert {"run/step-20/.metadata", "run/step-20-hf/config.json"} <= set(keys)
        assert "run/step-20-hf/model.safetensors" in keys
        assert not (tmp_path / "out" / "export-staging" / "step-20" / "rank-0").exists()


@pytest.mark.slow
def test_unreachable_storage_is_one_line_naming_the_key(tmp_path):
    """Before any model is built, from the launcher's preflight: a missing bucket (s3fs would
    create it on the first write), no credentials, an endpoint that does not answer, a protocol
    fsspec does not know."""
    with s3_server() as s3:
        s3.client().create_bucket(Bucket="ckpt")
        no_keys = {
            **s3.env,
            "AWS_ACCESS_KEY_ID": "",
            "AWS_SECRET_ACCESS_KEY": "",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        down = {**s3.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_MAX_ATTEMPTS": "1"}
        cases = [
            ("s3://missing-bucket/run", s3.env, "the bucket 'missing-bucket' does not exist"),
            ("s3://ckpt/run", no_keys, "no credentials were found; set AWS_ACCESS_KEY_ID"),
            ("s3://ckpt/run", down, "http://127.0.0.1:1 (AWS_ENDPOINT_URL) does not answer"),
            ("nosuch://ckpt/run", s3.env, "is not a URL fsspec can open"),
        ]
        for url, env, expected in cases:
            out = launch(
                tmp_path, "--checkpoint.enable", f"--checkpoint.folder={url}", timeout=300, **env
            )
            lines = [line for line in out.stderr.splitlines() if "checkpoint.folder" in line]
            assert out.returncode == 2 and len(lines) == 1, (url, out.stderr[-2000:])
            assert f"'{url}'" in lines[0] and expected in lines[0], lines[0]
            assert "Traceback" not in out.stderr and "testing-secret" not in out.stderr + out.stdout
        assert s3.keys("ckpt") == [] and "missing-bucket" not in str(s3.client().list_buckets())


def _data(folder: Path) -> None:
    """A pretokenized corpus (Megatron's .bin/.idx, random ids) and a JSON-lines text file."""
    import numpy as np

    from torchtitan.data.indexed import IndexedWriter

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    writer = IndexedWriter(folder / "corpus", np.uint16)
    for _ in range(64):
        writer.add(rng.integers(5, 2256, int(rng.integers(20, 200))))
    writer.close()
    words = ["storage", "object", "bucket", "token", "window", "shard", "resume", "marker"]
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(40):
            text = " ".join(words[(i * 7 + j) % len(words)] for j in range(30 + i))
            f.write(json.dumps({"text": text}) + "\n")


@pytest.mark.slow
def test_training_data_read_from_s3_gives_the_local_losses(tmp_path):
    """A mixture of a pretokenized corpus and a JSON-lines file, read from s3:// URLs (copied
    once into the local cache), trains to the very losses of the same files on a local disk."""
    _data(tmp_path / "data")
    mix = '[{{"path": "{0}/corpus", "weight": 1}}, {{"path": "{0}/docs.jsonl", "weight": 1}}]'
    common = [*TRAIN, "--training.steps", "3"]
    local = launch(
        tmp_path / "local", *common, f"--training.datasets={mix.format(tmp_path / 'data')}"
    )
    assert local.returncode == 0, local.stderr[-3000:]
    with s3_server() as s3:
        s3.client().create_bucket(Bucket="data")
        for name in ("corpus.bin", "corpus.idx", "docs.jsonl"):
            s3.client().upload_file(str(tmp_path / "data" / name), "data", f"train/{name}")
        remote = launch(
            tmp_path / "remote",
            *common,
            f"--training.datasets={mix.format('s3://data/train')}",
            **s3.env,
        )
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "Copying s3://data/train/corpus (2 files" in remote.stdout
    assert "Copying s3://data/train/docs.jsonl (1 file" in remote.stdout
    want = tensorboard_scalars_all_runs(tmp_path / "local" / "out")
    got = tensorboard_scalars_all_runs(tmp_path / "remote" / "out")
    assert sorted(got) == [1, 2, 3] and got == want
