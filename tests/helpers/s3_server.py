"""A real S3-compatible server for the object-storage tests: moto's standalone server
(``python -m moto.server``), a separate process on a free localhost port, started by the test
and stopped by its process id. It keeps its buckets in memory for as long as it runs, so a
trainer can be killed and restarted against the same store. Clients reach it the way a user's
would: through the environment botocore reads (``AWS_ENDPOINT_URL`` and the key pair)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any

from ports import free_port


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing-key",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_ready()

    def client(self) -> Any:
        """boto3's own S3 client for this server (the tool that owns the format checks ours)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().list_buckets()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix``, as boto3 lists them."""
        out: list[str] = []
        for page in (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def freeze(self) -> None:
        """Stop answering (SIGSTOP): requests hang, as with a stalled store."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextmanager
def s3_server():
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()
