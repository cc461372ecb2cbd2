"""Object storage: paths that are fsspec URLs (``s3://bucket/prefix``, ``gs://``, ``file://``, any
protocol whose fsspec package is installed), and the one line each way of failing to reach them
says.

Credentials and the endpoint come from where the storage's own client reads them; for S3 that is
botocore's chain: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or ``AWS_PROFILE`` and the
shared files), ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for an S3-compatible server,
``AWS_DEFAULT_REGION``; fsspec adds ``FSSPEC_S3_<ARG>`` for any other s3fs argument. None of them
is a config key, and nothing here logs them: only URLs are named in messages.
"""

from __future__ import annotations

import os
from typing import Any

from torchtitan.errors import ConfigError

# what each protocol's fsspec package is called (pip install ...)
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}
_S3_ENV = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
    "S3-compatible server"
)


class StorageError(ConfigError):
    """Object storage that cannot be reached or used: no credentials, no such bucket, an endpoint
    that does not answer, access denied. Not a damaged checkpoint: nothing falls back past it."""


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def join(folder: str, *names: str) -> str:
    """``folder/name``: URLs join with ``/`` whatever the OS, local paths as the OS does."""
    if is_url(folder):
        return "/".join([folder.rstrip("/"), *names])
    return os.path.join(folder, *names)


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def filesystem(url: str, key: str) -> Any:
    """The fsspec filesystem serving ``url``; ConfigError naming ``key`` when its protocol is
    unknown or its package is not installed."""
    try:
        from fsspec.core import url_to_fs

        fs, _ = url_to_fs(url)
    except ImportError:
        package = _PACKAGES.get(protocol(url), "the fsspec package for it")
        raise ConfigError(
            f"{key}: '{url}' needs {package} for the '{protocol(url)}://' protocol "
            f"(pip install {package})"
        ) from None
    except ValueError as e:
        raise ConfigError(
            f"{key}: '{url}' is not a URL fsspec can open ({e}); give a local folder or an "
            "s3://bucket/prefix URL (or another installed fsspec protocol)"
        ) from None
    return fs


def access_problem(e: BaseException) -> str | None:
    """What keeps the storage out of reach, in a few words, when ``e`` says so (missing
    credentials, an endpoint that does not answer, denied access, a missing bucket); None for
    anything else (a missing or damaged object is the caller's to judge)."""
    names = {type(c).__name__ for c in _chain(e)}
    text = " ".join(str(c) for c in _chain(e))
    if names & {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"} or (
        "Unable to locate credentials" in text
    ):
        return f"no credentials were found; set {_S3_ENV}"
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"} or (
        "Could not connect to the endpoint URL" in text
    ):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        where = f" {endpoint} (AWS_ENDPOINT_URL)" if endpoint else ""
        return (
            f"the storage endpoint{where} does not answer; check AWS_ENDPOINT_URL and the network"
        )
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return f"the credentials were refused; check {_S3_ENV}"
    if names & {"PermissionError"} or any(
        word in text for word in ("AccessDenied", "Access Denied", "Forbidden")
    ):
        return "access was denied; give these credentials read and write access to it"
    if _missing_bucket(e):
        return "its bucket does not exist; create it first"
    return None


def _missing_bucket(e: BaseException) -> bool:
    text = " ".join(str(c) for c in _chain(e))
    return "NoSuchBucket" in text or "bucket does not exist" in text


def _chain(e: BaseException) -> list[BaseException]:
    """``e``, its causes, and the errors of the ranks a DCP ``CheckpointException`` gathered."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo = [e]
    while todo:
        cause = todo.pop(0)
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        out.append(cause)
        todo.append(cause.__cause__ or cause.__context__)
        failures = getattr(cause, "failures", None)  # CheckpointException: rank -> (error, tb)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [c for c in out if isinstance(c, BaseException)]


def check_reachable(url: str, key: str) -> None:
    """Start-up: the storage behind ``url`` answers with these credentials, and its bucket
    exists (s3fs would create a missing one on the first write, an account-wide side effect no
    run should have); StorageError naming ``key`` otherwise. The folder itself may be missing."""
    fs = filesystem(url, key)
    path = fs._strip_protocol(url)
    try:
        fs.invalidate_cache()
        fs.ls(path)  # raises what keeps it out of reach (exists() would only say False)
    except FileNotFoundError as e:
        if _missing_bucket(e):
            bucket = path.split("/", 1)[0]
            raise StorageError(
                f"{key}: '{url}': the bucket '{bucket}' does not exist (or these credentials "
                "cannot see it); create it first"
            ) from None
    except Exception as e:
        problem = access_problem(e)
        if problem is None:
            raise StorageError(f"{key}: '{url}' cannot be read ({type(e).__name__}: {e})") from None
        raise StorageError(f"{key}: '{url}' cannot be reached: {problem}") from None
