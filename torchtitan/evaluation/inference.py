"""A trained model for inference (generation, evaluation): the whole model on one device, from a
DCP ``step-N`` folder or a Hugging Face model folder, and its tokenizer.

Used by ``scripts/generate.py`` and the lm-eval model (``torchtitan/lm_eval/``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from torchtitan.errors import ConfigError

__all__ = ["load_model", "load_tokenizer"]


def load_model(
    checkpoint: str,
    model: str,
    flavor: str | None,
    *,
    key: str = "--checkpoint",
    flavor_key: str = "--flavor",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[nn.Module, Any]:
    """``(model in float32, eval mode; its args)``. ``checkpoint``: a Hugging Face folder (the
    family and sizes from its config.json) or a DCP folder (family ``model``, ``flavor``, the
    vocabulary size and the number of blocks read from the weights). ``key``, ``flavor_key``: the settings that name
    them, for errors."""
    from torchtitan.models.spec import get_model_args, get_model_spec

    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        from torchtitan.checkpoint.hf_files import read_hf_model

        spec, args, state = read_hf_model(checkpoint, key, progress=progress)
    else:
        from torchtitan.checkpoint import read_model_weights

        if flavor is None:
            raise ConfigError(f"{flavor_key}: needed for a DCP checkpoint (e.g. {flavor_key} 8B)")
        state = read_model_weights(checkpoint, progress=progress)
        if any(k.endswith(".lora_a") for k in state):
            raise ConfigError(
                f"{key}: '{checkpoint}' is a LoRA run's checkpoint, which holds the adapters "
                "only; load its merged export (step-N-hf, written with "
                "checkpoint.last_save_in_hf), or its base with the step-N-peft folder in peft"
            )
        vocab = state["tok_embeddings.weight"].shape[0]
        # the blocks it holds: a run may have cut the flavor's (model.n_layers)
        n_layers = len({k.split(".")[1] for k in state if k.startswith("layers.")})
        args = dataclasses.replace(
            get_model_args(model, flavor), vocab_size=vocab, n_layers=n_layers
        )
        spec = get_model_spec(model)
    net = spec.cls(args)
    if spec.state_dict_adapter is not None:  # a checkpoint from before the fused wqkv: merge
        adapter = spec.state_dict_adapter(args)
        state = adapter.fuse(state, net.state_dict())
    missing, unexpected = net.load_state_dict(state, strict=False)
    allowed_missing = {"output.weight"} if args.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ConfigError(f"{key}: weights do not fit the model ({missing} {unexpected})")
    return net.float().eval(), args


def load_tokenizer(
    tokenizer: str | None,
    checkpoint: str,
    key: str = "--tokenizer",
    checkpoint_key: str = "--checkpoint",
) -> Any:
    """``tokenizer`` (a file or a folder), else the tokenizer of the ``checkpoint`` folder
    (``key``, ``checkpoint_key``: the settings that name them, for errors)."""
    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_file_in

    if tokenizer:
        return build_tokenizer(tokenizer, key=key)
    if os.path.isdir(checkpoint) and tokenizer_file_in(checkpoint) is not None:
        return build_tokenizer(checkpoint, key=checkpoint_key)
    raise ConfigError(
        f"{key}: needed, since {checkpoint_key} {checkpoint!r} holds no tokenizer "
        "(tokenizer.json, tokenizer.model or original/tokenizer.model); give a tokenizer file or "
        "a Hugging Face model folder"
    )
