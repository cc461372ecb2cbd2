"""Built-in model families; importing this package registers their train specs."""

from torchtitan.models import llama, qwen3  # noqa: F401
