"""Greedy generation from a DCP checkpoint or a Hugging Face model folder.

    python scripts/generate.py --checkpoint DIR [--tokenizer PATH] --prompt TEXT \\
        [--max_new_tokens 32] [--model llama3 --flavor 8B] [--json]

DIR is a ``step-N`` DCP folder (give ``--flavor`` and ``--tokenizer``) or a Hugging Face model
folder with ``config.json`` and safetensors (an export, or a download: the hyper-parameters come
from config.json, and the tokenizer from the folder when ``--tokenizer`` is not given). PATH is a
tokenizer file or a folder holding one (tokenizer.json, tokenizer.model or
original/tokenizer.model). The prompt is encoded with the tokenizer (bos first); generation stops
after ``--max_new_tokens`` or at eos. ``--json``
makes the last stdout line ``{"prompt_ids": [...], "output_ids": [...], "text": "..."}``
(output_ids: the new tokens only; text: their decoding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from _common import progress, run


def load_model(checkpoint: str, model: str, flavor: str | None):

    from torchtitan.errors import ConfigError
    from torchtitan.train_spec import get_model_args, get_train_spec

    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        from torchtitan.checkpoint.hf_files import read_hf_model

        spec, args, state = read_hf_model(checkpoint, "--checkpoint")
    else:
        from torchtitan.checkpoint import read_model_weights

        if flavor is None:
            raise ConfigError("--flavor: needed for a DCP checkpoint (e.g. --flavor 8B)")
        state = read_model_weights(checkpoint, progress=progress("read checkpoint"))
        vocab = state["tok_embeddings.weight"].shape[0]
        args = dataclasses.replace(get_model_args(model, flavor), vocab_size=vocab)
        spec = get_train_spec(model)
    net = spec.cls(args)
    if spec.state_dict_adapter is not None:  # a checkpoint from before the fused wqkv: merge
        adapter = spec.state_dict_adapter(args)
        state = adapter.fuse(state, net.state_dict())
    missing, unexpected = net.load_state_dict(state, strict=False)
    allowed_missing = {"output.weight"} if args.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ConfigError(f"--checkpoint: weights do not fit the model ({missing} {unexpected})")
    return net.float().eval(), args


def load_tokenizer(tokenizer: str | None, checkpoint: str):
    """``--tokenizer`` (a file or a folder), else the tokenizer of the ``--checkpoint`` folder."""
    from torchtitan.datasets.tokenizer import build_tokenizer, tokenizer_file_in
    from torchtitan.errors import ConfigError

    if tokenizer:
        return build_tokenizer(tokenizer, key="--tokenizer")
    if os.path.isdir(checkpoint) and tokenizer_file_in(checkpoint) is not None:
        return build_tokenizer(checkpoint, key="--checkpoint")
    raise ConfigError(
        f"--tokenizer: needed, since --checkpoint {checkpoint!r} holds no tokenizer "
        "(tokenizer.json, tokenizer.model or original/tokenizer.model); give a tokenizer file or "
        "a Hugging Face model folder"
    )


def greedy(net, prompt_ids: list[int], max_new_tokens: int, eos_id: int, max_len: int) -> list[int]:
    import torch

    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = ids[-max_len:]
            logits = net(torch.tensor([window]))[0, -1]
            nxt = int(torch.argmax(logits))
            ids.append(nxt)
            new.append(nxt)
            if nxt == eos_id:
                break
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer file or folder (default: the --checkpoint folder's, for a Hugging Face "
        "model folder)",
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default=None)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()

    tok = load_tokenizer(a.tokenizer, a.checkpoint)
    net, args = load_model(a.checkpoint, a.model, a.flavor)
    prompt_ids = tok.encode(a.prompt, bos=True, eos=False)
    if max(prompt_ids, default=0) >= args.vocab_size:
        from torchtitan.errors import ConfigError

        raise ConfigError(
            f"--tokenizer: the prompt holds token id {max(prompt_ids)}, beyond the model's "
            f"vocabulary ({args.vocab_size}): the tokenizer is not this model's"
        )
    new = greedy(net, prompt_ids, a.max_new_tokens, tok.eos_id, args.max_seq_len)
    text = tok.decode(new)
    if a.json:
        print(json.dumps({"prompt_ids": prompt_ids, "output_ids": new, "text": text}))
    else:
        print(a.prompt + text)


if __name__ == "__main__":
    run(main)
