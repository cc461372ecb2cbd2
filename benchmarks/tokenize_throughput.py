"""Corpus preparation throughput: ``scripts/tokenize_dataset.py`` against ``datasets.map``.

Tokenizes one source with the job's tokenizer three ways and prints tokens/s:

- the plain baseline: ``Dataset.map(batched=True)`` calling the same tokenizer's ``encode`` (BOS
  and EOS added, as the corpus holds them) in one process, the tokens kept in the Arrow cache;
- ``scripts/tokenize_dataset.py --workers 1`` and ``--workers 2`` (and more with ``--workers``),
  writing the ``.bin``/``.idx`` corpus.

The aim: the script at least as fast per worker as the baseline per process, and its rate growing
with workers. Every method starts from a fresh output folder and a fresh ``datasets`` cache for its
own outputs; the source's Arrow conversion is done once, before any timing.

Usage::

    python benchmarks/tokenize_throughput.py                          # python_docs, test tokenizer
    python benchmarks/tokenize_throughput.py --workers 1,2,4 --tokenizer path/tokenizer.model
    python benchmarks/tokenize_throughput.py --dataset-path data.jsonl --json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_tokenize_script():
    """``scripts/tokenize_dataset.py`` as a module (its ``main(argv)`` runs the script)."""
    spec = importlib.util.spec_from_file_location(
        "tokenize_dataset", ROOT / "scripts" / "tokenize_dataset.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_args(args) -> list[str]:
    out = ["--training.dataset", args.dataset]
    if args.dataset_path:
        out += ["--training.dataset_path", args.dataset_path]
    # the config's tokenizer path is relative to the repository; a given one to the caller
    tokenizer = args.tokenizer or str(ROOT / "tests" / "assets" / "tokenizer" / "tiktoken.model")
    return out + ["--model.tokenizer_path", tokenizer]


def baseline(args) -> dict:
    """``Dataset.map(batched=True)`` with the job's tokenizer, one process."""
    from torchtitan.config.parse import parse_args
    from torchtitan.data.sources import load_source
    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_source

    jc = parse_args(_train_args(args), need_files=False)
    path, key = tokenizer_source(jc.model)
    tok = build_tokenizer(path, key=key)
    t = jc.training
    src = load_source(dataset=t.dataset, dataset_path=t.dataset_path, streaming=False)
    field = src.text_field

    def encode(batch):
        return {"input_ids": [tok.encode(x, bos=True, eos=True) for x in batch[field]]}

    start = time.perf_counter()
    out = src.dataset.map(
        encode, batched=True, remove_columns=src.dataset.column_names, load_from_cache_file=False
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in out["input_ids"])
    return {
        "method": "datasets.map(batched=True)",
        "workers": 1,
        "tokens": tokens,
        "seconds": seconds,
        "documents": len(out),
    }


def ours(args, workers: int, folder: str) -> dict:
    script = load_tokenize_script()
    out = os.path.join(folder, f"w{workers}")
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its summary line; stdout is the table / JSON
        script.main([*_train_args(args), "--output", out, "--workers", str(workers)])
    seconds = time.perf_counter() - start
    manifest = json.loads(Path(out, "manifest.json").read_text())
    return {
        "method": "scripts/tokenize_dataset.py",
        "workers": workers,
        "tokens": manifest["tokens"],
        "seconds": seconds,
        "documents": manifest["documents"],
    }


def print_table(rows: list[dict], source: str) -> None:
    base = rows[0]["tokens"] / rows[0]["seconds"]
    print(
        f"Tokenizing {source} ({rows[0]['documents']:,} documents, {rows[0]['tokens']:,} tokens) "
        f"on {os.cpu_count()} CPUs"
    )
    head = (
        f"{'method':<32}{'workers':>8}{'seconds':>9}{'tokens/s':>12}{'per worker':>12}{'vs map':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        per = rate / r["workers"]
        print(
            f"{r['method']:<32}{r['workers']:>8}{r['seconds']:>9.2f}{rate:>12,.0f}{per:>12,.0f}"
            f"{per / base:>7.2f}x"
        )
    print("per worker = tokens/s / workers; vs map = per worker / the baseline's tokens/s. The")
    print("script's time includes starting its worker processes and writing the corpus.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="python_docs")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--tokenizer", default=None, help="default: the test tokenizer")
    p.add_argument("--workers", default="1,2", help="comma list of --workers values to time")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="tokenize_throughput_") as folder:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(folder, "hf")
        baseline(args)  # converts the source to Arrow once; the timed runs reuse it
        rows = [baseline(args)] + [ours(args, w, folder) for w in workers]
    consistent = len({(r["documents"], r["tokens"]) for r in rows}) == 1
    if args.json:
        print(json.dumps({"rows": rows, "same_tokens": consistent}, indent=2))
    else:
        print_table(rows, args.dataset_path or args.dataset)
        print(f"same documents and tokens in every method: {consistent}")
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
