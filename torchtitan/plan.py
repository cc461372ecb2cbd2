"""``python -m torchtitan.plan``: the best parallel layouts of a job on N GPUs, predicted and
explained (:mod:`torchtitan.planning.cli`)."""

import sys

from torchtitan.planning.cli import main

if __name__ == "__main__":
    sys.exit(main())
