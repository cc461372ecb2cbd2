"""Context parallel: the all-gather attention against plain SDPA in 1, 2 and 4 processes
(tests/helpers/cp_worker.py under torchrun; on a GPU also with the CUDA kernels), and linear
attention's chunks continued across ranks (tests/helpers/cp_linear_worker.py). The sequence
layout and the configuration checks are in tests/unit/distributed/test_context_parallel.py, whole training
runs under CP in tests/e2e/test_parallel_equivalence.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from repo_paths import HELPERS, ROOT


def _run_worker(
    nproc: int, *args: str, timeout: int = 300, helper: str = "cp_worker.py"
) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HELPERS / helper),
        *args,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            name, *errs = line.split()[1:]
            results[name] = [float(e) for e in errs]
    return results


def _assert_close(results: dict[str, list[float]], n_cases: int) -> None:
    assert len(results) == n_cases, results
    for name, (cp_out, cp_grad, sdpa_out, sdpa_grad) in results.items():
        if sdpa_out == 0.0:  # float32: plain SDPA is the reference itself
            assert cp_out < 1e-5 and cp_grad < 1e-5, (name, cp_out, cp_grad)
        else:  # 16-bit: no worse than plain SDPA in that dtype, give or take rounding
            assert cp_out <= 2 * sdpa_out + 1e-3, (name, cp_out, sdpa_out)
            assert cp_grad <= 2 * sdpa_grad + 1e-3, (name, cp_grad, sdpa_grad)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_all_gather_attention_matches_sdpa(nproc):
    """Outputs and q/k/v gradients of the whole sequence, gathered from every rank's part
    (the ``mla`` case: values narrower than queries and keys, a softmax scale of its own; the
    ``sinks`` cases: gpt-oss's sinks and sliding windows, and the sinks' gradient)."""
    _assert_close(_run_worker(nproc), n_cases=16)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (flash / efficient kernels)"
)
def test_all_gather_attention_matches_sdpa_on_cuda():
    _assert_close(_run_worker(1, "--cuda"), n_cases=10)


@pytest.mark.parametrize("nproc", [2, 4])
def test_linear_attention_chunks_continue_across_ranks(nproc):
    """Gated DeltaNet under context parallel (tests/helpers/cp_linear_worker.py): the
    convolution continued from the previous chunk's tail and the delta rule from the state the
    whole sequence has at each chunk's start, with documents starting inside chunks and on a
    chunk's first position: outputs and input gradients equal the whole sequence's in one
    process (float32). With each chunk's carried state scaled by 0.99, the errors were 2e-4 to
    6e-4; with the tails dropped, 4.3."""
    results = _run_worker(nproc, helper="cp_linear_worker.py")
    assert len(results) == 6, results
    for name, (out_err, grad_err) in results.items():
        assert out_err < 1e-5 and grad_err < 1e-5, (name, out_err, grad_err)
