"""Built-in model families; importing this package registers their train specs."""

from torchtitan.models import llama  # noqa: F401
