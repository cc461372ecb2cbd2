"""Hugging Face model folders: ``config.json`` plus ``model.safetensors``, or shards listed in
``model.safetensors.index.json`` (its ``weight_map``), as ``from_pretrained`` reads them.
Block-quantized FP8 releases (DeepSeek-V3, Kimi K2: ``weight_scale_inv`` beside each float8
weight) and MXFP4 releases (gpt-oss: ``<name>_blocks`` and ``<name>_scales`` for the experts) are
dequantized to bfloat16 as they are read."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from torchtitan.errors import HFFormatError


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFFormatError(f"cannot read {file} ({type(e).__name__}: {e})") from e


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_folder(
    path: str, progress: Callable[[int, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face model folder (one safetensors file, or shards + index);
    ``progress(done, total)`` is called after each file."""
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = [SINGLE]
    else:
        raise HFFormatError(
            f"'{path}' holds neither {SINGLE} nor {INDEX}: not a Hugging Face model folder"
        )
    state: dict[str, torch.Tensor] = {}
    for i, name in enumerate(files):
        file = os.path.join(path, name)
        try:
            state.update(load_file(file))
        except Exception as e:
            raise HFFormatError(f"cannot read {file} ({type(e).__name__}: {e})") from e
        if progress is not None:
            progress(i + 1, len(files))
    if any(k.endswith(SCALE_SUFFIX) for k in state):
        state = dequantize_fp8_blocks(state, _block_size(path))
    if any(k.endswith(MXFP4_BLOCKS) for k in state):
        state = dequantize_mxfp4(state)
    return state


SCALE_SUFFIX = "_scale_inv"  # DeepSeek's FP8 releases: ``<name>.weight_scale_inv``


def _block_size(path: str) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of the folder's config.json ([128, 128] in
    DeepSeek-V3's and Kimi K2's releases, the default)."""
    config = read_config(path) if os.path.isfile(os.path.join(path, "config.json")) else {}
    size = (config.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if len(size) != 2 or not all(isinstance(n, int) and n > 0 for n in size):
        raise HFFormatError(
            f"{path}/config.json: quantization_config.weight_block_size {size} is not two "
            "positive integers"
        )
    return size[0], size[1]


def dequantize_fp8_blocks(
    state: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    """``state`` with each block-quantized weight (float8, with ``<name>_scale_inv``: one float32
    scale per ``block`` of rows x columns, the last blocks partial) multiplied out to bfloat16,
    the dtype DeepSeek's own ``fp8_cast_bf16`` conversion writes, and the scales dropped."""
    out = {k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}
    for scale_name in [k for k in state if k.endswith(SCALE_SUFFIX)]:
        name = scale_name[: -len(SCALE_SUFFIX)]
        w, scale = state.get(name), state[scale_name]
        if w is None:
            raise HFFormatError(f"{scale_name} has no weight {name} to scale")
        rows, cols = w.shape[0], w.shape[-1] if w.dim() > 1 else 1
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if w.dim() != 2 or tuple(scale.shape) != want:
            raise HFFormatError(
                f"{scale_name}: shape {tuple(scale.shape)} does not scale {name} "
                f"{tuple(w.shape)} in blocks of {block[0]}x{block[1]} (wants {want})"
            )
        full = scale.float().repeat_interleave(block[0], 0)[:rows]
        full = full.repeat_interleave(block[1], 1)[:, :cols]
        out[name] = (w.float() * full).to(torch.bfloat16)
    return out


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # gpt-oss: ``<name>_blocks``, ``<name>_scales``
# FP4 (E2M1) by its 4-bit code: bit 3 the sign, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each MXFP4 tensor (OCP microscaling: ``<name>_blocks`` uint8 ``[E, out,
    G, 16]``, 32 FP4 values per group of 16 bytes, the low nibble first, and ``<name>_scales``
    uint8 ``[E, out, G]``, one power of two ``2^(s - 127)`` per group) as bfloat16 ``<name>``
    ``[E, in, out]`` with ``in = 32 G``: the layout and the numbers of ``transformers``'
    ``convert_moe_packed_tensors`` (every value is exact in bfloat16)."""
    quantized = [k[: -len(MXFP4_BLOCKS)] for k in state if k.endswith(MXFP4_BLOCKS)]
    pairs = {n + suffix for n in quantized for suffix in (MXFP4_BLOCKS, MXFP4_SCALES)}
    out = {k: v for k, v in state.items() if k not in pairs}
    for name in quantized:
        blocks, scales = state[name + MXFP4_BLOCKS], state.get(name + MXFP4_SCALES)
        if scales is None:
            raise HFFormatError(f"{name}{MXFP4_BLOCKS} has no {name}{MXFP4_SCALES} to scale it")
        if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise HFFormatError(
                f"{name}{MXFP4_BLOCKS} {tuple(blocks.shape)} and {name}{MXFP4_SCALES} "
                f"{tuple(scales.shape)} are not MXFP4 blocks [..., G, 16] with scales [..., G]"
            )
        *lead, rows, groups, _ = blocks.shape
        experts = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
        full = torch.empty(experts[0].shape[0], groups * 32, rows, dtype=torch.bfloat16)
        # one expert at a time: the float32 values of a 120b layer's gate_up_proj at once would
        # take 8 GiB
        for i, part in enumerate(full):
            part.copy_(_mxfp4_values(experts[0][i], experts[1][i]).transpose(-2, -1))
        full = full.reshape(*lead, groups * 32, rows)
        out[name] = full
    return out


def _mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., rows, G, 16]`` uint8 codes and ``[..., rows, G]`` scales -> ``[..., rows, 32 G]``
    float32 values (exact)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).int()
    return torch.ldexp(lut[codes], scales.int().unsqueeze(-1) - 127).flatten(-2)


def write_folder(
    path: str, hf_state: dict[str, torch.Tensor], config: dict, max_shard_bytes: int = 5 << 30
) -> list[str]:
    """``config.json`` and the weights (sharded with an index above ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, w in hf_state.items():
        nbytes = w.numel() * w.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE), metadata=meta)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(w.numel() * w.element_size() for w in hf_state.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def read_hf_model(path: str, where: str, progress: Callable[[int, int], None] | None = None):
    """``(model spec, model args, state dict)`` of a Hugging Face model folder: the family comes
    from config.json's ``model_type``, the weights through that family's adapter (full model).
    ``where``: the setting or argument that named ``path``, for errors."""
    from torchtitan.models.spec import spec_for_hf_config

    config = read_config(path)
    spec = spec_for_hf_config(config, where)
    adapter = spec.state_dict_adapter
    args = adapter.args_from_hf_config(config)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in spec.cls(args).state_dict().items()}
    expected.pop("rope_cache", None)
    state = adapter(args).from_hf(read_folder(path, progress=progress), expected)
    return spec, args, state
