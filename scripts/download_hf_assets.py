#!/usr/bin/env python
"""Download a model folder from the Hugging Face Hub: tokenizer, config, weights, or all of them.

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B \\
        [--assets tokenizer [config] [weights] | --all] [--local_dir assets/hf/Llama-3.1-8B] \\
        [--hf_token TOKEN] [--revision main]

Fetches the files of the chosen groups (``snapshot_download`` with allow-patterns, see
``ASSET_PATTERNS``) into ``local_dir``, keeping the repository's folders, and prints the folder,
which is what ``model.hf_assets_path`` (and ``scripts/generate.py --checkpoint``) should point at.
The default is ``--assets tokenizer``: a few MB. ``--all`` adds config.json and the safetensors
weights (16 GB for an 8B model in bfloat16). Llama repositories are gated: accept the licence on
the repository's Hub page, then pass a token with ``--hf_token`` or the ``HF_TOKEN`` environment
variable. The token is never printed, and errors are built from exception types and HTTP status
codes only, never from exception text.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable, Sequence

from huggingface_hub import snapshot_download

SCRIPT = "download_hf_assets.py"

# What each --assets group fetches (patterns as the Hub's allow_patterns match them: fnmatch on
# the path inside the repository).
ASSET_PATTERNS: dict[str, tuple[str, ...]] = {
    "tokenizer": (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "original/tokenizer.model",  # Llama 3: the tiktoken BPE file
        "tokenizer.model",  # Llama 2: the SentencePiece model
    ),
    "config": ("config.json", "generation_config.json"),
    "weights": (
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "model.safetensors.index.json",
    ),
}
ALL_ASSETS = tuple(ASSET_PATTERNS)

# owner/name, each part made of letters, digits, '-', '_' and '.', without '--' or '..' (the
# Hub's rule, roughly).
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def repo_id_arg(value: str) -> str:
    """argparse type of ``--repo_id``: a Hub repository id, owner/name."""
    value = value.strip()
    if not value:
        raise argparse.ArgumentTypeError("must not be empty; give it as owner/name")
    if not _REPO_ID_RE.fullmatch(value) or ".." in value or "--" in value:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a Hub repository id of the form owner/name "
            "(e.g. meta-llama/Meta-Llama-3.1-8B)"
        )
    return value


def allow_patterns(assets: Iterable[str]) -> list[str]:
    """The allow-patterns of the asset groups ``assets``, each once, in a fixed order."""
    patterns: list[str] = []
    for asset in assets:
        if asset not in ASSET_PATTERNS:
            raise ValueError(f"unknown asset group {asset!r}; valid: {', '.join(ALL_ASSETS)}")
        patterns.extend(p for p in ASSET_PATTERNS[asset] if p not in patterns)
    return patterns


def default_local_dir(repo_id: str) -> str:
    """``assets/hf/<name>``: where the folder goes unless ``--local_dir`` says otherwise."""
    return os.path.join("assets", "hf", repo_id.split("/")[-1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Download a model's tokenizer, config and/or weights from the Hugging Face Hub."
    )
    parser.add_argument(
        "--repo_id",
        type=repo_id_arg,
        required=True,
        help="Hub repository, owner/name (e.g. meta-llama/Llama-3.1-8B)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--assets",
        nargs="+",
        choices=ALL_ASSETS,
        default=None,
        help="groups of files to fetch (default: tokenizer)",
    )
    which.add_argument(
        "--all", action="store_true", help="fetch every group: tokenizer, config and weights"
    )
    parser.add_argument(
        "--hf_token",
        default=None,
        help="Hub access token (default: the HF_TOKEN environment variable)",
    )
    parser.add_argument(
        "--local_dir",
        default=None,
        help="where to save the folder (default: assets/hf/<repository name>)",
    )
    parser.add_argument(
        "--revision", default=None, help="branch, tag or commit (default: the main branch)"
    )
    return parser


def selected_assets(args: argparse.Namespace) -> list[str]:
    """The asset groups the parsed arguments ask for."""
    if args.all:
        return list(ALL_ASSETS)
    return list(dict.fromkeys(args.assets or ["tokenizer"]))


def download(
    repo_id: str, patterns: list[str], local_dir: str, token: str | None, revision: str | None
) -> str:
    """Fetch the files of ``repo_id`` matching ``patterns`` into ``local_dir``; return the folder."""
    return snapshot_download(
        repo_id=repo_id,
        allow_patterns=patterns,
        local_dir=local_dir,
        token=token,
        revision=revision,
    )


def missing_assets(folder: str, assets: Iterable[str]) -> list[str]:
    """One line for each asset group of which ``folder`` holds no usable file."""
    problems = []

    def have(*names: str) -> bool:
        return any(os.path.isfile(os.path.join(folder, n)) for n in names)

    if "tokenizer" in assets and not have(
        "tokenizer.json", "tokenizer.model", "original/tokenizer.model"
    ):
        problems.append(
            "no tokenizer (tokenizer.json, tokenizer.model or original/tokenizer.model)"
        )
    if ("config" in assets or "weights" in assets) and not have("config.json"):
        problems.append("no config.json")
    if "weights" in assets and not have("model.safetensors", "model.safetensors.index.json"):
        problems.append(
            "no safetensors weights (model.safetensors or model.safetensors.index.json)"
        )
    return problems


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


def explain(
    error: BaseException,
    repo_id: str,
    what: str,
    has_token: bool,
    *,
    entry_not_found: str | None = None,
) -> str:
    """A one-line message for a failed download of ``what`` (a file name, or a description of
    the files) from ``repo_id``. Built only from our own values and the exception types / HTTP
    status codes, never from exception text (which could hold secrets). ``entry_not_found``: the
    message for a file the repository does not have."""
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
        return f"the Hub does not accept {repo_id!r} / {what!r} as a repository id / file name"
    if has(hf_errors.RevisionNotFoundError):
        return f"repository {repo_id} has no such revision"
    if has(hf_errors.RemoteEntryNotFoundError) or (statuses and statuses[0] == 404):
        return entry_not_found or f"{what} was not found in repository {repo_id}"
    if statuses and statuses[0] >= 500:
        return (
            f"could not download {what} from {repo_id}: the Hub answered HTTP {statuses[0]} "
            "(a server-side problem); try again later"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip()
    if offline and offline.lower() not in ("0", "false", "no", "off"):
        return (
            f"could not download {what} from {repo_id}: HF_HUB_OFFLINE={offline} is set, so "
            "the Hub was not contacted and the local directory and cache do not hold it; "
            "unset HF_HUB_OFFLINE to download"
        )
    if has(hf_errors.LocalEntryNotFoundError, ConnectionError, TimeoutError):
        return (
            f"could not download {what} from {repo_id}: the Hugging Face Hub could not be "
            "reached (check the network connection, proxy settings and HF_ENDPOINT)"
        )
    if statuses:
        return f"could not download {what} from {repo_id}: the Hub answered HTTP {statuses[0]}"
    if isinstance(error, OSError) and not isinstance(error, hf_errors.HfHubHTTPError):
        reason = error.strerror or type(error).__name__
        where = f" ({error.filename})" if error.filename else ""
        return f"could not save {what}: {reason}{where}"
    return f"could not download {what} from {repo_id}: {type(error).__name__}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    assets = selected_assets(args)
    local_dir = args.local_dir or default_local_dir(args.repo_id)
    what = "the " + " + ".join(assets) + " files"
    try:
        folder = download(args.repo_id, allow_patterns(assets), local_dir, token, args.revision)
    except KeyboardInterrupt:
        print(f"{SCRIPT}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        message = explain(error, args.repo_id, what, has_token=token is not None)
        print(f"{SCRIPT}: error: {message}", file=sys.stderr)
        return 1
    problems = missing_assets(folder, assets)
    if problems:
        print(
            f"{SCRIPT}: error: repository {args.repo_id} has {'; '.join(problems)} "
            f"(looked for: {', '.join(allow_patterns(assets))})",
            file=sys.stderr,
        )
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
