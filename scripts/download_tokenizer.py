#!/usr/bin/env python
"""Download a Llama tokenizer file from the Hugging Face Hub.

    python scripts/download_tokenizer.py --repo_id meta-llama/Meta-Llama-3.1-8B \\
        [--hf_token TOKEN] [--tokenizer_path original] [--local_dir assets/tokenizer/]

Fetches ``<tokenizer_path>/tokenizer.model`` from the repository into ``local_dir`` and prints
its path, which is what ``model.tokenizer_path`` should point at. Llama repositories are gated:
accept the licence on the repository's Hub page, then pass a token with ``--hf_token`` or the
``HF_TOKEN`` environment variable. The token is never printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from huggingface_hub import hf_hub_download

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # also when loaded by path
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from download_hf_assets import explain as _explain  # noqa: E402
from download_hf_assets import repo_id_arg as _repo_id  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Download a Llama tokenizer.model from the Hugging Face Hub."
    )
    parser.add_argument(
        "--repo_id",
        type=_repo_id,
        required=True,
        help="Hub repository, owner/name (e.g. meta-llama/Meta-Llama-3.1-8B)",
    )
    parser.add_argument(
        "--hf_token",
        default=None,
        help="Hub access token (default: the HF_TOKEN environment variable)",
    )
    parser.add_argument(
        "--tokenizer_path",
        default="original",
        help="folder of tokenizer.model inside the repository; '' for the top level "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--local_dir",
        default="assets/tokenizer/",
        help="where to save it; the repository's folders are kept (default: %(default)s)",
    )
    return parser


def repo_filename(tokenizer_path: str) -> str:
    """Path of the tokenizer file inside the repository."""
    folder = tokenizer_path.strip().strip("/")
    return f"{folder}/tokenizer.model" if folder else "tokenizer.model"


def download(repo_id: str, filename: str, local_dir: str, token: str | None) -> str:
    """Fetch ``filename`` from ``repo_id`` into ``local_dir``; return the local path."""
    return hf_hub_download(repo_id=repo_id, filename=filename, local_dir=local_dir, token=token)


def explain(error: BaseException, repo_id: str, filename: str, has_token: bool) -> str:
    """A one-line message for a failed download (see ``download_hf_assets.explain``)."""
    return _explain(
        error,
        repo_id,
        filename,
        has_token,
        entry_not_found=(
            f"file {filename} was not found in repository {repo_id}; check --tokenizer_path "
            "(Llama 3 keeps tokenizer.model under 'original', Llama 2 at the top level: '')"
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    filename = repo_filename(args.tokenizer_path)
    try:
        path = download(args.repo_id, filename, args.local_dir, token)
    except KeyboardInterrupt:
        print("download_tokenizer.py: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        message = explain(error, args.repo_id, filename, has_token=token is not None)
        print(f"download_tokenizer.py: error: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
