"""Opt-in (TORCHTITAN_TEST_IMAGE_BUILD=1; a few minutes, downloads Debian and PyPI packages):
build the Dockerfile without a Docker engine and check the image.

A Debian base is bootstrapped locally with mmdebstrap and given this machine's CPU torch wheel
(standing in for the CUDA PyTorch base), then ``buildah bud --isolation chroot --pull-never``
builds the unedited Dockerfile on it. In the image: the project's dependencies import, the
entrypoint is the launcher, and it resolves a launch and passes its configuration check."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from repo_paths import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TORCHTITAN_TEST_IMAGE_BUILD") != "1",
        reason="opt-in: TORCHTITAN_TEST_IMAGE_BUILD=1 (needs root, buildah, mmdebstrap, network)",
    ),
]
BASE = "localhost/torchtitan-test-base:latest"
IMAGE = "localhost/torchtitan:test"
# Where the network passes through a TLS-inspecting proxy, pip in the image needs the host's CA
# bundle: it is mounted over the image's for the RUN steps only.
CA = "/etc/ssl/certs/ca-certificates.crt"


def _buildah(*args: str, timeout: int = 900) -> str:
    env = dict(os.environ, STORAGE_DRIVER="vfs", BUILDAH_ISOLATION="chroot")
    done = subprocess.run(
        ["buildah", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr[-3000:]}"
    return done.stdout


def _torch_wheel() -> Path:
    import torch

    found = sorted(Path("/opt/wheels").glob(f"torch-{torch.__version__.split('+')[0]}*.whl"))
    if not found:
        pytest.skip("no local torch wheel in /opt/wheels to put in the base image")
    return found[0]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root and {missing or 'buildah'}: apt-get install buildah mmdebstrap")
    tmp = tmp_path_factory.mktemp("image")
    rootfs = tmp / "base.tar"
    subprocess.run(
        [
            "mmdebstrap",
            "--variant=apt",
            "--include=python3,python3-pip,ca-certificates",
            "bookworm",
            str(rootfs),
        ],
        check=True,
        capture_output=True,
        timeout=900,
    )
    wheel = _torch_wheel()
    ctr = _buildah("from", "scratch").strip()
    try:
        _buildah("add", ctr, str(rootfs), "/")
        _buildah("add", ctr, str(wheel), "/tmp/")
        _buildah(
            "run",
            "-v",
            f"{CA}:{CA}:ro",
            ctr,
            "--",
            "sh",
            "-c",
            f"python3 -m pip install -q --break-system-packages /tmp/{wheel.name} "
            f"&& rm /tmp/{wheel.name}",
        )
        _buildah("commit", "-q", ctr, BASE)
    finally:
        _buildah("rm", ctr)
    _buildah(
        "bud",
        "--isolation",
        "chroot",
        "--pull-never",
        "--build-arg",
        f"BASE_IMAGE={BASE}",
        "-v",
        f"{CA}:{CA}:ro",
        "-t",
        IMAGE,
        str(ROOT),
    )
    return IMAGE


def _run_in(image: str, *cmd: str, env: dict[str, str] | None = None) -> str:
    ctr = _buildah("from", image).strip()
    try:
        flags = [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
        return _buildah("run", *flags, ctr, "--", *cmd)
    finally:
        _buildah("rm", ctr)


def test_the_image_holds_the_project_and_its_launcher(image):
    config = _buildah("inspect", "--format", "{{.OCIv1.Config.Entrypoint}}", image)
    assert "/opt/torchtitan/run_llama_train.sh" in config
    out = _run_in(
        image,
        "python3",
        "-c",
        "import datasets, tiktoken, sentencepiece, tensorboard, "
        "safetensors, torch, torchtitan.models.spec; print(torch.__version__)",
    )
    assert out.strip().startswith("2.")
    # the entrypoint as Kubernetes runs it, with a pod's variables: resolved and checked
    env = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "NGPU": "2",
        "HF_HUB_OFFLINE": "1",
    }
    out = _run_in(
        image,
        "python3",
        "-m",
        "torchtitan.preflight",
        "--world-size",
        "4",
        "--job.config_file",
        "train_configs/debug_model.toml",
        env=env,
    )
    out = _run_in(
        image,
        "/opt/torchtitan/run_llama_train.sh",
        "--training.steps",
        "2",
        env={**env, "DRY_RUN": "1"},
    )
    assert "launch: Kubeflow (PET_* variables): nnodes=2 node_rank=1 nproc_per_node=2" in out
    assert "--rdzv-endpoint=job-master-0:23456" in out
