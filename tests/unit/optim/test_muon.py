"""Muon: the same update as torch.optim.Muon for plain matrices, each matrix of an expert stack on
its own, the hidden matrices in Muon and the rest in AdamW, and its state in the checkpoint's
flat state dict. Fast, one process (sharded parameters: tests/e2e/test_parallel_equivalence.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.errors import ConfigError
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.optim.muon import DistributedMuon
from torchtitan.optim.optimizers import build_optimizer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture
def torchs_muon_on_our_cpu_iteration(monkeypatch):
    """``torch.optim.Muon`` with the Newton-Schulz iteration ours runs on CPU, so the rest of the
    update (momentum, Nesterov, weight decay, the learning rate by shape) compares bit for bit;
    the iteration itself is compared with torch's below."""
    import torch.optim._muon

    from torchtitan.optim.muon import newton_schulz_bf16_in_fp32_gemms

    monkeypatch.setattr(
        torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_bf16_in_fp32_gemms
    )


def _steps(opt_cls, params, grads, **kwargs):
    opt = opt_cls(params, **kwargs)
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
@pytest.mark.usefixtures("torchs_muon_on_our_cpu_iteration")
def test_matrices_get_torch_muons_update(adjust):
    torch.manual_seed(0)
    shapes = [(16, 8), (8, 24)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust}
    ours = _steps(DistributedMuon, [nn.Parameter(t.clone()) for t in start], grads, **kwargs)
    torchs = _steps(torch.optim.Muon, [nn.Parameter(t.clone()) for t in start], grads, **kwargs)
    for a, b in zip(ours, torchs):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("torchs_muon_on_our_cpu_iteration")
def test_an_expert_stack_is_orthogonalized_matrix_by_matrix():
    torch.manual_seed(0)
    stack = torch.randn(3, 12, 6)
    grads = [[torch.randn(3, 12, 6)] for _ in range(2)]
    ours = _steps(DistributedMuon, [nn.Parameter(stack.clone())], grads, lr=0.02, weight_decay=0.0)
    for e in range(3):
        alone = _steps(
            torch.optim.Muon,
            [nn.Parameter(stack[e].clone())],
            [[g[0][e]] for g in grads],
            lr=0.02,
            weight_decay=0.0,
        )
        assert torch.equal(ours[0][e], alone[0])


def _tiny() -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=64, n_layers=2, dim=32, n_heads=2, n_kv_heads=2
    )
    model = Transformer(args)
    model.init_weights()
    return model


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    model = _tiny()
    opt = build_optimizer([model], OptimizerConfig(name="Muon", lr=1e-3, muon_lr=0.02))
    adam, muon = opt.optimizers
    assert isinstance(adam, torch.optim.AdamW) and isinstance(muon, DistributedMuon)
    labels = [g.label for g in opt.plans[0]]
    assert labels == ["AdamW, weight decay 0.1", "Muon, weight decay 0.1", "AdamW, weight decay 0"]
    names = {g.optimizer: set() for g in opt.plans[0]}
    for g in opt.plans[0]:
        names[g.optimizer] |= set(g.names)
    assert names["Muon"] == {
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "attention.wqkv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= names["AdamW"]
    assert [g["lr"] for g in muon.param_groups] == [0.02]
    assert [g["lr"] for g in adam.param_groups] == [1e-3, 1e-3]


def test_muons_state_is_in_the_flat_state_dict_and_loads_back():
    model = _tiny()
    cfg = OptimizerConfig(name="Muon")
    opt = build_optimizer([model], cfg)
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert "state.layers.0.attention.wo.weight.momentum_buffer" in state
    assert "state.norm.weight.exp_avg" in state
    model.zero_grad(set_to_none=True)
    again = build_optimizer([model], cfg)
    again.load_state_dict(state)
    for key, value in again.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key


def test_a_part_without_matrices_is_one_line():
    part = nn.Sequential(nn.Embedding(10, 4))
    with pytest.raises(ConfigError) as e:
        build_optimizer([part], OptimizerConfig(name="Muon"))
    assert str(e.value) == (
        "optimizer.name: Muon, but model part 0 has no hidden matrices for it (only 0.weight); "
        "use AdamW, or split the pipeline so that every stage holds a transformer block"
    )


def _exact_newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = (3.4445, -4.775, 2.0315)
    x = grad.double().T if grad.size(0) > grad.size(1) else grad.double()
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.mark.parametrize("shape", [(16, 8), (64, 64), (256, 128), (40, 300)])
def test_the_cpu_iteration_is_torchs_bfloat16_iteration_up_to_summation_order(shape):
    """The CPU path (float32 GEMMs on bfloat16 values, rounded after each) against torch's own
    bfloat16 iteration: equal on small matrices; on larger ones apart only by the rounding of
    another summation order, far less than either is from the exact iteration."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from torchtitan.optim.muon import newton_schulz_bf16_in_fp32_gemms

    torch.manual_seed(0)
    grad = torch.randn(shape)
    args = ((3.4445, -4.775, 2.0315), 5, 1e-7)
    ours, torchs = (
        newton_schulz_bf16_in_fp32_gemms(grad, *args),
        _zeropower_via_newtonschulz(grad, *args),
    )
    assert ours.dtype == torchs.dtype == torch.bfloat16 and ours.shape == torchs.shape == shape
    if shape == (16, 8):
        assert torch.equal(ours, torchs)
    exact = _exact_newton_schulz(grad)
    apart = float((ours.double() - torchs.double()).norm() / exact.norm())
    ours_off = float((ours.double() - exact).norm() / exact.norm())
    torchs_off = float((torchs.double() - exact).norm() / exact.norm())
    assert apart < 1e-2, apart
    assert ours_off == pytest.approx(torchs_off, rel=0.1), (ours_off, torchs_off)
