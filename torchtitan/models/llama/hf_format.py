"""Llama weights in the layout of Hugging Face ``transformers`` (``LlamaForCausalLM``), and back.

Names: ``tok_embeddings`` <-> ``model.embed_tokens``, ``layers.N.attention.wq/wk/wv/wo`` <->
``model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj``, ``feed_forward.w1/w3/w2`` <->
``mlp.gate_proj/up_proj/down_proj``, ``attention_norm`` / ``ffn_norm`` <->
``input_layernorm`` / ``post_attention_layernorm``, ``norm`` <-> ``model.norm``, ``output`` <->
``lm_head`` (absent when the embeddings are tied).

Rotary layout: this model (like Meta's reference) rotates adjacent channel pairs ``(2i, 2i+1)`` of
each head; ``transformers`` rotates ``(i, i + head_dim / 2)``. The rows of ``wq`` and ``wk`` are
therefore permuted within each head on the way out, and back on the way in (the permutation of
``transformers``' own ``convert_llama_weights_to_hf.py``).

Files: ``config.json`` plus ``model.safetensors``, or shards listed in
``model.safetensors.index.json`` (its ``weight_map``), as ``from_pretrained`` reads them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from torchtitan.errors import TorchTitanError
from torchtitan.models.llama.model import ModelArgs


class HFFormatError(TorchTitanError):
    """Hugging Face weights that do not fit this model (names or shapes), or unreadable files."""

    exit_code = 1


_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_KEY.match(name)
    if not m or m.group(2) not in _LAYER:
        raise HFFormatError(f"parameter '{name}' has no Hugging Face Llama counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def _ours(hf: str) -> str | None:
    top = {v: k for k, v in _TOP.items()}
    if hf in top:
        return top[hf]
    m = _HF_LAYER_KEY.match(hf)
    if m:
        inverse = {v: k for k, v in _LAYER.items()}
        if m.group(2) in inverse:
            return f"layers.{m.group(1)}.{inverse[m.group(2)]}"
    return None


def _in_model(name: str, args: ModelArgs) -> bool:
    """A parameter of the whole model (perhaps held by another pipeline stage)."""
    m = _LAYER_KEY.match(name)
    return name in _TOP if m is None else int(m.group(1)) < args.n_layers


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from pairs ``(2i, 2i+1)`` to halves ``(i, i + d/2)``."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _permute(name: str, w: torch.Tensor, args: ModelArgs, fn) -> torch.Tensor:
    if name.endswith("attention.wq.weight"):
        return fn(w, args.n_heads)
    if name.endswith("attention.wk.weight"):
        return fn(w, args.n_kv_heads)
    return w


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """This model's (full, unsharded) state dict in ``transformers``' names and layout."""
    out = {}
    for name, w in state.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue  # transformers ties lm_head to embed_tokens itself
        out[hf_name(name)] = _permute(name, w, args, _to_half_split).contiguous()
    return out


def from_hf(
    hf_state: dict[str, torch.Tensor], args: ModelArgs, expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """``transformers`` weights as this model's state dict. ``expected``: the names and shapes of
    the parameters wanted (a pipeline stage's: the other stages' are dropped); any name or shape
    that does not match is listed in one HFFormatError."""
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for hf, w in hf_state.items():
        name = _ours(hf)
        if name is None:
            if "rotary_emb.inv_freq" not in hf:  # old exports carry the rotary table
                unexpected.append(hf)
            continue
        fits = name in expected and tuple(w.shape) == tuple(expected[name])
        state[name] = _permute(name, w, args, _to_interleaved) if fits else w
    if args.tie_word_embeddings and "output.weight" in expected and "output.weight" not in state:
        if "tok_embeddings.weight" in state:
            state["output.weight"] = state["tok_embeddings.weight"]
    missing = [hf_name(n) for n in expected if n not in state]
    for name in [n for n in state if n not in expected]:
        if not _in_model(name, args):
            unexpected.append(hf_name(name))
        del state[name]  # another pipeline stage's parameter (or an unexpected one)
    shapes = [
        f"{hf_name(n)} {tuple(state[n].shape)} vs {tuple(s)}"
        for n, s in expected.items()
        if n in state and tuple(state[n].shape) != tuple(s)
    ]
    problems = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)):
        if items:
            shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
            problems.append(f"{len(items)} {what}: {shown}")
    if problems:
        raise HFFormatError(
            "Hugging Face weights do not match this model (" + "; ".join(problems) + ")"
        )
    return state


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype, bos_id: int | None, eos_id: int | None
) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with these hyper-parameters."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim(),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if args.use_scaled_rope:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scale_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return config


def args_from_hf_config(config: dict) -> ModelArgs:
    """This model's hyper-parameters from a ``transformers`` Llama ``config.json``."""
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        hidden = int(config["intermediate_size"])
        base = int(2 * 4 * dim / 3)
        args = ModelArgs(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            vocab_size=int(config["vocab_size"]),
            # SwiGLU width: rounding 8/3 * dim up to a multiple of `hidden` gives `hidden` itself
            multiple_of=hidden,
            ffn_dim_multiplier=None if hidden >= base else hidden / base,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise HFFormatError(
            f"config.json is not a Llama config this model can build ({e!r})"
        ) from e
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        args.use_scaled_rope = True
        args.rope_scale_factor = float(scaling["factor"])
        args.rope_low_freq_factor = float(scaling["low_freq_factor"])
        args.rope_high_freq_factor = float(scaling["high_freq_factor"])
        args.rope_original_max_seq_len = int(scaling["original_max_position_embeddings"])
    if args.ffn_hidden_dim() != hidden or args.head_dim != config.get("head_dim", args.head_dim):
        raise HFFormatError(
            f"config.json: intermediate_size {hidden} / head_dim {config.get('head_dim')} "
            "cannot be expressed by this model's Llama hyper-parameters"
        )
    return args


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFFormatError(f"cannot read {file} ({type(e).__name__}: {e})") from e


# ----------------------------------------------------------------------------- files

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_folder(
    path: str, progress: Callable[[int, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face model folder (one safetensors file, or shards + index);
    ``progress(done, total)`` is called after each file."""
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = [SINGLE]
    else:
        raise HFFormatError(
            f"'{path}' holds neither {SINGLE} nor {INDEX}: not a Hugging Face model folder"
        )
    state: dict[str, torch.Tensor] = {}
    for i, name in enumerate(files):
        file = os.path.join(path, name)
        try:
            state.update(load_file(file))
        except Exception as e:
            raise HFFormatError(f"cannot read {file} ({type(e).__name__}: {e})") from e
        if progress is not None:
            progress(i + 1, len(files))
    return state


def write_folder(
    path: str, hf_state: dict[str, torch.Tensor], config: dict, max_shard_bytes: int = 5 << 30
) -> list[str]:
    """``config.json`` and the weights (sharded with an index above ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, w in hf_state.items():
        nbytes = w.numel() * w.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE), metadata=meta)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(w.numel() * w.element_size() for w in hf_state.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
