"""``python -m torchtitan.preflight``: the command the launchers and users type for the check before
torchrun; the check itself is :mod:`torchtitan.train.preflight`."""

import sys

from torchtitan.train.preflight import main

if __name__ == "__main__":
    sys.exit(main())
