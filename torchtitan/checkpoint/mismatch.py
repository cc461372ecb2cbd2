"""A checkpoint of another configuration: found before anything is read, said in one line per
difference with the key to pass, and never taken for a damaged checkpoint (the manager falls back
past damaged ones only).

What a resume needs to match is recorded in the checkpoint's marker when it is written
(:func:`run_facts`: the global batch, the model family and flavor, its vocabulary, the optimizer)
and compared with this run's. Whatever those facts do not explain is found in DCP's metadata: the
entries this rank would load that the checkpoint lacks, and model weights of another shape.
Checkpoints written before the facts were recorded get the metadata checks alone (their data
loader's shard count still gives their global batch).
"""

from __future__ import annotations

from typing import Any

from torchtitan.errors import TorchTitanError

_BATCH = "training.global_batch_size"


class CheckpointMismatch(TorchTitanError):
    """The checkpoint was written by another configuration: one line per difference."""

    exit_code = 2
    names_rank = False  # every rank reports the lines the ranks agreed on


def run_facts(
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp: int,
    model_name: str,
    flavor: str,
    vocab_size: int,
    parameters: int,
    optimizer: str,
) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it, for the next run to compare (the
    local batch and data-parallel degree only inform: they may change on a resume)."""
    return {
        _BATCH: global_batch_size,
        "training.local_batch_size": local_batch_size,
        "dp": dp,
        "model.name": model_name,
        "model.flavor": flavor,
        "vocab_size": vocab_size,
        "parameters": parameters,
        "optimizer.name": optimizer,
    }


def check(
    path: str, saved: dict[str, Any], now: dict[str, Any], flat: dict[str, Any], metadata: Any
) -> tuple[str, str] | None:
    """``("mismatch", lines)`` for a checkpoint of another configuration, ``("damaged", line)``
    for one that lacks what its own recorded run wrote, else None. ``saved``: the facts in its
    marker (``{}`` before they were recorded); ``flat``: what this rank would load (flattened
    keys); ``metadata``: DCP's ``state_dict_metadata``."""
    lines = from_facts(path, saved, now)
    if lines:
        return "mismatch", "\n".join(lines)
    missing = [k for k in flat if k not in metadata]
    shapes = _shape_lines(path, flat, metadata)
    if saved:  # the same run's configuration: what is missing or misshapen was lost
        if missing:
            what = "parameters" if all(k.startswith("model.") for k in missing) else "entries"
            return "damaged", (
                f"checkpoint {path} lacks {len(missing)} {what} that the run which wrote it "
                f"saves ({missing[0]}): its metadata is damaged"
            )
        return ("damaged", shapes[0]) if shapes else None
    lines = from_metadata(path, flat, metadata)
    return ("mismatch", "\n".join(lines)) if lines else None


def from_facts(path: str, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The differences the recorded facts name, one line each."""
    lines = []
    if _differ(saved, now, _BATCH):
        lines.append(_batch_line(path, saved[_BATCH], now))
    if _differ(saved, now, "model.name") or _differ(saved, now, "model.flavor"):
        was, is_ = (f"{f['model.name']} '{f['model.flavor']}'" for f in (saved, now))
        key = "model.name" if _differ(saved, now, "model.name") else "model.flavor"
        lines.append(
            f"{key}: {path} holds a {was} model and this run builds {is_}; pass "
            f"--model.name {saved['model.name']} --model.flavor {saved['model.flavor']} to "
            "resume it"
        )
    elif _differ(saved, now, "vocab_size"):
        lines.append(
            f"model.tokenizer_path: {path} was trained with a vocabulary of {saved['vocab_size']:,} "
            f"tokens and this run's tokenizer has {now['vocab_size']:,}; resume with the "
            "tokenizer it was trained with"
        )
    elif _differ(saved, now, "parameters"):
        lines.append(
            f"model.flavor: {path} holds a {saved['model.name']} '{saved['model.flavor']}' of "
            f"{saved['parameters']:,} parameters and this run builds one of {now['parameters']:,}: "
            "resume with the model overrides it was trained with (model.n_layers, model.dim, ...)"
        )
    if _differ(saved, now, "optimizer.name"):
        lines.append(
            f"optimizer.name: {path} holds {saved['optimizer.name']}'s state and this run uses "
            f"{now['optimizer.name']}; pass --optimizer.name {saved['optimizer.name']} to resume "
            "it, or --checkpoint.exclude_from_loading optimizer to start the optimizer afresh"
        )
    return lines


def _differ(saved: dict[str, Any], now: dict[str, Any], key: str) -> bool:
    return key in saved and key in now and saved[key] != now[key]


def _batch_line(path: str, saved: int, now: dict[str, Any]) -> str:
    return (
        f"{_BATCH}: {path} was trained with a global batch of {saved} sequences and this run "
        f"has {now[_BATCH]} (by default local_batch_size x the data-parallel degree, which "
        f"changes with the number of processes); {_batch_fix(saved, now)} to continue it "
        "exactly, or --checkpoint.exclude_from_loading dataloader to start the data over with "
        "the new batch"
    )


def _batch_fix(saved: int, now: dict[str, Any]) -> str:
    """The arguments that give this run the saved global batch: the batch alone when the local
    batch x data-parallel degree divides it, else a smaller local batch too."""
    local, dp = now.get("training.local_batch_size"), now.get("dp")
    if not local or not dp or saved % (local * dp) == 0:
        return f"pass --{_BATCH} {saved}"
    if saved % dp:
        return (
            f"a data-parallel degree that divides {saved} (this run's is {dp}) with --{_BATCH} "
            f"{saved} is needed"
        )
    fits = max(d for d in range(1, min(local, saved // dp) + 1) if (saved // dp) % d == 0)
    return f"pass --{_BATCH} {saved} --training.local_batch_size {fits}"


def from_metadata(path: str, flat_state: dict[str, Any], metadata: dict[str, Any]) -> list[str]:
    """The differences DCP's metadata shows for what this rank would load, for a checkpoint
    without recorded facts (``flat_state``: flattened keys -> tensors or objects; ``metadata``:
    the checkpoint's ``state_dict_metadata``)."""
    lines = []
    missing: dict[str, list[str]] = {}
    for key in flat_state:
        if key not in metadata:
            missing.setdefault(key.split(".", 1)[0], []).append(key)
    loader = missing.pop("dataloader", None)
    if loader:
        lines.append(_loader_line(path, flat_state, metadata, loader))
    model = missing.pop("model", None)
    lines += (
        [_model_keys_line(path, model)] if model else _shape_lines(path, flat_state, metadata)[:1]
    )
    for state, keys in missing.items():
        lines.append(
            f"{path} has no '{state}' entries this run loads ({keys[0]}, {len(keys)} in all): it "
            f"was saved by another configuration; pass --checkpoint.exclude_from_loading {state} "
            "to start that state afresh"
        )
    return lines


def _loader_line(path: str, flat: dict[str, Any], metadata: dict[str, Any], keys: list[str]) -> str:
    """The data loader keeps one entry per virtual shard, one shard per sequence of the global
    batch: the shard counts are the two global batches."""
    count = _shards(metadata)
    if count:
        return _batch_line(path, count, {_BATCH: _shards(flat)})
    return (
        f"{path} has no data-loader state for this run ({keys[0]}); pass "
        "--checkpoint.exclude_from_loading dataloader to start the data afresh"
    )


def _shards(keys: Any) -> int:
    return sum(1 for k in keys if k.startswith("dataloader.shard_"))


def _model_keys_line(path: str, keys: list[str]) -> str:
    shown = ", ".join(k.removeprefix("model.") for k in keys[:3])
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return (
        f"model.flavor: {path} lacks {len(keys)} weights of this model ({shown}{more}): it holds "
        "another model; resume with the model.name, model.flavor and overrides it was trained with"
    )


def _shape_lines(path: str, flat: dict[str, Any], metadata: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in flat.items():
        size = getattr(metadata.get(key), "size", None)
        shape = getattr(value, "shape", None)
        if key.startswith("model.") and size is not None and shape is not None:
            if tuple(size) != tuple(shape):
                lines.append(
                    f"model.flavor: {path} holds {key.removeprefix('model.')} of shape "
                    f"{list(size)} and this model's is {list(shape)}: it holds another model "
                    "size; resume with the model.flavor and overrides it was trained with"
                )
    return lines
