"""Reading DCP checkpoints that may come from elsewhere (``initial_load_path``), and the offline
reader of a checkpoint's model weights (for the conversion and generation scripts).

Nothing in a checkpoint is unpickled with the full pickle machinery. Objects go through
``torch.load(weights_only=True)``; DCP's metadata, a plain pickle, through an unpickler that only
builds DCP's metadata classes and plain values.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from torchtitan.checkpoint.collectives import _first_line
from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.remote import StorageError, access_problem, is_url

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


def _enum_member(cls: Any, name: str) -> Any:
    """What some Python versions pickle an enum member as: ``getattr(EnumClass, name)``; only
    members of the allowed enum classes are handed out."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        if (cls.__module__, cls.__qualname__) in _METADATA_GLOBALS:
            return cls.__members__[name]
    raise pickle.UnpicklingError(
        f"getattr({cls!r}, {name!r}) is not allowed in checkpoint metadata"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeMetadata:
    """DCP's reader, with its metadata read by the restricted unpickler (mixed into the local
    and the fsspec reader)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with self.fs.create_stream(self._get_metadata_path(), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def reader_for(path: str) -> dcp.FileSystemReader:
    """The safe reader of the checkpoint in ``path``: a local folder or a URL."""
    return SafeFsspecReader(path) if is_url(path) else SafeFileSystemReader(path)


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _read_metadata(path: str) -> Any:
    """DCP's metadata of the checkpoint in ``path``, read safely; CheckpointError if it is
    missing or unreadable."""
    try:
        return reader_for(path).read_metadata()
    except Exception as e:
        problem = access_problem(e) if is_url(path) else None
        if problem is not None:  # not damage: an older checkpoint would not be reached either
            raise StorageError(f"checkpoint {path} cannot be read: {problem}") from None
        raise CheckpointError(
            f"checkpoint {path} has no readable DCP metadata ({type(e).__name__}: {_first_line(e)})"
        ) from e


def read_model_weights(path: str, progress: Any = None) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint folder, whole, on this one process's CPU (for the
    conversion and generation scripts). ``progress(done, total)`` is called per layer read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(path)
    shapes = {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not shapes:
        raise CheckpointError(f"checkpoint {path} holds no model weights")
    groups: dict[str, list[str]] = {}
    for name in shapes:  # read layer by layer: bounded extra memory, and progress to report
        groups.setdefault(
            ".".join(name.split(".")[:2]) if name.startswith("layers.") else "", []
        ).append(name)
    state: dict[str, torch.Tensor] = {}
    for i, names in enumerate(groups.values()):
        part = {n: torch.empty(shapes[n].size, dtype=shapes[n].properties.dtype) for n in names}
        dcp.load(
            {"model": part},
            storage_reader=reader_for(path),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
        state.update(part)
        if progress is not None:
            progress(i + 1, len(groups))
    return state


def _checkpoint_keys(path: str) -> set[str]:
    """The flattened keys a DCP checkpoint holds (``model.layers.0...``); CheckpointError if its
    metadata is missing or unreadable."""
    return set(_read_metadata(path).state_dict_metadata)


def _check_block_count(path: str, n_layers: int, available: set[str]) -> None:
    """A resume must not quietly drop blocks: a checkpoint of more blocks than the model (e.g.
    ``model.n_layers`` lowered between runs) would otherwise load a prefix of them, since no
    parameter of the model is missing. (Fewer blocks: the rank holding the missing ones finds
    them missing, ``mismatch.from_metadata``.)"""
    blocks = {int(k.split(".")[2]) for k in available if k.startswith("model.layers.")}
    if blocks and max(blocks) >= n_layers:
        raise CheckpointError(
            f"checkpoint {path} holds {max(blocks) + 1} transformer blocks and this model has "
            f"{n_layers}: resume with the model.flavor and model.n_layers it was saved with"
        )
