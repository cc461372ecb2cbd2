"""Data loader throughput: tokens/s one data-parallel rank's loader produces on one CPU core.

Builds the training loader exactly as ``train.py`` does (the trainer's
tokenizer and data loader builders: read, tokenize, pack into ``seq_len + 1``
windows, shard over data-parallel ranks), pins the process to one CPU core with one torch thread,
and times ``--batches`` batches after a first (warm-up) batch, which is reported on its own, as is
the preparation time of the loader (corpus build and Arrow conversion on a fresh cache, ``--cold``).

The rate is compared with what one H100 consumes when training Llama 3.1 8B: at most about
9,000 tokens/s per GPU (see ``TARGET_DERIVATION`` below and docs/dataloader_throughput.md). The
loader passes with at least 3x headroom.

Usage::

    python benchmarks/dataloader_throughput.py                      # python_docs, test tokenizer
    python benchmarks/dataloader_throughput.py --bpe-vocab 128000   # + a Llama-3-sized BPE
    python benchmarks/dataloader_throughput.py --dp-world-size 4 --dp-rank all --cold
    python benchmarks/dataloader_throughput.py --dataset-path data/ --tokenizer tokenizer.model
    python benchmarks/dataloader_throughput.py --batches 5 --json   # for machines

``--bpe-vocab N`` trains a byte-level BPE with the Llama 3 pre-tokenizer and N mergeable tokens
(Llama 3: 128,000, plus 256 special tokens) on local text that is not the benchmark's (the Python
sources of this interpreter's site-packages), writes it as a tiktoken BPE file and adds it as a
setting; it is cached, so only the first run pays for training (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_TOKENIZER = ROOT / "tests" / "assets" / "tokenizer" / "tiktoken.model"

# ---- the target: tokens/s one H100 consumes training Llama 3.1 8B (seq_len 8192)

H100_BF16_DENSE_PEAK = 989e12  # FLOP/s, H100 SXM dense bf16
LLAMA3_8B_PARAMS = 8.0e9
LLAMA3_8B_LAYERS, LLAMA3_8B_DIM, LLAMA3_8B_SEQ = 32, 4096, 8192
PUBLISHED_MFU = (0.33, 0.39)  # torchtitan, Llama 3.1 8B, 8 H100s, FSDP, bf16, without Float8
FLOPS_PER_TOKEN = 6 * LLAMA3_8B_PARAMS + 6 * LLAMA3_8B_LAYERS * LLAMA3_8B_DIM * LLAMA3_8B_SEQ
GPU_TOKENS_PER_S = 9000.0  # the upper end of the per-GPU range, rounded up (see the derivation)
REQUIRED_HEADROOM = 3.0  # tokenizing on the fly
REQUIRED_HEADROOM_PRETOKENIZED = 100.0  # reading a pretokenized corpus: no tokenizer in the loop
TARGET_DERIVATION = (
    "tokens/s/GPU = MFU x 989e12 (H100 SXM dense bf16 peak) / (6 x 8.0e9 params + 6 x 32 layers "
    f"x 4096 dim x 8192 seq = {FLOPS_PER_TOKEN / 1e9:.2f}e9 FLOPs/token): "
    + ", ".join(
        f"{m:.0%} MFU -> {m * H100_BF16_DENSE_PEAK / FLOPS_PER_TOKEN:,.0f}" for m in PUBLISHED_MFU
    )
    + " (torchtitan's published 33-39% MFU for Llama 3.1 8B on 8 H100s; its Float8 run reports "
    f"8,532 tokens/s/GPU); target {GPU_TOKENS_PER_S:,.0f} tokens/s/GPU, the upper end rounded up"
)

# ---- a Llama-3-sized BPE trained locally

BPE_FORMAT_VERSION = 1


def _training_texts(limit_bytes: int):
    """Python sources of this interpreter's site-packages, sorted by path, up to the limit: local
    text that is not the benchmark's (the debug corpus comes from the standard library)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    used = 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        used += len(text.encode("utf-8"))
        if used >= limit_bytes:
            return


def train_bpe(out: str, vocab: int, train_mb: int) -> dict:
    """Train a byte-level BPE with the Llama 3 pre-tokenizer and write it as a tiktoken BPE file.

    Runs in a child process (``tokenizers`` starts a thread pool, which must not share the
    measured core). Checks that tiktoken, reading the file, encodes as ``tokenizers`` does.
    """
    sys.path.insert(0, str(ROOT))
    from tokenizers import Regex, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    sys.path.insert(0, str(ROOT / "scripts"))
    from build_test_tokenizers import tiktoken_file_bytes

    from torchtitan.data.hf_tokenizer import byte_to_unicode
    from torchtitan.data.tokenizer import LLAMA3_SPLIT_PATTERN, TikTokenizer

    t0 = time.perf_counter()
    hf = HFTokenizer(BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_training_texts(train_mb << 20), trainer)
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    # ids are merge order (the 256 bytes, then each merge), which is tiktoken's rank order
    ranks = {bytes(to_byte[c] for c in token): i for token, i in hf.get_vocab().items()}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError("trained BPE ids are not 0..N-1")
    tmp = f"{out}.tmp-{os.getpid()}"
    Path(tmp).write_bytes(tiktoken_file_bytes(ranks))
    check = TikTokenizer(tmp)
    sample = "".join(_training_texts(256 << 10))[: 256 << 10]
    if check.encode(sample, bos=False, eos=False) != hf.encode(sample).ids:
        raise RuntimeError("the tiktoken file does not encode as the trained BPE does")
    os.replace(tmp, out)
    info = {"vocab": len(ranks), "train_mb": train_mb, "train_s": time.perf_counter() - t0}
    Path(out).with_suffix(".json").write_text(json.dumps(info))
    return info


def local_bpe(vocab: int, train_mb: int, cache: Path) -> Path:
    """The cached locally trained BPE file, trained (in a child process) if missing."""
    path = cache / f"bpe-{vocab}-{train_mb}mb-v{BPE_FORMAT_VERSION}.model"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"training a {vocab:,}-token BPE on {train_mb} MB of local text ...", file=sys.stderr)
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            info = pool.submit(train_bpe, str(path), vocab, train_mb).result()
        print(f"  done in {info['train_s']:.0f} s: {path}", file=sys.stderr)
    return path


# ---- measuring


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def threads_pinned(core: int) -> bool:
    """Whether every thread of this process may run only on ``core``."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return os.sched_getaffinity(0) == {core}
    return all(os.sched_getaffinity(int(t.name)) == {core} for t in tasks.iterdir())


def tokenizer_label(path: str, n_words: int, bpe: Path | None) -> str:
    if bpe is not None and Path(path) == bpe:
        return f"local BPE {n_words:,}"
    if Path(path).resolve() == TEST_TOKENIZER.resolve():
        return f"test tiktoken {n_words:,}"
    return f"{Path(path).name} {n_words:,}"


def _training_args(args, corpus: str | None = None) -> list[str]:
    """The benchmark's options as the train.py arguments they stand for (``corpus``: read this
    pretokenized corpus instead of the text source)."""
    out = [
        "--training.dataset",
        args.dataset,
        "--training.local_batch_size",
        str(args.local_batch_size),
        "--training.seq_len",
        str(args.seq_len),
        "--training.shuffle",
        str(args.shuffle).lower(),
    ]
    if corpus is not None:
        return out + ["--training.dataset_path", corpus]
    if args.text_field:
        out += ["--training.dataset_text_field", args.text_field]
    if args.dataset_path:
        out += ["--training.dataset_path", args.dataset_path]
    if args.streaming is not None:
        out += ["--training.dataset_streaming", str(args.streaming).lower()]
    return out


def measure(
    args,
    tokenizer_path: str,
    dp_rank: int,
    bpe: Path | None,
    fresh: bool,
    corpus: str | None = None,
) -> dict:
    """Build one rank's loader as train.py does and time it (on ``corpus`` if given)."""
    import torch

    from torchtitan.config.parse import parse_args
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.train.builders import dataloader_for

    job_config = parse_args(_training_args(args, corpus), need_files=False)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(tokenizer_path)
    t1 = time.perf_counter()
    global_batch = args.global_batch_size or args.local_batch_size * args.dp_world_size
    loader = dataloader_for(job_config, tokenizer, dp_rank, args.dp_world_size, global_batch)
    t2 = time.perf_counter()
    it = iter(loader)
    first_inputs = next(it).inputs  # a Batch (inputs, labels, doc_ids)
    t3 = time.perf_counter()
    times, tokens = [], 0
    last = first_inputs
    cpu0 = time.process_time()
    for _ in range(args.batches):
        s = time.perf_counter()
        inputs = next(it).inputs
        times.append(time.perf_counter() - s)
        tokens += inputs.numel()
        last = inputs
    cpu_seconds = time.process_time() - cpu0
    seconds = sum(times)
    rate = tokens / seconds if seconds > 0 else float("inf")
    median = statistics.median(times)
    # chars per token of the last batch (BOS/EOS left out): how much text a token stands for
    ids = [i for i in last.flatten().tolist() if i not in (tokenizer.bos_id, tokenizer.eos_id)]
    chars_per_token = len(tokenizer.decode(ids)) / max(1, len(ids))
    shards = loader.shards
    label = tokenizer_label(tokenizer_path, tokenizer.n_words, bpe)
    kind = "pretokenized" if corpus else "on the fly"
    setting = f"{kind} | {label} | dp {dp_rank}/{args.dp_world_size}"
    setting += "" if corpus else f" | {'fresh' if fresh else 'reused'}"
    headroom = rate / GPU_TOKENS_PER_S
    required = REQUIRED_HEADROOM_PRETOKENIZED if corpus else REQUIRED_HEADROOM
    return {
        "setting": setting,
        "tokenizer": str(tokenizer_path),
        "tokenizer_words": tokenizer.n_words,
        "chars_per_token": round(chars_per_token, 3),
        "dp_rank": dp_rank,
        "dp_world_size": args.dp_world_size,
        "virtual_shards": [shards.start, shards.stop - 1, loader.virtual_shards],
        "rows_on_rank": loader.num_rows,
        "first_tokens": first_inputs[0, :8].tolist(),
        "cache": "fresh" if fresh else "reused",
        "tokenizer_load_s": round(t1 - t0, 4),
        "prep_s": round(t2 - t1, 4),
        "first_batch_ms": round((t3 - t2) * 1e3, 3),
        "batches": args.batches,
        "local_batch_size": args.local_batch_size,
        "seq_len": args.seq_len,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": round(rate, 1),
        # on a shared machine: the rate per CPU-second of this process, and from the median batch
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": round(tokens / cpu_seconds, 1) if cpu_seconds > 0 else None,
        "tokens_per_s_median_batch": round(tokens / args.batches / median, 1) if median else None,
        "ms_per_batch": round(seconds / max(1, args.batches) * 1e3, 3),
        "ms_per_batch_max": round(max(times, default=0.0) * 1e3, 3),
        "headroom": round(headroom, 3),
        "required_headroom": required,
        "pass": headroom >= required,
        "torch_threads": torch.get_num_threads(),
    }


def print_table(result: dict) -> None:
    rows = result["rows"]
    cfg = result["config"]
    source = cfg["dataset_path"] or cfg["dataset"]
    print(
        f"Data loader throughput: {source}, local batch {cfg['local_batch_size']} x seq_len "
        f"{cfg['seq_len']}, {cfg['batches']} timed batches after 1 warm-up batch, pinned to CPU "
        f"core {result['host']['core']} ({result['host']['cpu_model']}), 1 torch thread"
    )
    head = (
        f"{'setting':<60}{'tokens/s/rank':>14}{'tok/CPU-s':>12}{'ms/batch':>10}{'1st batch ms':>13}"
        f"{'prep s':>9}{'chars/tok':>10}{'headroom':>10}  result"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['setting']:<60}{r['tokens_per_s']:>14,.0f}{r['tokens_per_cpu_s'] or 0:>12,.0f}"
            f"{r['ms_per_batch']:>10.2f}"
            f"{r['first_batch_ms']:>13.2f}{r['prep_s']:>9.3f}{r['chars_per_token']:>10.2f}"
            f"{r['headroom']:>9.1f}x  {'PASS' if r['pass'] else 'FAIL'} (>= "
            f"{r['required_headroom']:g}x)"
        )
    print(
        f"\nheadroom = tokens/s per rank (wall clock) / {GPU_TOKENS_PER_S:,.0f}; PASS at >= "
        f"{REQUIRED_HEADROOM:g}x tokenizing on the fly, >= {REQUIRED_HEADROOM_PRETOKENIZED:g}x "
        "reading a pretokenized corpus. tok/CPU-s: the same tokens per CPU-second of this process "
        f"(less sensitive to other load on the machine).\nTarget: {TARGET_DERIVATION}."
    )
    for note in result["caveats"]:
        print(f"note: {note}")
    print(f"overall: {'PASS' if result['pass'] else 'FAIL'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="python_docs", help="a named dataset (train.py's)")
    p.add_argument("--dataset-path", default=None, help="local jsonl/parquet/txt file or folder")
    p.add_argument("--text-field", default=None)
    p.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stream the dataset (default: the dataset's own default)",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        default=None,
        help="tokenizer file; repeat to compare several "
        f"(default {TEST_TOKENIZER.relative_to(ROOT)})",
    )
    p.add_argument(
        "--bpe-vocab",
        type=int,
        default=0,
        help="also measure a locally trained BPE with this many mergeable tokens (Llama 3: 128000)",
    )
    p.add_argument("--bpe-train-mb", type=int, default=100, help="MB of text to train it on")
    p.add_argument(
        "--bpe-cache",
        type=Path,
        default=None,
        help="folder for the trained BPE (default: <torchtitan cache>/bench_bpe)",
    )
    p.add_argument(
        "--pretokenized",
        default=None,
        help="also measure the loader on this pretokenized corpus (scripts/tokenize_dataset.py "
        "output, or a Megatron .bin/.idx prefix or folder); 'auto' tokenizes the source first",
    )
    p.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="training.shuffle (default on, as in training)",
    )
    p.add_argument("--local-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--dp-world-size", type=int, default=1)
    p.add_argument(
        "--dp-rank", default="0", help="data-parallel rank(s): N, a comma list, or 'all'"
    )
    p.add_argument("--batches", type=int, default=50, help="timed batches after the first")
    p.add_argument("--core", type=int, default=None, help="CPU core to pin to (default: first)")
    p.add_argument(
        "--cold",
        action="store_true",
        help="fresh TORCHTITAN_CACHE and HF_DATASETS_CACHE: the first setting's prep time "
        "includes building the corpus and converting it to Arrow",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.dp_rank == "all":
        args.dp_ranks = list(range(args.dp_world_size))
    else:
        args.dp_ranks = [int(r) for r in args.dp_rank.split(",")]
    if any(not 0 <= r < args.dp_world_size for r in args.dp_ranks):
        p.error(f"--dp-rank {args.dp_rank}: ranks must be in [0, {args.dp_world_size})")
    if args.batches < 1:
        p.error("--batches must be >= 1")
    return args


def _caveats(args, rows: list[dict], bpe: Path | None) -> list[str]:
    """What the numbers do and do not say, printed under the table."""
    small = {r["tokenizer"]: r["tokenizer_words"] for r in rows if r["tokenizer_words"] < 100_000}
    notes = [
        f"{path} has {words:,} words; the Llama 3 tokenizer is a 128,256-word tiktoken BPE, "
        "whose speed per token differs: measure it with --tokenizer <original/tokenizer.model>, "
        "or a locally trained BPE of that size with --bpe-vocab 128000"
        for path, words in small.items()
    ]
    if bpe is not None:
        notes.append(
            f"local BPE: {bpe} (trained on {args.bpe_train_mb} MB of site-packages .py files with "
            "the Llama 3 pre-tokenizer); real Llama 3 merges differ, so its chars/token and "
            "speed are an approximation"
        )
    notes.append(
        "tokens/s count only the timed batches (batches x local batch x seq_len); the first batch "
        "and prep time (building the loader: corpus and Arrow cache, shards) are shown apart"
    )
    return notes


def _result(args, rows: list[dict], core: int, torch_version: str, caveats: list[str]) -> dict:
    return {
        "benchmark": "dataloader_throughput",
        "date": date.today().isoformat(),
        "host": {
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "core": core,
            "threads_pinned": threads_pinned(core),
            "python": platform.python_version(),
            "torch": torch_version,
        },
        "config": {
            "dataset": args.dataset,
            "dataset_path": args.dataset_path,
            "streaming": args.streaming,
            "local_batch_size": args.local_batch_size,
            "seq_len": args.seq_len,
            "global_batch_size": args.global_batch_size,
            "dp_world_size": args.dp_world_size,
            "dp_ranks": args.dp_ranks,
            "batches": args.batches,
            "cold": args.cold,
        },
        "target": {
            "gpu_tokens_per_s": GPU_TOKENS_PER_S,
            "required_headroom": REQUIRED_HEADROOM,
            "flops_per_token": FLOPS_PER_TOKEN,
            "derivation": TARGET_DERIVATION,
        },
        "rows": rows,
        "pass": all(r["pass"] for r in rows),
        "caveats": caveats,
    }


def _pretokenized(args, tokenizer_path: str) -> str:
    """The corpus ``--pretokenized`` names, or for 'auto' the benchmark's source tokenized with
    ``tokenizer_path`` by scripts/tokenize_dataset.py (all cores, before the process is pinned;
    kept in the torchtitan cache)."""
    import hashlib

    from torchtitan.data.pydoc_corpus import default_cache_dir

    train = _training_args(args) + ["--model.tokenizer_path", tokenizer_path]
    key = hashlib.sha256(" ".join(train).encode()).hexdigest()[:12]
    out = default_cache_dir() / "bench_pretokenized" / key
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tokenize_throughput import load_tokenize_script

    tokenize = load_tokenize_script()
    with contextlib.redirect_stdout(sys.stderr):  # its summary line; stdout is the table / JSON
        tokenize.main([*train, "--output", str(out), "--workers", str(os.cpu_count() or 1)])
    return str(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from torchtitan.data.pydoc_corpus import default_cache_dir

    bpe = None
    if args.bpe_vocab:
        # trained before pinning, with all cores, and kept out of a cold cache
        bpe = local_bpe(
            args.bpe_vocab, args.bpe_train_mb, args.bpe_cache or default_cache_dir() / "bench_bpe"
        )
    tokenizers = [str(t) for t in (args.tokenizer or [TEST_TOKENIZER])]
    if bpe is not None:
        tokenizers.append(str(bpe))

    corpora: dict[str, str] = {}
    if args.pretokenized == "auto":
        corpora = {tok: _pretokenized(args, tok) for tok in tokenizers}
    elif args.pretokenized:  # a corpus written with one tokenizer: the first one given
        corpora = {tokenizers[0]: args.pretokenized}
    cold_dir = None
    if args.cold:
        cold_dir = tempfile.TemporaryDirectory(prefix="dataloader_throughput_")
        os.environ["TORCHTITAN_CACHE"] = os.path.join(cold_dir.name, "torchtitan")
        os.environ["HF_DATASETS_CACHE"] = os.path.join(cold_dir.name, "hf_datasets")

    # One core, one thread, set before torch/datasets/tokenizers start any thread (new threads
    # inherit the affinity); threads_pinned() checks it afterwards.
    core = args.core if args.core is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[var] = "1"
    import torch

    torch.set_num_threads(1)

    rows = []
    try:
        for tok in tokenizers:
            for rank in args.dp_ranks:
                rows.append(measure(args, tok, rank, bpe, fresh=args.cold and not rows))
            for rank in args.dp_ranks if corpora.get(tok) else []:
                rows.append(measure(args, tok, rank, bpe, fresh=False, corpus=corpora[tok]))
    finally:
        if cold_dir is not None:
            cold_dir.cleanup()

    result = _result(args, rows, core, torch.__version__, _caveats(args, rows, bpe))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
