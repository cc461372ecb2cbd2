"""Checkpoints at a URL, without a server: the same manager and storage code that serve
``s3://`` (``torchtitan.checkpoint.storage``, DCP's fsspec reader and writer) on ``file://``
URLs, fsspec's local filesystem; and the one line each way of not reaching object storage says.
The runs against a real S3-compatible server are in tests/e2e/test_object_storage.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from torchtitan.checkpoint import CheckpointError, read_model_weights, scan, storage
from torchtitan.checkpoint.folder import MARKER, to_purge
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.states import TrainState
from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.optim.lr_scheduling import build_lr_scheduler
from torchtitan.optim.optimizers import Optimizers
from torchtitan.remote import StorageError, access_problem, check_reachable, join


class _Position:
    """The data loader's part of the state: where reading stands."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _manager(folder: str, dump, *args: str) -> tuple[CheckpointManager, nn.Module, _Position]:
    cfg = parse_args(["--checkpoint.enable", f"--checkpoint.folder={folder}", *args])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizers = Optimizers([model], cfg.optimizer)
    position = _Position()
    manager = CheckpointManager(
        cfg.checkpoint,
        dump_folder=str(dump),
        total_steps=100,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=build_lr_scheduler(optimizers.optimizers, cfg.lr_scheduler, 100),
        dataloader=position,
        train_state=TrainState(),
        rank=0,
        world_size=1,
    )
    return manager, model, position


def _train(manager: CheckpointManager, model: nn.Module, position: _Position, step: int) -> None:
    model(torch.ones(3, 4)).sum().backward()
    manager.objects["optimizer"].step()
    manager.objects["optimizer"].zero_grad()
    manager.train_state.step, position.consumed = step, step * 3


def test_save_purge_resume_and_set_aside_at_a_url(tmp_path):
    """Saves at a URL are marked, retention removes the oldest, and a resume from an older step
    (load_step) sets the newer one aside by copying it, marker last, then removing it."""
    url = (tmp_path / "bucket" / "run").as_uri()
    manager, model, position = _manager(url, tmp_path / "out", "--checkpoint.keep_latest_k=2")
    weights = {}
    for step in (5, 10, 15):
        _train(manager, model, position, step)
        assert manager.save(step, model_only=False) == join(url, f"step-{step}")
        weights[step] = [p.detach().clone() for p in model.parameters()]
    assert [(c.step, c.complete) for c in scan(url)] == [(10, True), (15, True)]
    assert not (tmp_path / "out" / "checkpoint").exists()  # a URL is not under the dump folder

    manager, model, position = _manager(url, tmp_path / "out", "--checkpoint.load_step=10")
    assert manager.load()
    assert manager.train_state.step == 10 and position.consumed == 30
    for got, saved in zip(model.parameters(), weights[10]):
        assert torch.equal(got, saved)
    assert [c.step for c in scan(url)] == [10]  # step 15 is no longer this run's history
    aside = tmp_path / "bucket" / "run" / "step-15.superseded"
    assert {p.name for p in aside.iterdir()} == {".metadata", "__0_0.distcp", MARKER}
    assert json.loads((aside / MARKER).read_text())["step"] == 15


def test_an_unmarked_save_at_a_url_is_removed_and_the_marked_one_loaded(tmp_path):
    url = (tmp_path / "run").as_uri()
    manager, model, position = _manager(url, tmp_path / "out")
    _train(manager, model, position, 5)
    manager.save(5, model_only=False)
    manager.save(6, model_only=False)
    (tmp_path / "run" / "step-6" / MARKER).unlink()  # killed before the marker
    manager, model, position = _manager(url, tmp_path / "out")
    assert manager.load() and manager.train_state.step == 5
    assert [c.step for c in scan(url)] == [5] and not (tmp_path / "run" / "step-6").exists()


def test_model_weights_read_from_a_url(tmp_path):
    url = (tmp_path / "run").as_uri()
    manager, model, _ = _manager(url, tmp_path / "out")
    manager.save(1, model_only=True)
    state = read_model_weights(join(url, "step-1"))
    assert torch.equal(state["0.weight"], model[0].weight.detach())
    with pytest.raises(CheckpointError, match="has no readable DCP metadata"):
        read_model_weights(join(url, "step-2"))


def test_storage_operations_on_a_url(tmp_path):
    url = (tmp_path / "store").as_uri()
    assert storage.list_dirs(url) == [] and storage.read_bytes(join(url, "x")) is None
    storage.write_atomic(join(url, "a", MARKER), b'{"step": 1}')
    storage.write_atomic(join(url, "a", "data"), b"123")
    assert storage.list_dirs(url) == ["a"] and storage.read_bytes(join(url, "a", "data")) == b"123"
    storage.move(join(url, "a"), join(url, "b"), last=MARKER)
    assert storage.list_dirs(url) == ["b"]
    assert sorted(p.name for p in (tmp_path / "store" / "b").iterdir()) == [MARKER, "data"]
    storage.remove(join(url, "b"), first=MARKER)
    assert storage.list_dirs(url) == [] and not storage.exists(join(url, "b"))


def test_retention_compares_urls_as_written():
    from torchtitan.checkpoint.folder import Found

    found = [Found(s, f"s3://b/run/step-{s}", True) for s in (1, 2, 3)]
    assert [c.step for c in to_purge(found, 1, "s3://b/run/step-3/")] == [1, 2]


def test_urls_fsspec_cannot_open_are_one_line():
    with pytest.raises(ConfigError, match=r"checkpoint.folder: 'nosuch://b/x' is not a URL"):
        check_reachable("nosuch://b/x", "checkpoint.folder")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"'gs://b/x' needs gcsfs .*pip install gcsfs"):
            check_reachable("gs://b/x", "checkpoint.folder")
    check_reachable("file:///nonexistent/folder", "checkpoint.folder")  # may be created


def test_what_keeps_object_storage_out_of_reach():
    """botocore's own exceptions (raised through s3fs, sometimes as the cause of an OSError)."""
    botocore = pytest.importorskip("botocore.exceptions")
    no_creds = OSError("listing failed")
    no_creds.__cause__ = botocore.NoCredentialsError()
    assert "no credentials were found" in access_problem(no_creds)
    down = botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    assert "does not answer" in access_problem(down)
    assert "access was denied" in access_problem(PermissionError("Access Denied"))
    assert access_problem(FileNotFoundError("no such key")) is None
    assert issubclass(StorageError, ConfigError)  # one line, exit code 2, no fall-back


def test_a_hugging_face_folder_at_a_url_is_refused():
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path: 's3://b/m' is a URL"):
        parse_args(
            [
                "--checkpoint.enable",
                "--checkpoint.initial_load_in_hf",
                "--checkpoint.initial_load_path=s3://b/m",
            ]
        )


@pytest.fixture
def local_fs_calls(monkeypatch):
    """fsspec's local filesystem (what file:// URLs use), its copies, uploads and removals
    recorded in order; ``fail`` names files whose removal raises PermissionError."""
    from fsspec.implementations.local import LocalFileSystem

    calls: list[tuple[str, str]] = []
    fail: set[str] = set()
    for name in ("copy", "put_file", "rm_file"):
        original = getattr(LocalFileSystem, name)

        def record(self, path, *args, _name=name, _original=original, **kwargs):
            target = args[0] if _name != "rm_file" and args else path
            calls.append((_name, str(target).rsplit("/", 1)[-1]))
            if _name == "rm_file" and str(path).rsplit("/", 1)[-1] in fail:
                raise PermissionError("Access Denied")
            return _original(self, path, *args, **kwargs)

        monkeypatch.setattr(LocalFileSystem, name, record)
    return calls, fail


def _marked_folder(url: str) -> None:
    storage.write_atomic(join(url, "zz.distcp"), b"data")
    storage.write_atomic(join(url, MARKER), b"{}")
    storage.write_atomic(join(url, "AA.metadata"), b"meta")


def test_the_marker_is_removed_first_and_copied_last(tmp_path, local_fs_calls):
    calls, fail = local_fs_calls
    src, dest = (tmp_path / "s").as_uri(), (tmp_path / "d").as_uri()
    _marked_folder(src)
    calls.clear()
    storage.move(src, dest, last=MARKER)
    copies = [name for op, name in calls if op == "copy"]
    assert copies[-1] == MARKER and sorted(copies) == sorted(["AA.metadata", MARKER, "zz.distcp"])
    assert calls[len(copies)] == ("rm_file", MARKER)  # then the source's marker, first
    assert not (tmp_path / "s").exists() and (tmp_path / "d" / MARKER).exists()


def test_a_marker_that_cannot_be_removed_keeps_its_folder_whole(tmp_path, local_fs_calls):
    _, fail = local_fs_calls
    url = (tmp_path / "s").as_uri()
    _marked_folder(url)
    fail.add(MARKER)
    assert storage.remove(url, first=MARKER) is False
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "AA.metadata",
        MARKER,
        "zz.distcp",
    ]
    with pytest.raises(OSError, match="cannot be removed"):
        storage.move(url, (tmp_path / "d").as_uri(), last=MARKER)
    assert (tmp_path / "s" / MARKER).exists()  # still the one marked copy it was


def test_an_export_is_uploaded_with_its_config_last(tmp_path, local_fs_calls):
    calls, _ = local_fs_calls
    local = tmp_path / "staging"
    local.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (local / name).write_text(name)
    storage.publish(str(local), (tmp_path / "out" / "step-1-hf").as_uri(), last="config.json")
    uploads = [name for op, name in calls if op == "put_file"]
    assert uploads[-1] == "config.json" and len(uploads) == 3 and not local.exists()


def test_a_marker_storage_fails_to_return_is_not_a_missing_marker(tmp_path, monkeypatch):
    from fsspec.implementations.local import LocalFileSystem

    from torchtitan.checkpoint.folder import read_marker

    url = (tmp_path / "s").as_uri()
    _marked_folder(url)

    def unavailable(self, path, *args, **kwargs):
        raise OSError(5, "503 SlowDown, retries exhausted")

    monkeypatch.setattr(LocalFileSystem, "cat_file", unavailable)
    with pytest.raises(StorageError, match="its COMPLETE cannot be read"):
        read_marker(url)


def test_a_storage_error_dcp_gathered_from_the_ranks_is_recognised():
    from torch.distributed.checkpoint.api import CheckpointException

    botocore = pytest.importorskip("botocore.exceptions")
    gathered = CheckpointException(
        "load", {1: (botocore.NoCredentialsError(), None), 0: (OSError("x"), None)}
    )
    assert "no credentials were found" in access_problem(gathered)
    denied = CheckpointException("load", {0: (PermissionError("Access Denied"), None)})
    assert "access was denied" in access_problem(denied)
