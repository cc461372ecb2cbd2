"""Hugging Face model folder (any registered family: Llama, Qwen3) -> DCP checkpoint folder (model weights, float32 as stored).

    python scripts/convert_hf_to_dcp.py HF_DIR OUT_DIR

HF_DIR holds config.json and model.safetensors (or shards with model.safetensors.index.json).
OUT_DIR can then start training (``--checkpoint.initial_load_path OUT_DIR``) or be placed as
``{dump_folder}/checkpoint/step-0`` (it is marked COMPLETE and model-only, like a seed).
Training can also read HF_DIR directly: ``--checkpoint.initial_load_in_hf``.
"""

from __future__ import annotations

import argparse

from _common import progress, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    a = parser.parse_args()

    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint.folder import write_marker
    from torchtitan.checkpoint.hf_files import read_hf_model

    _, _, state = read_hf_model(a.hf_dir, "HF_DIR", progress=progress("read safetensors"))
    dcp.save({"model": state}, checkpoint_id=a.out_dir, no_dist=True)
    write_marker(a.out_dir, step=0, model_only=True, world_size=1)
    n = sum(t.numel() for t in {id(t): t for t in state.values()}.values())  # tied: once
    print(f"wrote {a.out_dir}: {len(state)} tensors, {n:,} parameters")


if __name__ == "__main__":
    run(main)
