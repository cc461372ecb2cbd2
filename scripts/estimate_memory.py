"""Estimate peak memory per device for a training config, without allocating the model.

    python scripts/estimate_memory.py [--world-size N] [--device-type cuda|cpu] [--json] \\
        [--gpu-type KEY | --device-memory-gib X] \\
        --job.config_file train_configs/llama3_8b.toml [any train.py --section.key value ...]

One training step traced on fake tensors for one layout (how, and what it leaves out:
``torchtitan/train/memory_estimate.py``), printed as a table of what is alive at the peak, beside the
model state computed from the parameter count, and a verdict against a GPU's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _common import run

from torchtitan.train.memory_estimate import ROWS, estimate_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument(
        "--device-type",
        choices=("cuda", "cpu"),
        default="cuda",
        help="dtype rules of the target: cuda uses training.mixed_precision_param, cpu float32",
    )
    parser.add_argument(
        "--gpu-type",
        help="the verdict against this GPU's memory (torchtitan/devices.py: h100, h200, a100, ...); "
        "default: this machine's CUDA device, if any",
    )
    parser.add_argument("--device-memory-gib", type=float, help="the verdict against this memory")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a, train_args = parser.parse_known_args()
    estimate = estimate_memory(train_args, a.world_size, a.device_type)
    estimate.update(_verdict(estimate, a))
    if a.json:
        print(json.dumps(estimate))
    else:
        print(format_table(estimate))


def _verdict(estimate: dict, a: argparse.Namespace) -> dict:
    """Whether the traced peak fits the device's memory (torchtitan/train/memory_fit.py)."""
    from torchtitan.train.memory_fit import device_memory, verdict

    memory = device_memory(a.device_type, a.gpu_type, a.device_memory_gib)
    if memory is None:
        return {"fits": None, "verdict": None}
    fits, line = verdict(estimate["peak_gib"], memory, "the traced peak is")
    return {"fits": fits, "verdict": line}


def format_table(e: dict) -> str:
    lines = [
        f"Memory estimate per device: {e['model']} ({e['parameters_total']:,} parameters), "
        f"world size {e['world_size']}, {e['layout']}",
        f"  local batch {e['local_batch_size']} x seq {e['seq_len']}, compute dtype "
        f"{e['param_dtype']} ({e['device_type']} rules), activation checkpoint "
        f"{e['activation_checkpoint']}"
        + (f", pp rank {e['pp_rank']} (the larger)" if e["per_pp_rank"] else ""),
        "",
        f"  {'':14}{'traced at peak':>16}{'formula':>12}",
    ]
    for row in ROWS:
        formula = e["formula_gib"].get(row)
        f_text = f"{formula:10.3f}  " if formula is not None else " " * 12
        lines.append(f"  {row:14}{e['breakdown_gib'][row]:14.3f}  {f_text}")
    lines.append(f"  {'peak':14}{e['peak_gib']:14.3f}  GiB")
    if e["microbatches_in_flight"] > 1:
        lines.append(
            f"  (traced with up to {e['microbatches_in_flight']} micro-batches held by a stage, "
            "before and beside its gradients, in the order its pipeline schedule runs them)"
        )
    lines.append(
        "  formula: steady state after the first step (float32 parameters and gradients, "
        "optimizer state in optimizer.state_dtype: 2 moments, 1 for Muon's matrices); the "
        "traced column is what is alive at the peak"
    )
    lines += [f"  note: {n}" for n in e["notes"]]
    if e.get("verdict"):
        lines.append(f"  {e['verdict']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run(main))
