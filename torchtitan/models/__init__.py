"""Built-in model families; importing this package registers their model specs."""

from torchtitan.models import (  # noqa: F401
    deepseek_v3,
    gpt_oss,
    llama,
    llama4,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
