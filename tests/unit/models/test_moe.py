"""The mixture-of-experts layer (``torchtitan/models/common/moe.py``) against references written
out token by token: routing, the grouped-mm kernel against the per-expert loop (values and
gradients), shared experts, the expert bias, the token counts and the auxiliary loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.moe import MoE, MoEArgs, inactive_params

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

DIM = 16


def _moe(**kw) -> MoE:
    args = MoEArgs(**{"num_experts": 6, "top_k": 2, "hidden_dim": 12, **kw})
    torch.manual_seed(0)
    with torch.device("meta"):
        moe = MoE(DIM, args)
    moe.to_empty(device="cpu")
    moe.init_weights(0.02)
    with torch.no_grad():  # larger weights so that routing and outputs are far from ties
        for p in moe.parameters():
            p.mul_(20)
    return moe


def _x(bsz: int = 3, seq: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randn(bsz, seq, DIM, generator=torch.Generator().manual_seed(seed))


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token by itself: its scores, its top-k experts, their weighted outputs."""
    a, e = moe.args, moe.experts
    out = []
    for tok in x.reshape(-1, DIM):
        logits = moe.router.gate.weight @ tok
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        chosen = (scores + moe.expert_bias).topk(a.top_k).indices
        weights = scores[chosen]
        if a.route_norm:
            weights = weights / weights.sum()
        y = torch.zeros(DIM)
        for w, i in zip(weights * a.route_scale, chosen.tolist()):
            inp = tok * w if a.score_before_experts else tok
            h = (F.silu(e.w1[i] @ inp) * (e.w3[i] @ inp)) @ e.w2[i].T
            y = y + (h if a.score_before_experts else h * w)
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(tok)
        out.append(y)
    return torch.stack(out).view_as(x)


CASES = {
    "softmax_norm": {"route_norm": True},
    "softmax": {},
    "sigmoid_top1_before": {"score_func": "sigmoid", "top_k": 1, "score_before_experts": True},
    "sigmoid_shared_scaled": {"score_func": "sigmoid", "shared_hidden_dim": 20, "route_scale": 2.5},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_layer_equals_the_token_by_token_reference(case, grouped_mm):
    moe = _moe(grouped_mm=grouped_mm, **CASES[case])
    x = _x()
    with torch.no_grad():
        got, want = moe(x), _reference(moe, x)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_grouped_mm_equals_the_loop_in_values_and_gradients():
    """Same weights, one expert left without tokens (the bias keeps it out)."""
    results = []
    for grouped in (True, False):
        moe = _moe(grouped_mm=grouped, shared_hidden_dim=8, load_balance_coeff=1e-3)
        moe.expert_bias[3] = -10.0  # expert 3 is never chosen
        x = _x().requires_grad_()
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        assert moe.tokens_per_expert[3] == 0
        results.append((out, x.grad, *(p.grad for p in moe.parameters())))
    for got, want in zip(*results):
        assert (got - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


def test_router_weights_and_bias():
    moe = _moe(route_norm=True, load_balance_coeff=1e-3)
    flat = _x().reshape(-1, DIM)
    weights, experts, scores = moe.router(flat, None)
    assert torch.allclose(weights.sum(-1), torch.ones(len(flat)))
    assert (scores.sum(-1) - 1).abs().max() < 1e-6  # softmax
    bias = torch.zeros(6)
    bias[5] = 5.0  # expert 5 always chosen: the bias chooses ...
    w2, e2, _ = moe.router(flat, bias)
    assert (e2 == 5).any(-1).all()
    # ... the weights stay the (renormalized) scores of the chosen experts
    picked = scores.gather(-1, e2)
    assert torch.allclose(w2, picked / picked.sum(-1, keepdim=True))
    # the layer uses the bias only when load balancing is on
    off = _moe(route_norm=True)
    off.expert_bias[5] = 5.0
    off(_x())
    on = _moe(route_norm=True, load_balance_coeff=1e-3)
    on.expert_bias[5] = 5.0
    on(_x())
    assert on.tokens_per_expert[5] == 30 and off.tokens_per_expert[5] < 30


def test_token_counts_accumulate_over_forwards():
    moe = _moe()
    moe(_x(seed=1))
    moe(_x(seed=2))
    assert moe.tokens_per_expert.sum() == 2 * 30 * 2
    flat = torch.cat([_x(seed=1), _x(seed=2)]).reshape(-1, DIM)
    experts = moe.router(flat, None)[1]
    assert torch.equal(
        moe.tokens_per_expert, torch.bincount(experts.flatten(), minlength=6).float()
    )


def test_aux_loss_values():
    moe = _moe(aux_loss_coeff=0.1)
    b, t, e, k = 2, 12, 6, 2
    uniform = torch.full((b, t, e), 1 / e)
    spread = torch.arange(b * t * k).view(b, t, k) % e  # every expert chosen equally often
    assert moe.aux_loss(uniform, spread).tolist() == pytest.approx([1.0, 1.0])
    collapsed = torch.zeros(b, t, k, dtype=torch.long)
    collapsed[..., 1] = 1  # experts 0 and 1 take everything
    peaked = torch.zeros(b, t, e)
    peaked[..., :2] = 0.5
    assert moe.aux_loss(peaked, collapsed).tolist() == pytest.approx([e / k, e / k])
    # per sequence: the same value in any batch
    scores = _x(2, t, seed=3)[..., :e].softmax(-1)
    chosen = scores.topk(k).indices
    halves = [moe.aux_loss(scores[i : i + 1], chosen[i : i + 1]).item() for i in range(2)]
    assert moe.aux_loss(scores, chosen).tolist() == pytest.approx(halves)


def test_aux_loss_joins_the_gradient_with_its_scale():
    """The layer's backward adds scale x d(aux) to what the loss sends: the same gradients as
    backpropagating ``loss + scale * aux`` written out directly."""
    scale = 0.37
    moe = _moe(score_func="sigmoid", aux_loss_coeff=1.0)
    moe.aux_loss_scale = scale
    x = _x()
    moe(x).square().mean().backward()
    got = [p.grad.clone() for p in moe.parameters()]
    assert moe.aux_loss_sum[1] == 3 and moe.aux_loss_sum[0] > 0  # 3 sequences

    ref = _moe(score_func="sigmoid")  # same weights, no aux loss inside
    out = ref(x)
    weights, experts, scores = ref.router(x.reshape(-1, DIM), None)
    aux = moe.aux_loss(scores.view(3, 10, -1), experts.view(3, 10, -1))
    (out.square().mean() + scale * aux.sum()).backward()
    for g, p in zip(got, ref.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-7, rtol=1e-5)
    assert ref.router.gate.weight.grad.abs().sum() > 0


def test_init_zeroes_buffers_and_is_deterministic():
    a, b = _moe(shared_hidden_dim=8), _moe(shared_hidden_dim=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not a.expert_bias.any() and not a.tokens_per_expert.any() and not a.aux_loss_sum.any()
    assert "expert_bias" in a.state_dict() and "tokens_per_expert" not in a.state_dict()


def test_inactive_params():
    moe = _moe(shared_hidden_dim=8)
    experts = 3 * 6 * 12 * DIM
    assert inactive_params(moe) == experts * 4 // 6
    assert dataclasses.replace(moe.args, every=2).is_moe_layer(1)
    assert not dataclasses.replace(moe.args, every=2).is_moe_layer(0)
    first_two_dense = dataclasses.replace(moe.args, first_dense=2)
    assert [first_two_dense.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"score_func": "relu"}, "score_func 'relu'"),
        ({"top_k": 7}, "top_k (7)"),
        ({"every": 0}, "every (0)"),
        ({"num_groups": 4}, "num_groups (4) must divide num_experts (6)"),
        ({"num_groups": 6}, "num_groups (6) must divide num_experts (6) into groups of at least 2"),
        ({"num_groups": 2, "topk_groups": 3}, "topk_groups (3) must be in 1..num_groups (2)"),
        ({"num_groups": 2, "topk_groups": 1, "top_k": 4}, "top_k (4) exceeds the 3 experts"),
    ],
)
def test_bad_args_are_named(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        MoEArgs(num_experts=6, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bfloat16 grouped mm)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("hidden_dim", [16, 12], ids=["aligned", "unaligned"])
def test_grouped_mm_on_gpu_in_bfloat16_matches_the_loop(compiled, hidden_dim):
    """On CUDA the grouped kernel takes bfloat16 rows of a multiple of 16 bytes: the layer (eager
    and compiled) against the per-expert loop on the same bfloat16 weights, values and gradients,
    within bfloat16's rounding. A hidden size the kernel refuses (12: 24-byte rows) runs the loop
    instead of failing."""
    outs = []
    for grouped in (True, False):
        moe = _moe(grouped_mm=grouped, hidden_dim=hidden_dim, shared_hidden_dim=16)
        moe = moe.to("cuda", torch.bfloat16)
        run = torch.compile(moe, fullgraph=True) if compiled and grouped else moe
        x = _x(4, 64).to("cuda", torch.bfloat16).requires_grad_()
        out = run(x)
        out.float().square().mean().backward()
        outs.append((out.float(), x.grad.float(), moe.experts.w1.grad.float()))
    for got, want in zip(*outs):
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
