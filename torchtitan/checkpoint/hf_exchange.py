"""Hugging Face exchange of a running job: start from a Hugging Face model folder's weights
(``checkpoint.initial_load_in_hf``), and export ``step-N-hf`` at the end
(``checkpoint.last_save_in_hf``). The folder I/O itself is in ``hf_files``."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.checkpoint import storage
from torchtitan.checkpoint.collectives import _agree, _attempt
from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.checkpoint.states import _EXPORT_DTYPES, ModelState, TrainState
from torchtitan.config.schema import Checkpoint, Model
from torchtitan.distributed.utils import full_tensor
from torchtitan.errors import TorchTitanError
from torchtitan.observability.log import logger

CONFIG = "config.json"  # a Hugging Face folder's model config: its presence means whole


def hf_load_source(checkpoint: Checkpoint, model: Model) -> tuple[str, str] | None:
    """``(folder, key)`` that ``checkpoint.initial_load_in_hf`` reads its weights from:
    ``checkpoint.initial_load_path`` when set, else ``model.hf_assets_path`` (a Hugging Face
    model folder), else None."""
    if checkpoint.initial_load_path:
        return checkpoint.initial_load_path, "checkpoint.initial_load_path"
    hf_assets_path = getattr(model, "hf_assets_path", None)
    if hf_assets_path:
        return hf_assets_path, "model.hf_assets_path"
    return None


def make_adapter(hf_adapter: Any, model_args: Any, key: str) -> Any:
    """The family's HFStateDictAdapter for ``model_args``; ``key``: the setting that asked for
    it, for the error when the family has none."""
    if hf_adapter is None:
        raise CheckpointError(
            f"{key}: this model family has no Hugging Face state-dict adapter in its model spec"
        )
    return hf_adapter(model_args)


def load_hf(
    path: str,
    key: str,
    *,
    model_parts: list[nn.Module],
    hf_adapter: Any,
    model_args: Any,
    train_state: TrainState,
    frozen_only: bool = False,
) -> None:
    """Start from Hugging Face weights: every rank reads the files and keeps its shards.
    ``key``: the setting that named ``path``, for errors. ``frozen_only``: load the frozen
    parameters only (the base of a LoRA run; its adapters are not in the folder)."""
    from torchtitan.checkpoint.hf_files import read_folder

    t0 = time.perf_counter()
    which = ModelState(model_parts, "frozen" if frozen_only else "all")
    expected = {}
    for part in model_parts:
        expected.update({k: v.shape for k, v in which.part_state(part).items()})
    adapter = make_adapter(hf_adapter, model_args, key)  # its error names the key already
    try:
        state = adapter.from_hf(read_folder(path), expected)
    except TorchTitanError as e:
        raise CheckpointError(f"{key}: {e}") from e
    for part in model_parts:
        own = {k: state[k] for k in which.part_state(part)}
        options = StateDictOptions(full_state_dict=True, strict=not frozen_only)
        set_model_state_dict(part, own, options=options)
    train_state.load_state_dict({"step": 0, "ntokens_seen": 0})
    logger.info(f"Loaded Hugging Face weights from {path} in {time.perf_counter() - t0:.2f}s")


@dataclass(frozen=True)
class HFExchange:
    """What a Hugging Face export or import needs besides the model: the family's adapter class
    and tokenizer-file writer (from its model spec, None where it has none), the tokenizer, and
    this rank's pipeline stage; ``load_source``: where ``checkpoint.initial_load_in_hf`` reads
    (:func:`hf_load_source`)."""

    adapter: Any = None
    tokenizer: Any = None
    export_tokenizer: Any = None
    pp_rank: int = 0
    pp_degree: int = 1
    load_source: tuple[str, str] | None = None
    adapters: Any = None  # a LoRA run's export settings (torchtitan.lora.export.LoRAExport)


@dataclass(frozen=True)
class ExportRanks:
    """Who writes what in an export: the first rank of each pipeline stage writes its stage's
    weights (the mesh puts pp outermost), rank 0 the config, tokenizer and index."""

    rank: int
    world_size: int
    pp_rank: int = 0
    pp_degree: int = 1

    @property
    def stage_writer(self) -> bool:
        return self.rank % (self.world_size // self.pp_degree) == 0

    @property
    def stage_file(self) -> str:
        return f"model-{self.pp_rank + 1:05d}-of-{self.pp_degree:05d}.safetensors"


def export_hf(
    final: str,
    *,
    model_parts: list[nn.Module],
    hf_adapter: Any,
    model_args: Any,
    export_dtype: str,
    tokenizer: Any,
    export_tokenizer: Any,
    ranks: ExportRanks,
    adapters: Any = None,
    staging: str | None = None,
) -> str:
    """``final`` (``step-{step}-hf``): config.json, safetensors and tokenizer files that
    ``transformers`` loads (``AutoModelForCausalLM``, ``AutoTokenizer``). Parameters are gathered
    one at a time onto the CPU of each stage's first rank; with pipeline parallelism every stage
    writes its own file and rank 0 the index. The folder appears whole or not at all.

    ``adapters`` (``torchtitan.lora.export.LoRAExport``, for a LoRA run): the adapters are also
    written as a ``peft`` adapter folder ``step-{step}-peft``, and ``final`` gets them merged
    into the weights (unless ``adapters.merge`` is false: then only the adapter folder is written,
    and its path returned).

    ``final`` may be a URL (object storage): each writing rank writes into its own folder under
    the local ``staging`` and uploads it, and rank 0 uploads ``config.json`` last, once every
    other file is there (a folder without it is not a whole export)."""
    adapter = make_adapter(hf_adapter, model_args, "checkpoint.last_save_in_hf")
    remote = storage.is_url(final)
    if remote and staging is None:
        raise ValueError("an export to a URL needs a local staging folder")
    tmp = os.path.join(staging, f"rank-{ranks.rank}") if remote else final + ".partial"
    t0 = time.perf_counter()
    dtype = _EXPORT_DTYPES[export_dtype]
    only_adapters = adapters is not None and not adapters.merge
    state = _gather(
        model_parts,
        ranks.stage_writer,
        torch.float32 if adapters else dtype,
        keep=(lambda k: k.endswith((".lora_a", ".lora_b"))) if only_adapters else None,
    )
    if adapters is not None:
        tensors = adapters.peft_tensors(state, adapter) if ranks.stage_writer else {}
        peft = _export_peft(
            final.removesuffix("-hf") + "-peft", adapters, tensors, ranks, dtype, staging
        )
        if not adapters.merge:
            return peft
        state = {k: v.to(dtype) for k, v in adapters.merged(state).items()}
    hf_state = adapter.to_hf(state) if ranks.stage_writer else {}
    tok = tokenizer
    config = adapter.hf_config(
        dtype=dtype,
        bos_id=getattr(tok, "bos_id", None),
        eos_id=getattr(tok, "eos_id", None),
    )
    # Writing can fail on one rank only (a full disk): each step ends in _agree, so every
    # rank stops with the same error instead of the others waiting at a barrier.
    _agree(_attempt(lambda: _clear(tmp, final, ranks.rank, remote)))

    def write() -> None:
        if ranks.rank == 0 and tok is not None and export_tokenizer is not None:
            export_tokenizer(tmp, tok, model_args.max_seq_len)
        _write_weights(tmp, hf_state, config, ranks)

    _agree(_attempt(write))
    if ranks.pp_degree > 1:
        _write_index(tmp, hf_state, config, ranks)

    if remote:  # every writer its own files, then rank 0 config.json: the export is whole
        _agree(_attempt(lambda: storage.upload(tmp, final, skip=CONFIG)))
        done = storage.join(final, CONFIG)
        _agree(_attempt(lambda: ranks.rank == 0 and storage.upload_file(f"{tmp}/{CONFIG}", done)))
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        _agree(_attempt(lambda: ranks.rank == 0 and storage.publish(tmp, final, last=CONFIG)))
    logger.info(f"Exported Hugging Face weights to {final} in {time.perf_counter() - t0:.2f}s")
    return final


def _clear(tmp: str, final: str, rank: int, remote: bool) -> None:
    """Before an export: no leftovers in the folder it is written into (and, for a URL, no
    older export of the step: its config.json goes first)."""
    if remote:
        shutil.rmtree(tmp, ignore_errors=True)
        if rank == 0:
            storage.remove(final, first=CONFIG)
    elif rank == 0 and os.path.isdir(tmp):
        shutil.rmtree(tmp)


def _export_peft(
    final: str,
    adapters: Any,
    tensors: dict[str, torch.Tensor],
    ranks: ExportRanks,
    dtype: Any,
    staging: str | None = None,
) -> str:
    """Rank 0 writes every stage's adapters (small: gathered as objects) as one ``peft``
    adapter folder; it appears whole or not at all."""
    every: list[Any] = [tensors]
    if dist.is_initialized() and ranks.world_size > 1:
        every = [None] * ranks.world_size
        dist.all_gather_object(every, tensors)
    merged = {k: v.to(dtype) for part in every for k, v in part.items()}
    remote = storage.is_url(final)
    tmp = os.path.join(staging or "", "peft") if remote else final + ".partial"

    def write() -> None:
        if ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            adapters.write_peft(tmp, merged)
            storage.publish(tmp, final, last=adapters.config_file)

    _agree(_attempt(write))
    logger.info(f"Exported the LoRA adapters ({len(merged) // 2} modules) as a peft folder {final}")
    return final


def _gather(
    model_parts: list[nn.Module], stage_writer: bool, dtype: torch.dtype, keep: Any = None
) -> dict[str, torch.Tensor]:
    """Every parameter whole (those ``keep(name)`` is true of, if given), in ``dtype`` on the
    CPU of the stage writer (empty elsewhere)."""
    state: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for name, value in get_model_state_dict(part).items():
            if keep is not None and not keep(name):
                continue
            full = full_tensor(value)  # a collective over the part's mesh, same order everywhere
            if stage_writer:
                state[name] = full.detach().to("cpu", dtype)
    return state


def _write_weights(
    tmp: str, hf_state: dict[str, torch.Tensor], config: dict, ranks: ExportRanks
) -> None:
    """Without pipeline parallelism rank 0 writes the whole folder; with it each stage writer
    its stage's file (``_write_index`` adds the index and config.json)."""
    from torchtitan.checkpoint.hf_files import write_folder

    if ranks.pp_degree == 1 and ranks.rank == 0:
        write_folder(tmp, hf_state, config)
    elif ranks.pp_degree > 1 and ranks.stage_writer:
        from safetensors.torch import save_file

        os.makedirs(tmp, exist_ok=True)
        save_file(hf_state, os.path.join(tmp, ranks.stage_file), metadata={"format": "pt"})


def _write_index(
    tmp: str, hf_state: dict[str, torch.Tensor], config: dict, ranks: ExportRanks
) -> None:
    """Pipeline parallelism: rank 0 writes the index of every stage's file, and config.json."""
    from torchtitan.checkpoint.hf_files import INDEX

    keys: list[Any] = [None] * ranks.world_size
    mine = {k: ranks.stage_file for k in hf_state} if ranks.stage_writer else {}
    dist.all_gather_object(keys, mine)
    weight_map = {k: v for d in keys for k, v in d.items()}

    def write_index() -> None:
        if ranks.rank == 0:
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
            with open(os.path.join(tmp, CONFIG), "w") as f:
                json.dump(config, f, indent=2)

    _agree(_attempt(write_index))
