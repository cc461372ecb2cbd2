"""Optimizer moments kept in bfloat16: each step is torch's own Adam / AdamW (and Muon's) update on
the moments widened to float32, then rounded back; the state takes half the bytes. Fast, one
process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.optim.bf16_state import BF16StateAdam
from torchtitan.optim.muon import DistributedMuon
from torchtitan.optim.optimizers import build_optimizer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _run(make, rounded: bool, steps: int = 4) -> list[torch.Tensor]:
    """Parameters after ``steps`` steps of ``make(params)``; ``rounded``: the float32 optimizer's
    state rounded to bfloat16 after each step (what bfloat16 state must equal)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(12, 8)), nn.Parameter(torch.randn(8, 20))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    opt = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        if rounded:
            for state in opt.state.values():
                for key in STATE:
                    if key in state:
                        state[key].copy_(state[key].bfloat16().float())
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_bf16_moments_are_torchs_adam_with_its_moments_rounded(decoupled):
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    reference = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours = _run(lambda ps: BF16StateAdam(ps, decoupled=decoupled, **kwargs), rounded=False)
    expected = _run(lambda ps: reference(ps, foreach=False, **kwargs), rounded=True)
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)
    plain = _run(lambda ps: reference(ps, foreach=False, **kwargs), rounded=False)
    assert any(not torch.equal(a, b) for a, b in zip(ours, plain))  # the rounding is real


def test_bf16_muon_momentum_is_the_float32_one_rounded():
    kwargs = {"lr": 0.02, "weight_decay": 0.1}
    ours = _run(lambda ps: DistributedMuon(ps, state_dtype=torch.bfloat16, **kwargs), rounded=False)
    expected = _run(lambda ps: DistributedMuon(ps, **kwargs), rounded=True)
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_the_state_takes_half_the_bytes_and_round_trips(name):
    torch.manual_seed(0)
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=64, n_layers=1, dim=32, n_heads=2, n_kv_heads=2
    )
    model = Transformer(args)
    model.init_weights()

    def state_bytes(dtype: str):
        opt = build_optimizer([model], OptimizerConfig(name=name, state_dtype=dtype))
        model(torch.randint(0, 64, (1, 8))).sum().backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        tensors = [
            v
            for s in (o.state for o in opt.optimizers)
            for st in s.values()
            for k, v in st.items()
            if k in STATE
        ]
        return opt, sum(t.numel() * t.element_size() for t in tensors)

    _, full = state_bytes("float32")
    opt, half = state_bytes("bfloat16")
    assert half * 2 == full
    state = opt.state_dict()
    again = build_optimizer([model], OptimizerConfig(name=name, state_dtype="bfloat16"))
    again.load_state_dict(state)
    for key, value in again.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == state[key].dtype and torch.equal(value, state[key]), key
