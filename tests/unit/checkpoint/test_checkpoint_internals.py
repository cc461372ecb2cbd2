"""The checkpoint package's parts, in this process (no torch.distributed process group): the folder
scan and the COMPLETE marker, the choices of what to resume from, set aside and purge, where the
Hugging Face weights come from, the safe metadata unpickler, and the manager's save / load on a
tiny model through single-process DCP."""

from __future__ import annotations

import io
import json
import os
import pickle
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from log_capture import logged

from torchtitan.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointManager,
    TrainState,
    hf_load_source,
    read_model_weights,
    scan,
)
from torchtitan.checkpoint.folder import (
    Found,
    fall_back,
    read_marker,
    requested,
    resume_candidates,
    set_aside,
    step_path,
    to_purge,
    write_marker,
)
from torchtitan.checkpoint.hf_exchange import ExportRanks, make_adapter
from torchtitan.checkpoint.safe_read import (
    _check_block_count,
    _checkpoint_keys,
    _MetadataUnpickler,
)
from torchtitan.config.schema import JobConfig

# the manager calls dcp.save / dcp.load without a process group: DCP says it assumes one process
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def log_lines():
    """The messages the ``torchtitan`` logger emits during the test (whatever its handlers)."""
    with logged(with_level=True) as lines:
        yield lines


def _step_dir(folder: Path, step: int, marker: str | None = None, name: str | None = None) -> Path:
    path = folder / (name or f"step-{step}")
    path.mkdir(parents=True)
    if marker is not None:
        (path / MARKER).write_text(marker)
    return path


def _found(step: int, model_only: bool = False, complete: bool = True) -> Found:
    return Found(step, f"/ckpt/step-{step}", complete, model_only)


# ----------------------------------------------------------------------------- scan and marker


def test_scan_orders_by_step_number_and_reads_each_marker(tmp_path):
    _step_dir(tmp_path, 100, '{"step": 100, "model_only": false, "world_size": 4}')
    _step_dir(tmp_path, 2, '{"step": 2, "model_only": true, "world_size": 1}')
    _step_dir(tmp_path, 10)  # a save that did not finish: data, no marker
    (tmp_path / "step-10" / "__0_0.distcp").write_bytes(b"partial")
    assert scan(str(tmp_path)) == [
        Found(2, str(tmp_path / "step-2"), True, True),
        Found(10, str(tmp_path / "step-10"), False, False),
        Found(100, str(tmp_path / "step-100"), True, False),
    ]


def test_scan_ignores_everything_but_step_number_folders(tmp_path):
    good = '{"step": 1, "model_only": false, "world_size": 1}'
    _step_dir(tmp_path, 3, good)
    for name in (
        "step-x",
        "step-",
        "Step-4",
        "step--5",
        "step-5.superseded",
        "step-6.unloadable",
        "step-7-hf",
        "step-7-hf.partial",
        "checkpoint",
        "step-8 ",
    ):
        _step_dir(tmp_path, 0, good, name=name)
    (tmp_path / "step-9").write_text(good)  # a file, not a folder
    assert [(c.step, c.complete) for c in scan(str(tmp_path))] == [(3, True)]


def test_scan_of_a_missing_folder_is_empty(tmp_path):
    assert scan(str(tmp_path / "nothing")) == []


@pytest.mark.parametrize(
    "marker, complete, model_only",
    [
        ('{"step": 5, "model_only": true, "world_size": 2}', True, True),
        ('{"step": 5, "world_size": 2}', True, False),  # model_only absent: a full checkpoint
        ("{", False, False),  # unreadable: no marker
        ("", False, False),
        ("{}", False, False),  # says nothing: no marker
        (None, False, False),
    ],
)
def test_what_the_marker_says(tmp_path, marker, complete, model_only):
    _step_dir(tmp_path, 5, marker)
    assert scan(str(tmp_path)) == [Found(5, str(tmp_path / "step-5"), complete, model_only)]


def test_a_folder_named_like_the_marker_is_no_marker(tmp_path):
    (_step_dir(tmp_path, 5) / MARKER).mkdir()
    assert read_marker(str(tmp_path / "step-5")) == {}
    assert [c.complete for c in scan(str(tmp_path))] == [False]


def test_write_marker_then_read_it(tmp_path):
    path = _step_dir(tmp_path, 12)
    assert read_marker(str(path)) == {}
    write_marker(str(path), 12, False, 8)
    assert MARKER == "COMPLETE"
    assert json.loads((path / "COMPLETE").read_text()) == {
        "step": 12,
        "model_only": False,
        "world_size": 8,
    }
    assert sorted(os.listdir(path)) == ["COMPLETE"]  # the temporary file was renamed
    assert read_marker(str(path)) == {"step": 12, "model_only": False, "world_size": 8}
    write_marker(str(path), 12, True, 1)  # a second write replaces the first
    assert read_marker(str(path)) == {"step": 12, "model_only": True, "world_size": 1}
    assert scan(str(tmp_path)) == [Found(12, str(path), True, True)]


def test_step_path():
    assert step_path("/out/checkpoint", 40) == os.path.join("/out/checkpoint", "step-40")


# ----------------------------------------------------------------------------- what to resume from


def test_resume_candidates_skip_model_only_saves_but_not_a_seed():
    complete = [_found(0, True), _found(5), _found(10, True), _found(15)]
    candidates, skipped = resume_candidates(complete)
    assert [c.step for c in candidates] == [0, 5, 15]
    assert skipped == [_found(10, True)]
    assert resume_candidates([]) == ([], [])


def test_requested_step():
    complete = [_found(5), _found(10)]
    assert requested(complete, 10, "/ckpt") == _found(10)
    with pytest.raises(CheckpointError) as e:
        requested(complete, 7, "/ckpt")
    assert str(e.value) == (
        "checkpoint.load_step: no complete checkpoint for step 7 in /ckpt (complete steps: 5, 10)"
    )
    with pytest.raises(CheckpointError) as e:
        requested([], 7, "/ckpt")
    assert str(e.value).endswith("(complete steps: none)")


def _loader(bad: set[int], tried: list[int]):
    def load(c: Found) -> None:
        tried.append(c.step)
        if c.step in bad:
            raise CheckpointError(f"checkpoint {c.path} cannot be loaded (OSError: truncated)")

    return load


def test_fall_back_loads_the_newest_when_it_loads():
    tried: list[int] = []
    assert fall_back([_found(5), _found(10)], _loader(set(), tried)) == (_found(10), [])
    assert tried == [10]


def test_fall_back_passes_a_damaged_newest_and_says_so(log_lines):
    tried: list[int] = []
    loaded, failed = fall_back([_found(5), _found(10), _found(15)], _loader({15, 10}, tried))
    assert tried == [15, 10, 5]
    assert loaded == _found(5)
    assert failed == [_found(15), _found(10)]
    assert log_lines == [
        "WARNING checkpoint /ckpt/step-15 cannot be loaded (OSError: truncated); "
        "falling back to the checkpoint before it",
        "WARNING checkpoint /ckpt/step-10 cannot be loaded (OSError: truncated); "
        "falling back to the checkpoint before it",
    ]


def test_fall_back_raises_the_oldest_error_when_none_loads():
    tried: list[int] = []
    with pytest.raises(CheckpointError) as e:
        fall_back([_found(5), _found(10)], _loader({5, 10}, tried))
    assert tried == [10, 5]
    assert str(e.value) == "checkpoint /ckpt/step-5 cannot be loaded (OSError: truncated)"


def test_fall_back_without_candidates_loads_nothing():
    tried: list[int] = []
    assert fall_back([], _loader(set(), tried)) == (None, [])
    assert tried == []


def test_fall_back_only_past_checkpoint_errors():
    def load(c: Found) -> None:
        raise RuntimeError("a bug, not a damaged checkpoint")

    with pytest.raises(RuntimeError):
        fall_back([_found(5), _found(10)], load)


def test_set_aside_everything_after_the_step_the_run_continues_from():
    complete = [_found(5), _found(10), _found(15), _found(20, True)]
    assert set_aside(complete, 10, [_found(15)]) == [
        (_found(15), "unloadable"),
        (_found(20, True), "superseded"),
    ]
    # a fresh start (step 0) over old model-only saves sets all of them aside
    assert set_aside([_found(5, True)], 0, []) == [(_found(5, True), "superseded")]
    assert set_aside(complete, 20, []) == []


def test_the_whole_choice_over_a_real_folder(tmp_path):
    """scan -> candidates -> fall-back -> set aside, as CheckpointManager.load takes them."""
    for step in (5, 10, 15):
        _step_dir(tmp_path, step, json.dumps({"step": step, "model_only": False}))
    _step_dir(tmp_path, 12, json.dumps({"step": 12, "model_only": True}))
    _step_dir(tmp_path, 20)  # incomplete
    found = scan(str(tmp_path))
    complete = [c for c in found if c.complete]
    candidates, skipped = resume_candidates(complete)
    assert [c.step for c in candidates] == [5, 10, 15] and [c.step for c in skipped] == [12]
    tried: list[int] = []
    loaded, failed = fall_back(candidates, _loader({15}, tried))
    assert loaded is not None and loaded.step == 10
    assert [(c.step, why) for c, why in set_aside(complete, loaded.step, failed)] == [
        (12, "superseded"),
        (15, "unloadable"),
    ]


# ----------------------------------------------------------------------------- retention


def test_retention_keeps_the_newest_k_of_each_kind():
    found = [_found(0, True), _found(5), _found(10), _found(15, True), _found(20)]
    assert to_purge(found, 1, "/ckpt/step-20") == [_found(5), _found(10), _found(0, True)]
    assert to_purge(found, 2, "/ckpt/step-20") == [_found(5)]
    assert to_purge(found, 3, "/ckpt/step-20") == []


def test_retention_counts_a_seed_among_the_model_only_saves():
    found = [_found(0, True), _found(5), _found(10, True)]
    assert to_purge(found, 1, "/ckpt/step-10") == [_found(0, True)]
    assert to_purge(found, 1, "/ckpt/step-5") == [_found(0, True)]


def test_retention_never_removes_the_one_just_written():
    found = [_found(5), _found(10), _found(15), _found(20)]
    assert to_purge(found, 2, "/ckpt/step-5") == [_found(10)]  # step-5 was just written


def test_retention_leaves_incomplete_folders_alone_and_does_not_count_them():
    found = [_found(5), _found(10), _found(15), _found(20, complete=False)]
    assert to_purge(found, 1, "/ckpt/step-15") == [_found(5), _found(10)]
    # an older folder without its marker (a save being written) is not removed
    found = [_found(5, complete=False), _found(10), _found(15)]
    assert to_purge(found, 1, "/ckpt/step-15") == [_found(10)]
    # nor does one count among the k kept
    found = [_found(5), _found(10), _found(20, complete=False)]
    assert to_purge(found, 2, "/ckpt/step-10") == []


def test_retention_zero_keeps_all():
    assert to_purge([_found(5), _found(10)], 0, "/ckpt/step-10") == []


def test_retention_compares_whole_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = [Found(5, "ckpt/step-5", True), Found(10, "ckpt/step-10", True)]
    assert to_purge(found, 1, str(tmp_path / "ckpt" / "step-5")) == []
    assert to_purge(found, 1, str(tmp_path / "ckpt" / "step-10")) == [found[0]]


# ----------------------------------------------------------------------------- Hugging Face


def test_hf_load_source_precedence():
    cfg = JobConfig()
    assert hf_load_source(cfg.checkpoint, cfg.model) is None
    cfg.model.hf_assets_path = "assets/hf/Llama-3.2-1B"
    assert hf_load_source(cfg.checkpoint, cfg.model) == (
        "assets/hf/Llama-3.2-1B",
        "model.hf_assets_path",
    )
    cfg.checkpoint.initial_load_path = "weights"
    assert hf_load_source(cfg.checkpoint, cfg.model) == ("weights", "checkpoint.initial_load_path")
    cfg.model.hf_assets_path = None
    assert hf_load_source(cfg.checkpoint, cfg.model) == ("weights", "checkpoint.initial_load_path")
    cfg.checkpoint.initial_load_path = ""  # empty: unset
    assert hf_load_source(cfg.checkpoint, cfg.model) is None
    # a model config without the key at all
    bare = types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(initial_load_path=None), model=types.SimpleNamespace()
    )
    assert hf_load_source(bare.checkpoint, bare.model) is None


def test_a_family_without_an_adapter_is_named_by_the_key():
    with pytest.raises(CheckpointError) as e:
        make_adapter(None, None, "checkpoint.last_save_in_hf")
    assert str(e.value) == (
        "checkpoint.last_save_in_hf: this model family has no Hugging Face state-dict adapter "
        "in its model spec"
    )
    assert make_adapter(lambda args: ("adapter", args), 7, "k") == ("adapter", 7)


def test_export_ranks_first_rank_of_each_stage_writes():
    ranks = [ExportRanks(r, 4, r // 2, 2) for r in range(4)]
    assert [r.stage_writer for r in ranks] == [True, False, True, False]
    assert ranks[2].stage_file == "model-00002-of-00002.safetensors"
    assert ExportRanks(0, 1).stage_file == "model-00001-of-00001.safetensors"
    assert [ExportRanks(r, 2).stage_writer for r in range(2)] == [True, False]


# ----------------------------------------------------------------------------- safe reading


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _unpickle(obj) -> object:
    return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()


def test_the_unpickler_refuses_classes_outside_dcp_metadata(tmp_path):
    victim = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError) as e:
        _unpickle(_RunsCode(str(victim)))
    assert str(e.value) == "posix.mkdir is not allowed in checkpoint metadata"
    assert not victim.exists()
    import collections

    with pytest.raises(pickle.UnpicklingError) as e:
        _unpickle(collections.Counter(a=1))
    assert str(e.value) == "collections.Counter is not allowed in checkpoint metadata"


class _Getattr:
    def __reduce__(self):
        return (getattr, (Path, "cwd"))


def test_the_unpickler_hands_out_only_enum_members():
    with pytest.raises(pickle.UnpicklingError) as e:
        _unpickle(_Getattr())
    assert (
        str(e.value)
        == "getattr(<class 'pathlib.Path'>, 'cwd') is not allowed in checkpoint metadata"
    )


def test_the_unpickler_builds_allowed_values():
    from collections import OrderedDict

    value = OrderedDict(size=torch.Size([2, 3]), dtype=torch.bfloat16, path=Path("/a/b"))
    assert _unpickle(value) == value


def test_checkpoint_keys_of_a_hostile_metadata_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(tmp_path / "pwned"))))
    with pytest.raises(CheckpointError) as e:
        _checkpoint_keys(str(tmp_path))
    assert str(e.value) == (
        f"checkpoint {tmp_path} has no readable DCP metadata "
        "(UnpicklingError: posix.mkdir is not allowed in checkpoint metadata)"
    )
    assert not (tmp_path / "pwned").exists()


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "tok_embeddings.weight": torch.randn(5, 3, generator=g),
        "layers.0.w": torch.randn(3, 3, generator=g),
        "layers.1.w": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(3),
    }


def test_a_real_checkpoint_reads_back_safely(tmp_path):
    weights = _weights()
    dcp.save(
        {"model": weights, "train_state": {"step": 3}}, checkpoint_id=str(tmp_path), no_dist=True
    )
    assert _checkpoint_keys(str(tmp_path)) == {
        "model.tok_embeddings.weight",
        "model.layers.0.w",
        "model.layers.1.w",
        "model.norm.weight",
        "train_state.step",
    }
    calls: list[tuple[int, int]] = []
    back = read_model_weights(
        str(tmp_path), progress=lambda done, total: calls.append((done, total))
    )
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) and back[k].dtype == weights[k].dtype for k in back)
    assert calls == [(1, 3), (2, 3), (3, 3)]  # the non-layer tensors, then each layer


def test_model_key_and_block_count_checks():
    available = {"model.layers.0.w", "model.layers.1.w", "model.norm.weight"}
    _check_block_count("/c", 2, available)
    with pytest.raises(CheckpointError) as e:
        _check_block_count("/c", 1, available)
    assert str(e.value) == (
        "checkpoint /c holds 2 transformer blocks and this model has 1: resume with the "
        "model.flavor and model.n_layers it was saved with"
    )


# ----------------------------------------------------------------------------- the manager, in-process


class _Stateful:
    """Stands in for the optimizer, LR scheduler and data loader: one tensor of state."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])
        self.resets = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].clone()

    def reset_state(self) -> None:
        self.resets += 1


def _manager(
    tmp_path: Path, value: float, extra: dict | None = None, **checkpoint
) -> tuple[CheckpointManager, nn.Module]:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.checkpoint.enable = True
    cfg.training.steps = 100
    for k, v in checkpoint.items():
        setattr(cfg.checkpoint, k, v)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    manager = CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        model_parts=[model],
        optimizers=_Stateful(value),
        lr_schedulers=_Stateful(value),
        dataloader=_Stateful(value),
        train_state=TrainState(),
        rank=0,
        world_size=1,
        extra_states=extra,
    )
    return manager, model


def _save(manager: CheckpointManager, model: nn.Module, step: int, **kw) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    manager.train_state.step, manager.train_state.ntokens_seen = step, 10 * step
    manager.save(step, model_only=kw.get("model_only", False))


def test_manager_saves_marks_and_keeps_the_newest_k(tmp_path, log_lines):
    manager, model = _manager(tmp_path, 0.0, keep_latest_k=2)
    for step in (5, 10, 15):
        _save(manager, model, step)
    folder = tmp_path / "checkpoint"
    assert [(c.step, c.complete, c.model_only) for c in scan(str(folder))] == [
        (10, True, False),
        (15, True, False),
    ]
    assert json.loads((folder / "step-15" / "COMPLETE").read_text()) == {
        "step": 15,
        "model_only": False,
        "world_size": 1,
    }
    assert f"INFO Removed checkpoint {folder / 'step-5'} (keeping the newest 2 resumable ones)" in (
        log_lines
    )
    assert manager.newest_complete() == str(folder / "step-15")


def test_extra_states_are_saved_and_a_checkpoint_without_them_still_loads(tmp_path, log_lines):
    """What a feature adds to the training state (DiLoCo's) is saved under its name; resuming a
    checkpoint written without it loads the rest and leaves it as it was."""
    saver, model = _manager(tmp_path / "a", 0.0, extra={"diloco": _Stateful(3.0)})
    _save(saver, model, 5)
    loader, _ = _manager(tmp_path / "a", 0.0, extra={"diloco": _Stateful(0.0)})
    assert loader.load() and loader.objects["diloco"].value.item() == 3.0
    plain, model = _manager(tmp_path / "b", 0.0)
    _save(plain, model, 5)
    loader, _ = _manager(tmp_path / "b", 0.0, extra={"diloco": _Stateful(1.0)})
    assert loader.load() and loader.train_state.step == 5
    assert loader.objects["diloco"].value.item() == 1.0
    folder = tmp_path / "b" / "checkpoint" / "step-5"
    assert f"INFO {folder}: no diloco state (saved without it); diloco starts afresh" in log_lines


def test_manager_resumes_from_the_newest_that_loads(tmp_path, log_lines):
    first, model = _manager(tmp_path, 0.0, keep_latest_k=0)
    for step in (5, 10, 15):
        _save(first, model, step)
    folder = tmp_path / "checkpoint"
    data = next((folder / "step-15").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])  # truncated
    _step_dir(folder, 20)  # a save that never finished

    log_lines.clear()
    second, model = _manager(tmp_path, -1.0)
    assert second.load() is True
    assert second.train_state.state_dict() == {"step": 10, "ntokens_seen": 100}
    assert torch.equal(model.weight, torch.full((2, 3), 10.0))
    assert second.objects["optimizer"].resets == 0  # a full state was loaded
    assert sorted(os.listdir(folder)) == ["step-10", "step-15.unloadable", "step-5"]
    assert (
        log_lines[0]
        == f"WARNING Removing incomplete checkpoint {folder / 'step-20'} (no COMPLETE marker)"
    )
    assert log_lines[1].startswith(f"WARNING checkpoint {folder / 'step-15'} cannot be loaded (")
    assert log_lines[1].endswith("); falling back to the checkpoint before it")
    assert log_lines[2].startswith(
        f"INFO Loaded training state from {folder / 'step-10'} (step 10) in "
    )
    assert log_lines[3] == (
        f"WARNING Moved {folder / 'step-15'} to {folder / 'step-15.unloadable'}: this run "
        "continues from step 10, so later checkpoints in the folder are no longer part of its history"
    )


def test_manager_starts_from_a_seed_and_sets_model_only_saves_aside(tmp_path, log_lines):
    first, model = _manager(tmp_path, 0.0, keep_latest_k=0)
    _save(first, model, 0, model_only=True)  # the seed
    _save(first, model, 5, model_only=True)  # an export: not a resume point
    log_lines.clear()
    second, model = _manager(tmp_path, -1.0)
    assert second.load() is True
    assert second.train_state.state_dict() == {"step": 0, "ntokens_seen": 0}
    assert torch.equal(model.weight, torch.zeros(2, 3))
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-0", "step-5.superseded"]
    assert (
        log_lines[0]
        == f"INFO Checkpoint {folder / 'step-5'} holds model weights only: not a resume point"
    )


def test_manager_load_step_that_is_missing(tmp_path):
    first, model = _manager(tmp_path, 0.0)
    _save(first, model, 5)
    second, _ = _manager(tmp_path, 0.0, load_step=7)
    with pytest.raises(CheckpointError) as e:
        second.load()
    assert str(e.value) == (
        f"checkpoint.load_step: no complete checkpoint for step 7 in {tmp_path / 'checkpoint'} "
        "(complete steps: 5)"
    )


def test_manager_without_checkpoints_starts_fresh(tmp_path):
    manager, _ = _manager(tmp_path, 0.0)
    assert manager.load() is False
    assert manager.newest_complete() is None
    assert manager.hf_load_path is None


# ----------------------------------------------------------------------------- older layouts


def test_a_checkpoint_with_separate_wq_wk_wv_is_read_by_parts_and_merged():
    from torchtitan.checkpoint.unfused import apply_merges, plan_unfused_load
    from torchtitan.models.common.blocks import split_qkv
    from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
    from torchtitan.models.llama.model import ModelArgs

    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16)
    adapter = LlamaStateDictAdapter(args)
    fused = "layers.0.attention.wqkv.weight"
    saved = torch.randn(64, 32)  # what the checkpoint's wq/wk/wv hold, fused
    moment = torch.randn(64, 32)
    old = dict(zip(("wq", "wk", "wv"), split_qkv(saved, 4, 2)))
    old_moment = dict(zip(("wq", "wk", "wv"), split_qkv(moment, 4, 2)))
    available = (
        {f"model.layers.0.attention.{n}.weight" for n in old}
        | {
            f"optimizer.state.layers.0.attention.{n}.weight.{k}"
            for n in old
            for k in ("exp_avg", "step")
        }
        | {"model.norm.weight"}
    )
    state = {
        "model": {fused: torch.zeros(64, 32), "norm.weight": torch.zeros(32)},
        "optimizer": {
            f"state.{fused}.exp_avg": torch.zeros(64, 32),
            f"state.{fused}.step": torch.tensor(0.0),
        },
    }
    merges = plan_unfused_load(state, available, adapter)
    assert len(merges) == 3 and fused not in state["model"]
    assert state["model"]["layers.0.attention.wk.weight"].shape == (16, 32)
    assert "state.layers.0.attention.wq.weight.step" in state["optimizer"]
    # what dcp.load would fill in
    for n, w in old.items():
        state["model"][f"layers.0.attention.{n}.weight"].copy_(w)
        state["optimizer"][f"state.layers.0.attention.{n}.weight.exp_avg"].copy_(old_moment[n])
    state["optimizer"]["state.layers.0.attention.wq.weight.step"] = torch.tensor(7.0)
    apply_merges(state, merges, adapter)
    assert torch.equal(state["model"][fused], saved)
    assert torch.equal(state["optimizer"][f"state.{fused}.exp_avg"], moment)
    assert state["optimizer"][f"state.{fused}.step"].item() == 7.0
    assert sorted(state["model"]) == sorted([fused, "norm.weight"])


def test_a_checkpoint_lacking_a_fused_entry_and_its_parts_is_not_rewritten():
    from torchtitan.checkpoint.unfused import plan_unfused_load
    from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
    from torchtitan.models.llama.model import ModelArgs

    adapter = LlamaStateDictAdapter(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=16))
    state = {"model": {"layers.0.attention.wqkv.weight": torch.zeros(96, 32)}}
    assert plan_unfused_load(state, {"model.layers.0.attention.wq.weight"}, adapter) == []
    assert "layers.0.attention.wqkv.weight" in state["model"]  # the missing-key error reports it


def test_checkpoints_left_in_the_folder_with_checkpointing_off_are_named_once(tmp_path, log_lines):
    manager, model = _manager(tmp_path, 0.0)
    for step in (5, 10):
        _save(manager, model, step)
    _save(manager, model, 15, model_only=True)  # an export, not a resume point
    off, _ = _manager(tmp_path, 1.0, enable=False)
    log_lines.clear()
    assert off.load() is False
    newest = tmp_path / "checkpoint" / "step-10"
    assert log_lines == [
        f"WARNING {tmp_path / 'checkpoint'} holds checkpoints (the newest: {newest}) but "
        "checkpoint.enable is false: this run starts from step 1 and saves none; pass "
        "--checkpoint.enable to resume from the newest"
    ]
    empty, _ = _manager(tmp_path / "fresh", 1.0, enable=False)
    log_lines.clear()
    assert empty.load() is False and log_lines == []
