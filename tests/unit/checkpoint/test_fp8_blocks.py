"""Block-quantized FP8 Hugging Face folders (DeepSeek-V3's and Kimi K2's releases) are read as
bfloat16 weights: against a dequantization written here from the format (README_WEIGHTS.md of
DeepSeek-V3: float8 e4m3 weights, one float32 ``weight_scale_inv`` per 128 x 128 block, the
weight being the float8 value times its block's scale)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.checkpoint.hf_files import (
    dequantize_fp8_blocks,
    read_folder,
    read_hf_model,
    write_folder,
)
from torchtitan.errors import HFFormatError

E4M3_MAX = 448.0


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8 weight, scale_inv)``: each block scaled so its largest value is e4m3's max."""
    rows, cols = w.shape
    br, bc = block
    scales = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            piece = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scales[i, j] = piece.abs().max().clamp(min=1e-12) / E4M3_MAX
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (piece / scales[i, j]).to(q.dtype)
    return q, scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    br, bc = block
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out.to(torch.bfloat16)


def test_blocks_with_partial_edges_dequantize_as_the_format_says():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = _quantize(w, (128, 128))
    assert s.shape == (3, 2)
    got = dequantize_fp8_blocks({"a.weight": q, "a.weight_scale_inv": s, "b": w})
    assert sorted(got) == ["a.weight", "b"] and got["a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["a.weight"], _dequantize(q, s, (128, 128)))
    assert (got["a.weight"].float() - w).abs().max() < 0.1 * w.abs().max()  # it is the weight
    assert torch.equal(got["b"], w)  # unquantized tensors as they are


def test_bad_scales_are_named():
    q, s = _quantize(torch.randn(20, 20), (8, 8))
    with pytest.raises(HFFormatError, match="x.weight_scale_inv has no weight x.weight"):
        dequantize_fp8_blocks({"x.weight_scale_inv": s})
    with pytest.raises(HFFormatError, match=r"shape \(3, 3\) does not scale a.weight \(20, 20\) "):
        dequantize_fp8_blocks({"a.weight": q, "a.weight_scale_inv": s}, (16, 16))


def test_a_quantized_deepseek_folder_loads_dequantized(tmp_path):
    """A tiny DeepSeek-V3 export with every linear weight quantized in 8 x 8 blocks (as the
    release quantizes its linears, not the embedding, norms or router), the block size in
    config.json as the release writes it: the model's state is the dequantized weights."""
    from tests.unit.models.test_mtp import _mtp_model
    from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter

    ours = _mtp_model(depths=1)
    adapter = DeepSeekV3StateDictAdapter(ours.args)
    config = adapter.hf_config(dtype=torch.bfloat16, bos_id=None, eos_id=None)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [8, 8],
    }
    exported, quantized, want = adapter.to_hf(ours.state_dict()), {}, {}
    for name, w in exported.items():
        linear = w.dim() == 2 and "embed" not in name and "gate.weight" not in name
        if linear and "head" not in name:
            q, s = _quantize(w, (8, 8))
            quantized |= {name: q, name + "_scale_inv": s}
            want[name] = _dequantize(q, s, (8, 8))
        else:
            quantized[name] = w
    write_folder(str(tmp_path), quantized, config)
    assert any(k.endswith("_scale_inv") for k in read_folder(str(tmp_path))) is False
    spec, args, state = read_hf_model(str(tmp_path), "test")
    assert args == dataclasses.replace(ours.args)
    back = adapter.to_hf({k: v for k, v in state.items()})
    assert len(want) > 20
    for name, w in want.items():
        assert torch.equal(back[name], w), name
