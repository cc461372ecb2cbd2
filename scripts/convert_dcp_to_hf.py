"""DCP checkpoint folder -> Hugging Face model folder that ``transformers`` loads.

    python scripts/convert_dcp_to_hf.py CHECKPOINT_DIR OUT_DIR --model llama3 --flavor 8B \\
        [--tokenizer PATH] [--dtype bfloat16] [--max_shard_gb 5]

CHECKPOINT_DIR is a ``step-N`` folder (any parallel layout wrote it). The vocabulary size is read
from the checkpoint; the tokenizer (optional) gives config.json its bos / eos ids, and its files
for ``AutoTokenizer`` are written too.
"""

from __future__ import annotations

import argparse
import dataclasses

from _common import progress, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max_shard_gb", type=float, default=5.0)
    a = parser.parse_args()

    import torch

    from torchtitan.checkpoint import read_model_weights
    from torchtitan.checkpoint.hf_files import write_folder
    from torchtitan.data.hf_tokenizer import write_tokenizer_files
    from torchtitan.models.spec import get_model_args, get_model_spec

    state = read_model_weights(a.checkpoint, progress=progress("read checkpoint"))
    vocab = state["tok_embeddings.weight"].shape[0]
    args = dataclasses.replace(get_model_args(a.model, a.flavor), vocab_size=vocab)
    dtype = getattr(torch, a.dtype)
    bos = eos = None
    if a.tokenizer:
        from torchtitan.data.tokenizer import build_tokenizer

        tok = build_tokenizer(a.tokenizer)
        bos, eos = tok.bos_id, tok.eos_id
    spec = get_model_spec(a.model)
    if spec.state_dict_adapter is None:
        raise SystemExit(f"--model: {a.model} has no Hugging Face state-dict adapter")
    adapter = spec.state_dict_adapter(args)
    hf_state = {k: v.to(dtype) for k, v in adapter.to_hf(state).items()}
    files = write_folder(
        a.out_dir,
        hf_state,
        adapter.hf_config(dtype=dtype, bos_id=bos, eos_id=eos),
        max_shard_bytes=int(a.max_shard_gb * (1 << 30)),
    )
    if a.tokenizer:
        files += write_tokenizer_files(a.out_dir, tok, args.max_seq_len)
    print(f"wrote {a.out_dir}: config.json, {', '.join(files)}")


if __name__ == "__main__":
    run(main)
