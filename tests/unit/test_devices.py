"""The accelerators' table (torchtitan/devices.py): found by CUDA's device name or asked for by
key, with the datasheets' figures."""

from __future__ import annotations

import pytest

from torchtitan.devices import DEVICES, device_by_key, find_device
from torchtitan.errors import ConfigError


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", None),  # not an L4: unknown rather than wrong
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_a_cuda_device_name_finds_its_entry(name, key):
    found = find_device(name)
    assert (found.key if found else None) == key


def test_entries_are_asked_for_by_key_and_a_typo_names_the_valid_ones():
    assert device_by_key("H100").bf16_tflops == 989  # NVIDIA H100 SXM datasheet, dense
    with pytest.raises(ConfigError) as e:
        device_by_key("h10")
    assert str(e.value).startswith("--gpu-type: 'h10' is not a known GPU; valid: h100-pcie, ")


def test_the_table_is_consistent():
    keys = [d.key for d in DEVICES]
    assert len(keys) == len(set(keys))
    for d in DEVICES:
        assert d.memory_gb > 0 and d.bf16_tflops > 0 and d.hbm_gb_s > 0 and d.link_gb_s > 0
        assert d.fp8_tflops is None or d.fp8_tflops == pytest.approx(2 * d.bf16_tflops, rel=0.02)
        # CUDA's total, where known, is within 7% of the datasheet's (GDDR cards with ECC less)
        assert 0.93 * d.memory_gb < d.memory_gib <= d.memory_gb
