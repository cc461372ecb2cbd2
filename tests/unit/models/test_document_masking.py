"""Block-causal attention: packed documents stop attending to each other.

The proof that masking is right is that a packed row gives, for each document, the logits and
the gradients of that document run alone; the CPU training path (SDPA with a boolean mask) and
the CUDA path's FlexAttention (whose forward runs on CPU) agree; and the training loss is the
mean over the valid tokens of the whole step however they fall across micro-batches.
Context parallel with documents: tests/e2e/test_context_parallel.py; layouts:
tests/e2e/test_parallel_equivalence.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.config.schema import JobConfig
from torchtitan.data.batch import IGNORE_INDEX, Batch
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.attention import (
    CausalAttention,
    document_block_mask,
    document_mask,
    flex_document_attention,
)
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.train.loss import build_loss_fn
from torchtitan.train.step import StepRunner

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="needs a CUDA GPU: FlexAttention's compiled kernels (it has no CPU backward)",
        ),
    ],
)


def _model(family: str, mask_type: str = "block_causal", device: str = "cpu") -> torch.nn.Module:
    if family == "llama3":
        args = dataclasses.replace(
            llama3_configs["debugmodel"], vocab_size=VOCAB, n_layers=2, attn_mask_type=mask_type
        )
        cls = Transformer
    else:
        args = dataclasses.replace(
            qwen3_configs["debugmodel"], vocab_size=VOCAB, n_layers=2, attn_mask_type=mask_type
        )
        cls = Qwen3Model
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(args)
    model.init_weights()
    return model


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize(
    "lengths", [[40], [13, 27], [5, 11, 17, 7]], ids=["1doc", "2docs", "4docs"]
)
def test_packed_documents_compute_what_each_document_computes_alone(family, lengths, device):
    """Logits and parameter gradients of a packed row equal each document's own, within 1e-5:
    the packed loss (each document's tokens predicted within it only) is the sum of the
    documents' losses, and so is its gradient. On CPU the packed row runs SDPA with the boolean
    mask; on CUDA, FlexAttention forward and backward (a document alone runs causal SDPA)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = _model(family, device=device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, sum(lengths) + 1), generator=g).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    doc_ids = _doc_ids(lengths)[None].to(device)
    starts = torch.cumsum(torch.tensor(lengths), 0)[:-1].to(device)
    labels[0, starts - 1] = IGNORE_INDEX  # a document's first token is not predicted from before

    packed = model(inputs, doc_ids=doc_ids)
    F.cross_entropy(packed[0], labels[0], reduction="sum").backward()
    packed_grads = _grads(model)

    alone_grads: dict[str, torch.Tensor] = {}
    begin = 0
    for n in lengths:
        alone = model(inputs[:, begin : begin + n])
        torch.testing.assert_close(packed[:, begin : begin + n], alone, atol=1e-5, rtol=0)
        doc_labels = labels[0, begin : begin + n]
        F.cross_entropy(alone[0], doc_labels, reduction="sum").backward()
        for name, grad in _grads(model).items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
        begin += n
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_block_causal_changes_what_causal_computes():
    """Across a document boundary the two mask types differ (the setting is not a no-op), and
    with one document per row they agree."""
    causal, block = _model("llama3", "causal"), _model("llama3")
    inputs = torch.randint(0, VOCAB, (1, 24))
    two_docs, one_doc = _doc_ids([10, 14])[None], _doc_ids([24])[None]
    assert (causal(inputs, doc_ids=two_docs) - block(inputs, doc_ids=two_docs)).abs().max() > 1e-3
    torch.testing.assert_close(causal(inputs), block(inputs, doc_ids=one_doc), atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flex_attention_forward_equals_the_cpu_training_path(kv_heads):
    """FlexAttention (the CUDA kernel's mask logic, run unfused on CPU) with the block mask
    gives the outputs of SDPA with the boolean mask, for rows of 1, 3 and 4 documents."""
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 3, 4, 128, 16
    q = torch.randn(b, h, t, d, generator=g)
    k, v = (torch.randn(b, kv_heads, t, d, generator=g) for _ in range(2))
    doc_ids = torch.stack([_doc_ids([128]), _doc_ids([30, 70, 28]), _doc_ids([1, 63, 33, 31])])
    sdpa = CausalAttention()(q, k, v, document_mask(doc_ids))
    flex = flex_document_attention(
        q, k, v, document_block_mask(doc_ids, compile_mask=False), compiled=False
    )
    torch.testing.assert_close(flex, sdpa, atol=2e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled FlexAttention)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_on_cuda_matches_the_sdpa_mask_path(dtype):
    """The CUDA training kernel (compiled FlexAttention, block mask built by a compiled kernel)
    against SDPA with the boolean mask: outputs and q/k/v gradients, grouped-query heads, rows
    of 1, 3 and 4 documents; bf16 within twice the error of SDPA in bf16 against float32."""
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, t, d = 3, 8, 2, 256, 64
    q, k, v, dout = (torch.randn(b, n, t, d, generator=g).cuda() for n in (h, h_kv, h_kv, h))
    doc_ids = torch.stack([_doc_ids([256]), _doc_ids([30, 170, 56]), _doc_ids([1, 127, 65, 63])])
    doc_ids = doc_ids.cuda()

    def run(fn, dt):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.to(dt))
        return [out.float()] + [x.grad.float() for x in leaves]

    def sdpa(q_, k_, v_):
        return CausalAttention()(q_, k_, v_, document_mask(doc_ids))

    kernel = CausalAttention()
    block_mask = kernel.mask_for(doc_ids)  # on CUDA: a BlockMask
    assert not isinstance(block_mask, torch.Tensor)
    flex = run(lambda *x: kernel(*x, block_mask), dtype)
    exact = run(sdpa, torch.float32)
    plain = run(sdpa, dtype)
    for got, want, ref in zip(flex, exact, plain):
        bar = 1e-4 if dtype == torch.float32 else 2 * (ref - want).abs().max().item() + 1e-3
        assert (got - want).abs().max().item() <= bar


def test_document_mask_is_causal_within_documents():
    mask = document_mask(_doc_ids([2, 3])[None])[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    )
    assert mask.tolist() == expected.bool().tolist()


def _runner(model: torch.nn.Module) -> StepRunner:
    job = JobConfig()
    job.model.attn_mask_type = "block_causal"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    loss_fn = build_loss_fn(dims, job, [model])
    return StepRunner(
        job, dims, model=model, pipeline=None, loss_fn=loss_fn, device=torch.device("cpu")
    )


def test_the_step_loss_is_the_mean_over_its_valid_tokens():
    """Micro-batches with very different numbers of ignored labels give the loss and gradients
    of one forward over the whole batch (a mean of per-micro-batch means would not)."""
    model = _model("llama3")
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(0, VOCAB, (4, 16), generator=g)
    labels = torch.randint(0, VOCAB, (4, 16), generator=g)
    labels[:2, 1:] = IGNORE_INDEX  # micro-batch 1: 2 valid labels; micro-batch 2: 32
    doc_ids = torch.zeros(4, 16, dtype=torch.int32)
    doc_ids[:, 9:] = 1

    whole = F.cross_entropy(
        model(inputs, doc_ids=doc_ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )
    whole.backward()
    whole = whole.item()
    expected = _grads(model)

    runner = _runner(model)
    batches = [Batch(inputs[i : i + 2], labels[i : i + 2], doc_ids[i : i + 2]) for i in (0, 2)]
    tokens = runner.step_tokens(batches)
    assert tokens.count == 34
    loss = sum(runner.forward_backward(b, tokens.divisor) for b in batches)
    assert float(loss) == pytest.approx(whole, abs=1e-6)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-7, rtol=1e-5, msg=name)
    # validation: the summed loss and the count, whose ratio is the same mean
    totals = [runner.forward_loss(b) for b in batches]
    mean = sum(s for s, _ in totals) / sum(c for _, c in totals)
    assert float(mean) == pytest.approx(whole, abs=1e-6)
