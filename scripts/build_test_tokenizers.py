#!/usr/bin/env python
"""Train the project's two small test tokenizers from the offline pydoc corpus.

Writes ``tests/assets/tokenizer/tiktoken.model`` (a byte-level BPE with 2000 mergeable ranks in
tiktoken's file format, Llama 3 style) and ``tests/assets/tokenizer/sentencepiece.model`` (a
SentencePiece BPE with 2000 pieces, Llama 2 style). Training is deterministic: the same corpus
gives byte-identical files. The corpus is the running interpreter's standard-library
documentation, so another Python version gives a different corpus (and different files);
``CORPUS_SHA256`` records the corpus the committed files were trained on.

    python scripts/build_test_tokenizers.py [--out_dir DIR] [--check]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import heapq
import io
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from torchtitan.data.pydoc_corpus import build_documents  # noqa: E402
from torchtitan.data.tokenizer import LLAMA3_SPLIT_PATTERN  # noqa: E402

VOCAB_SIZE = 2000
ASSET_DIR = REPO_ROOT / "tests" / "assets" / "tokenizer"
TIKTOKEN_FILE = "tiktoken.model"
SENTENCEPIECE_FILE = "sentencepiece.model"

# sha256 of the corpus (see corpus_fingerprint) the committed assets were trained on, and the
# interpreter that produced it. Update both when regenerating the assets on another Python.
CORPUS_SHA256 = "86a6ce76c5c6b77ad05d67399a1c685193420663df68415e3ce8e7f183d40dda"
CORPUS_PYTHON = "3.11.7"


def corpus_documents() -> list[str]:
    """The training documents, in their fixed order."""
    return build_documents()


def corpus_fingerprint(docs: Sequence[str]) -> str:
    """sha256 over the documents (each length-prefixed, so boundaries count)."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Byte-level BPE, trained so that tiktoken's encoder reproduces it exactly.
#
# tiktoken encodes a pre-tokenized piece by starting from single bytes and repeatedly merging the
# adjacent pair whose concatenation has the lowest rank (leftmost on ties) until no adjacent
# concatenation is in the vocabulary. The trainer keeps every word in exactly that end state for
# the vocabulary learned so far. Adding a token with a rank above all others leaves that process
# unchanged up to the old end state, so a word's new segmentation is found by resuming the merge
# loop from its old one. Each step adds the most frequent adjacent concatenation (counted over all
# words, weighted by word frequency; ties go to the smallest bytes). Since every adjacent
# concatenation is absent from the vocabulary in the end state, each new token is new bytes, and
# its rank is higher than the ranks of the two tokens it joins.
# ---------------------------------------------------------------------------------------------


def pretokenize(docs: Iterable[str]) -> Counter[bytes]:
    """Count the Llama 3 pre-tokenizer's pieces (as UTF-8 bytes) over ``docs``."""
    import regex

    pattern = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: Counter[bytes] = Counter()
    for doc in docs:
        counts.update(piece.encode("utf-8") for piece in pattern.findall(doc))
    return counts


def _resume_merges(parts: list[bytes], ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's merge loop: join the lowest-rank adjacent pair (leftmost on ties) until none."""
    while len(parts) > 1:
        best = -1
        best_rank = len(ranks)
        for j in range(len(parts) - 1):
            rank = ranks.get(parts[j] + parts[j + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = j, rank
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def train_bpe(word_counts: dict[bytes, int], num_ranks: int) -> dict[bytes, int]:
    """Mergeable ranks (token bytes -> rank) of a byte-level BPE with ``num_ranks`` tokens.

    Ranks 0-255 are the single bytes in byte order; the rest are learned from ``word_counts``.
    """
    if num_ranks < 256:
        raise ValueError(f"num_ranks must be at least 256, got {num_ranks}")
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    words: list[list[bytes]] = []
    freqs: list[int] = []
    for word in sorted(word_counts):
        words.append([word[k : k + 1] for k in range(len(word))])
        freqs.append(word_counts[word])

    pair_count: dict[bytes, int] = {}
    pair_words: dict[bytes, set[int]] = {}
    for i, parts in enumerate(words):
        for j in range(len(parts) - 1):
            key = parts[j] + parts[j + 1]
            pair_count[key] = pair_count.get(key, 0) + freqs[i]
            pair_words.setdefault(key, set()).add(i)
    heap = [(-count, key) for key, count in pair_count.items()]
    heapq.heapify(heap)

    while len(ranks) < num_ranks:
        # Most frequent concatenation; heap entries whose count is out of date are skipped.
        while heap:
            neg_count, token = heapq.heappop(heap)
            if pair_count.get(token, 0) == -neg_count > 0:
                break
        else:
            raise ValueError(f"corpus too small: only {len(ranks)} tokens could be learned")
        ranks[token] = len(ranks)

        changed: set[bytes] = set()
        for i in sorted(pair_words.get(token, ())):
            old = words[i]
            freq = freqs[i]
            for j in range(len(old) - 1):
                key = old[j] + old[j + 1]
                pair_count[key] -= freq
                pair_words[key].discard(i)
                changed.add(key)
            new = _resume_merges(list(old), ranks)
            words[i] = new
            for j in range(len(new) - 1):
                key = new[j] + new[j + 1]
                pair_count[key] = pair_count.get(key, 0) + freq
                pair_words.setdefault(key, set()).add(i)
                changed.add(key)
        for key in sorted(changed):
            count = pair_count[key]
            if count > 0:
                heapq.heappush(heap, (-count, key))
            else:
                del pair_count[key]
                pair_words.pop(key, None)
        if pair_count.get(token):
            raise AssertionError("a learned token is still an adjacent pair somewhere")
    return ranks


def tiktoken_file_bytes(ranks: dict[bytes, int]) -> bytes:
    """``ranks`` in tiktoken's BPE file format: one ``<base64 token> <rank>`` line per token."""
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    return b"\n".join(lines) + b"\n"


def train_tiktoken_model(docs: Sequence[str], vocab_size: int = VOCAB_SIZE) -> bytes:
    """The tiktoken BPE file (``vocab_size`` mergeable ranks) trained on ``docs``."""
    return tiktoken_file_bytes(train_bpe(pretokenize(docs), vocab_size))


def verify_tiktoken_model(path: Path, docs: Sequence[str]) -> None:
    """Check that tiktoken, through TikTokenizer, reproduces the trained segmentation exactly and
    round-trips the corpus; raise AssertionError otherwise."""
    from torchtitan.data.tokenizer import TikTokenizer, read_tiktoken_ranks

    ranks = read_tiktoken_ranks(path)
    tok = TikTokenizer(path)
    word_counts = pretokenize(docs)
    # A token's bytes alone must encode to that token: every learned token is reachable.
    for token, rank in ranks.items():
        got = tok._model._encode_bytes(token)
        if got != [rank]:
            raise AssertionError(f"token {token!r} (rank {rank}) encodes to {got}")
    # Every training word must get the trainer's segmentation.
    for word in word_counts:
        expected = [ranks[p] for p in _resume_merges([bytes([b]) for b in word], ranks)]
        got = tok.encode(word.decode("utf-8"), bos=False, eos=False)
        if got != expected:
            raise AssertionError(f"tiktoken splits {word!r} as {got}, the trainer as {expected}")
    for doc in docs:
        if tok.decode(tok.encode(doc, bos=False, eos=False)) != doc:
            raise AssertionError("a corpus document does not round-trip")


# ---------------------------------------------------------------------------------------------
# SentencePiece (Llama 2 conventions)
# ---------------------------------------------------------------------------------------------


def _sentences(docs: Iterable[str]) -> Iterable[str]:
    # SentencePiece reads one sentence per input line; feed it the corpus line by line.
    for doc in docs:
        for line in doc.splitlines():
            if line.strip():
                yield line


def train_sentencepiece_model(docs: Sequence[str], vocab_size: int = VOCAB_SIZE) -> bytes:
    """The serialized SentencePiece BPE model (``vocab_size`` pieces) trained on ``docs``."""
    import sentencepiece as spm

    spm.set_random_generator_seed(0)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(_sentences(docs))),
        model_writer=out,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.99995,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        max_sentence_length=16384,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return out.getvalue()


# ---------------------------------------------------------------------------------------------


def build_assets(docs: Sequence[str]) -> dict[str, bytes]:
    """File name -> contents of both test tokenizers."""
    return {
        TIKTOKEN_FILE: train_tiktoken_model(docs),
        SENTENCEPIECE_FILE: train_sentencepiece_model(docs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out_dir", type=Path, default=ASSET_DIR, help="where to write (default: %(default)s)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if training does not reproduce the files in --out_dir",
    )
    args = parser.parse_args(argv)

    docs = corpus_documents()
    fingerprint = corpus_fingerprint(docs)
    if fingerprint != CORPUS_SHA256:
        print(
            f"note: this corpus (Python {sys.version.split()[0]}, sha256 {fingerprint}) differs "
            f"from the one the committed assets were trained on (Python {CORPUS_PYTHON}); "
            f"the files will differ too",
            file=sys.stderr,
        )
    assets = build_assets(docs)

    if args.check:
        stale = [
            name
            for name, data in assets.items()
            if not (args.out_dir / name).is_file() or (args.out_dir / name).read_bytes() != data
        ]
        for name in stale:
            print(f"{args.out_dir / name}: differs from a fresh build", file=sys.stderr)
        return 1 if stale else 0

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in assets.items():
        (args.out_dir / name).write_bytes(data)
    verify_tiktoken_model(args.out_dir / TIKTOKEN_FILE, docs)

    from torchtitan.data.tokenizer import build_tokenizer

    for name, data in assets.items():
        path = args.out_dir / name
        tok = build_tokenizer(str(path))
        digest = hashlib.sha256(data).hexdigest()
        print(f"{path}: {type(tok).__name__}, n_words={tok.n_words}, sha256={digest}")
    print(f"corpus: {len(docs)} documents, sha256 {fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
