"""The accelerators a job may run on: memory, peak FLOP/s, memory and link bandwidths, and what
this project measured on them. One table serves MFU (``observability/metrics.py``), the fit
verdict (``scripts/estimate_memory.py``) and the layout planner.

The figures are the vendors' datasheets: dense tensor-core FLOP/s (no 2:4 sparsity), memory as
the datasheet states it (GB), HBM bandwidth, and the GPU-to-GPU link inside a node (NVLink, or
PCIe for cards without it) per direction (the datasheets give NVLink both directions together).
``memory_mib`` is the total CUDA reports (``nvidia-smi``'s figure), where known: the H200's was
measured in this project (docs/performance.md); the others are the usual reports of those
cards (GDDR cards with ECC on report several percent less than their datasheet's GB). Without
it, the datasheet's GB are taken as GiB (HBM capacities are powers of two). ``network_gb_s`` is not the GPU's: it is the usual scale-out fabric per
GPU of the vendor's reference node (one 400 Gb/s NIC per H100/H200/B200 in DGX H100/H200/B200,
one 200 Gb/s per A100 in DGX A100), to be overridden for another cluster.

Sources: NVIDIA A100 Tensor Core GPU datasheet; NVIDIA H100 Tensor Core GPU datasheet (SXM,
PCIe, NVL); NVIDIA H200 Tensor Core GPU datasheet; NVIDIA HGX B200 specifications (per GPU: the
8-GPU board's totals / 8); NVIDIA A10, L4 and L40S datasheets; AMD Instinct MI300X datasheet;
NVIDIA DGX A100/H100/B200 user guides (networking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchtitan.errors import ConfigError


@dataclass(frozen=True)
class Device:
    key: str  # the name to ask for it by (--gpu-type)
    name: str  # matched as a whole word in torch.cuda.get_device_name()
    memory_gb: float
    bf16_tflops: float
    fp8_tflops: float | None  # None: no float8 tensor cores
    hbm_gb_s: float  # memory bandwidth
    link_gb_s: float  # GPU to GPU inside a node, each direction
    link: str  # what that link is
    network_gb_s: float  # the reference node's scale-out fabric per GPU, each direction
    memory_mib: int | None = None  # the total CUDA reports, where known
    # the fraction of the bf16 peak a large matmul reached here (benchmarks/ceilings.py, recorded
    # in docs/performance.md); None: not measured
    matmul_efficiency: float | None = None

    @property
    def memory_gib(self) -> float:
        """The memory a process sees (GiB): CUDA's total where known, else the datasheet's."""
        return self.memory_mib / 1024 if self.memory_mib else self.memory_gb


# most specific name first: the first whose name is a whole word of the CUDA device name wins
# (so "NVIDIA L40" is not taken for an L4: an unknown device gets no figures, not wrong ones)
DEVICES: tuple[Device, ...] = (
    Device("h100-pcie", "H100 PCIe", 80, 756, 1513, 2000, 300, "NVLink bridge", 50),
    Device("h100-nvl", "H100 NVL", 94, 835, 1671, 3900, 300, "NVLink bridge", 50),
    Device("h100", "H100", 80, 989, 1979, 3350, 450, "NVLink 4", 50, 81_559, 782 / 989),
    Device("h200-nvl", "H200 NVL", 141, 835, 1671, 4800, 450, "NVLink bridge", 50),
    Device("h200", "H200", 141, 989, 1979, 4800, 450, "NVLink 4", 50, 143_771, 759 / 989),
    Device("gh200", "GH200", 96, 989, 1979, 4000, 450, "NVLink 4", 50),
    Device("b200", "B200", 180, 2250, 4500, 8000, 900, "NVLink 5", 50),
    Device("a100-40gb", "A100-SXM4-40GB", 40, 312, None, 1555, 300, "NVLink 3", 25, 40_960),
    Device("a100-pcie", "A100 80GB PCIe", 80, 312, None, 1935, 300, "NVLink bridge", 25, 81_920),
    Device("a100", "A100", 80, 312, None, 2039, 300, "NVLink 3", 25, 81_920),
    Device("l40s", "L40S", 48, 362, 733, 864, 32, "PCIe 4", 25, 46_068),
    Device("l4", "L4", 24, 121, 242, 300, 32, "PCIe 4", 25, 23_034),
    Device("a10", "A10", 24, 125, None, 600, 32, "PCIe 4", 25),
    # Infinity Fabric: 7 links, one to each of the node's 7 others (64 GB/s each way per pair)
    Device("mi300x", "MI300X", 192, 1307, 2615, 5300, 448, "Infinity Fabric", 50),
)


def find_device(device_name: str) -> Device | None:
    """The table's entry for a CUDA device name (``torch.cuda.get_device_name()``), or None."""
    for device in DEVICES:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(device.name)}(?![A-Za-z0-9])", device_name):
            return device
    return None


def device_by_key(key: str, option: str = "--gpu-type") -> Device:
    """The entry asked for by its key; ConfigError naming the valid keys otherwise."""
    for device in DEVICES:
        if device.key == key.lower():
            return device
    valid = ", ".join(d.key for d in DEVICES)
    raise ConfigError(f"{option}: {key!r} is not a known GPU; valid: {valid}")


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a CUDA device name, or None when unknown (MFU is then not
    reported)."""
    device = find_device(device_name)
    return device.bf16_tflops * 1e12 if device else None
