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
import re
import sys
from collections.abc import Sequence

from huggingface_hub import hf_hub_download

# owner/name, each part made of letters, digits, '-', '_' and '.', without '--' or '..' (the
# Hub's rule, roughly).
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _repo_id(value: str) -> str:
    value = value.strip()
    if not value:
        raise argparse.ArgumentTypeError("must not be empty; give it as owner/name")
    if not _REPO_ID_RE.fullmatch(value) or ".." in value or "--" in value:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a Hub repository id of the form owner/name "
            "(e.g. meta-llama/Meta-Llama-3.1-8B)"
        )
    return value


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


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def explain(error: BaseException, repo_id: str, filename: str, has_token: bool) -> str:
    """A one-line message for a failed download. Built only from our own values and the
    exception types / HTTP status codes, never from exception text (which could hold secrets)."""
    from huggingface_hub import errors as hf_errors

    page = f"https://huggingface.co/{repo_id}"
    token_hint = (
        "check that the token (--hf_token or HF_TOKEN) is valid and may read gated repositories"
        if has_token
        else "pass a token with --hf_token or the HF_TOKEN environment variable"
    )
    chain = _causes(error)
    statuses = [s for s in map(_status, chain) if s is not None]

    def has(*kinds: type[BaseException]) -> bool:
        return any(isinstance(e, kinds) for e in chain)

    if has(hf_errors.GatedRepoError) or (statuses and statuses[0] == 403):
        return (
            f"{repo_id} is a gated repository and this request was not authorized: accept its "
            f"licence on {page} (logged in), then {token_hint}"
        )
    if has(hf_errors.RepositoryNotFoundError) or (statuses and statuses[0] == 401):
        return (
            f"repository {repo_id} was not found on the Hub, or it is private or gated and the "
            f"request was not authorized: check the name; if it is gated, accept its licence on "
            f"{page} and {token_hint}"
        )
    if has(hf_errors.HFValidationError):
        return f"the Hub does not accept {repo_id!r} / {filename!r} as a repository id / file name"
    if has(hf_errors.RevisionNotFoundError):
        return f"repository {repo_id} has no such revision"
    if has(hf_errors.RemoteEntryNotFoundError) or (statuses and statuses[0] == 404):
        return (
            f"file {filename} was not found in repository {repo_id}; check --tokenizer_path "
            "(Llama 3 keeps tokenizer.model under 'original', Llama 2 at the top level: '')"
        )
    if statuses and statuses[0] >= 500:
        return (
            f"could not download {filename} from {repo_id}: the Hub answered HTTP {statuses[0]} "
            "(a server-side problem); try again later"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip()
    if offline and offline.lower() not in ("0", "false", "no", "off"):
        return (
            f"could not download {filename} from {repo_id}: HF_HUB_OFFLINE={offline} is set, so "
            "the Hub was not contacted and the file is not in the local directory or cache; "
            "unset HF_HUB_OFFLINE to download"
        )
    if has(hf_errors.LocalEntryNotFoundError, ConnectionError, TimeoutError):
        return (
            f"could not download {filename} from {repo_id}: the Hugging Face Hub could not be "
            "reached (check the network connection, proxy settings and HF_ENDPOINT)"
        )
    if statuses:
        return f"could not download {filename} from {repo_id}: the Hub answered HTTP {statuses[0]}"
    if isinstance(error, OSError) and not isinstance(error, hf_errors.HfHubHTTPError):
        reason = error.strerror or type(error).__name__
        where = f" ({error.filename})" if error.filename else ""
        return f"could not save {filename}: {reason}{where}"
    return f"could not download {filename} from {repo_id}: {type(error).__name__}"


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
