"""``python -m torchtitan.lm_eval ARGS``: lm-eval's own command line (``lm-eval ARGS``: every option
it takes) with this library's model registered as ``--model torchtitan``."""

from torchtitan.lm_eval import cli

if __name__ == "__main__":
    cli()
