"""The peak-FLOPs table behind MFU: device names as CUDA reports them."""

from __future__ import annotations

import pytest

from torchtitan.observability.metrics import peak_flops


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", None),  # not an L4: unknown, so MFU is not reported
        ("NVIDIA A10G", None),
        ("cpu", None),
    ],
)
def test_peak_flops_by_device_name(name, expected):
    assert peak_flops(name) == expected
