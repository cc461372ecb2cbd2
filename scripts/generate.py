"""Text generation (greedy, or sampled) from a DCP checkpoint or a Hugging Face model folder.

    python scripts/generate.py --checkpoint DIR [--tokenizer PATH] --prompt TEXT \\
        [--max_new_tokens 32] [--model llama3 --flavor 8B] [--json] \\
        [--temperature 0.8 [--top_k 50] [--top_p 0.95] [--seed 0]]

DIR is a ``step-N`` DCP folder (give ``--flavor`` and ``--tokenizer``) or a Hugging Face model
folder with ``config.json`` and safetensors (an export, or a download: the hyper-parameters come
from config.json, and the tokenizer from the folder when ``--tokenizer`` is not given). PATH is a
tokenizer file or a folder holding one (tokenizer.json, tokenizer.model or
original/tokenizer.model). The prompt is encoded with the tokenizer (bos first); generation stops
after ``--max_new_tokens`` or at eos. Each token is the most likely one (greedy, the default), or
with ``--temperature`` above 0 drawn from the softmax of the logits divided by it, among the
``--top_k`` most likely tokens and those within ``--top_p`` of the probability, with a generator
seeded by ``--seed`` (the same seed gives the same tokens). ``--json``
makes the last stdout line ``{"prompt_ids": [...], "output_ids": [...], "text": "..."}``
(output_ids: the new tokens only; text: their decoding; with sampling also ``"seed"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NamedTuple

from _common import progress, run


def load_model(checkpoint: str, model: str, flavor: str | None):
    from torchtitan.evaluation.inference import load_model as load

    return load(checkpoint, model, flavor, progress=progress("read checkpoint"))


def load_tokenizer(tokenizer: str | None, checkpoint: str):
    """``--tokenizer`` (a file or a folder), else the tokenizer of the ``--checkpoint`` folder."""
    from torchtitan.evaluation.inference import load_tokenizer as load

    return load(tokenizer, checkpoint)


class Sampling(NamedTuple):
    """How the next token is chosen: ``temperature`` 0 takes the most likely one (greedy);
    above 0 it is drawn from ``softmax(logits / temperature)``, kept to the ``top_k`` most likely
    tokens (0: all) and to the fewest whose probabilities add up to ``top_p`` (1: all), with a
    generator seeded by ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def next_token(logits, sampling: Sampling, generator) -> int:
    """The token after ``logits`` (the last position's, one per vocabulary entry)."""
    import torch

    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kept = torch.full_like(logits, float("-inf"))
        kept[torch.topk(logits, sampling.top_k).indices] = 0.0
        logits = logits + kept
    if sampling.top_p < 1:
        probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True)
        above = torch.cumsum(probs, dim=0) - probs  # the probability of the tokens ranked higher
        logits[order[above >= sampling.top_p]] = float("-inf")  # the most likely always stays
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def generate(
    net,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_id: int,
    max_len: int,
    sampling: Sampling = GREEDY,
) -> list[int]:
    """Up to ``max_new_tokens`` new tokens after ``prompt_ids`` (stopping after ``eos_id``),
    each from the model's logits over the last ``max_len`` tokens; greedy by default."""
    import torch

    generator = torch.Generator().manual_seed(sampling.seed)
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = ids[-max_len:]
            logits = net(torch.tensor([window]))[0, -1]
            nxt = next_token(logits, sampling, generator)
            ids.append(nxt)
            new.append(nxt)
            if nxt == eos_id:
                break
    return new


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a DCP step-N folder (give --flavor) or a Hugging Face model folder (config.json "
        "and safetensors: an export or a download)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer file or folder (default: the --checkpoint folder's, for a Hugging Face "
        "model folder)",
    )
    parser.add_argument("--prompt", required=True, help="the text to continue (BOS is put first)")
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=32,
        help="tokens to generate at most; it stops earlier at EOS (default: 32)",
    )
    parser.add_argument(
        "--model",
        default="llama3",
        help="model family of a DCP checkpoint (llama3, qwen3, ...); a Hugging Face folder "
        "names its own (default: llama3)",
    )
    parser.add_argument(
        "--flavor", default=None, help="flavor of a DCP checkpoint (debugmodel, 8B, ...)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (the default): greedy, always the most likely token; above 0: sample from "
        "softmax(logits / temperature), so that higher is more varied (e.g. 0.8)",
    )
    parser.add_argument(
        "--top_k",
        type=int,
        default=0,
        help="sample only among the k most likely tokens (0, the default: all; 1 is greedy); "
        "needs --temperature > 0",
    )
    parser.add_argument(
        "--top_p",
        type=float,
        default=1.0,
        help="sample only among the fewest most likely tokens whose probabilities add up to p "
        "(nucleus sampling; 1, the default: all); needs --temperature > 0",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampling: the same seed, checkpoint, prompt and options give the "
        "same tokens (default: a random seed, printed on stderr)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print one JSON line: {"prompt_ids": [...], "output_ids": [...] (the new tokens '
        'only), "text": "..." (their decoding)}, plus "seed" when sampling',
    )
    return parser


def sampling_from(a: argparse.Namespace) -> Sampling:
    """The checked sampling options; ConfigError (one line) naming a bad one."""
    from torchtitan.errors import ConfigError

    if a.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens: {a.max_new_tokens} must be >= 1")
    if not a.temperature >= 0:
        raise ConfigError(f"--temperature: {a.temperature} must be >= 0 (0 = greedy)")
    if a.top_k < 0:
        raise ConfigError(f"--top_k: {a.top_k} must be >= 0 (0 = every token)")
    if not 0 < a.top_p <= 1:
        raise ConfigError(f"--top_p: {a.top_p} must be in (0, 1] (1 = every token)")
    for name, off in (("top_k", 0), ("top_p", 1.0)):
        if a.temperature == 0 and getattr(a, name) != off:
            raise ConfigError(
                f"--{name}: has no effect with --temperature 0 (greedy takes the most likely "
                "token); give --temperature > 0 (e.g. 0.8) to sample"
            )
    if a.seed is not None and not 0 <= a.seed < 2**63:
        raise ConfigError(f"--seed: {a.seed} must be in [0, 2**63)")
    seed = a.seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
        if a.temperature > 0:
            print(f"sampling with seed {seed} (--seed {seed} repeats it)", file=sys.stderr)
    return Sampling(a.temperature, a.top_k, a.top_p, seed)


def main() -> None:
    a = build_parser().parse_args()
    sampling = sampling_from(a)
    tok = load_tokenizer(a.tokenizer, a.checkpoint)
    net, args = load_model(a.checkpoint, a.model, a.flavor)
    prompt_ids = tok.encode(a.prompt, bos=True, eos=False)
    if max(prompt_ids, default=0) >= args.vocab_size:
        from torchtitan.errors import ConfigError

        raise ConfigError(
            f"--tokenizer: the prompt holds token id {max(prompt_ids)}, beyond the model's "
            f"vocabulary ({args.vocab_size}): the tokenizer is not this model's"
        )
    new = generate(net, prompt_ids, a.max_new_tokens, tok.eos_id, args.max_seq_len, sampling)
    text = tok.decode(new)
    if a.json:
        out = {"prompt_ids": prompt_ids, "output_ids": new, "text": text}
        print(json.dumps(out if sampling.greedy else {**out, "seed": sampling.seed}))
    else:
        print(a.prompt + text)


if __name__ == "__main__":
    run(main)
