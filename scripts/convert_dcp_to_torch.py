"""DCP checkpoint folder -> one ``torch.save`` file of the model weights (full tensors).

    python scripts/convert_dcp_to_torch.py CHECKPOINT_DIR OUT.pt

The file holds ``{parameter name: tensor}``; read it back with
``torch.load(OUT.pt, weights_only=True)``.
"""

from __future__ import annotations

import argparse

from _common import progress, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out_file")
    a = parser.parse_args()

    import torch

    from torchtitan.checkpoint import read_model_weights

    state = read_model_weights(a.checkpoint, progress=progress("read checkpoint"))
    torch.save(state, a.out_file)
    n = sum(t.numel() for t in state.values())
    print(f"wrote {a.out_file}: {len(state)} tensors, {n:,} parameters")


if __name__ == "__main__":
    run(main)
