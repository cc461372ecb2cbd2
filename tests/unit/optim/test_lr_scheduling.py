"""LR schedule values: warm-up, stable phase, and each decay curve down to min_lr_factor."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan.config.schema import LRScheduler
from torchtitan.optim.lr_scheduling import build_lr_scheduler, lr_factor


def _factors(total: int, **kw) -> list[float]:
    cfg = LRScheduler(**kw)
    return [lr_factor(s, total_steps=total, cfg=cfg) for s in range(1, total + 1)]


def test_warmup_then_linear_decay_to_zero():
    f = _factors(10, warmup_steps=4, decay_type="linear", min_lr_factor=0.0)
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    # 6 decay steps: progress 1/6 .. 6/6
    assert f[4:] == pytest.approx([1 - k / 6 for k in range(1, 7)])
    assert f[-1] == 0.0


def test_warmup_stable_decay_with_min_lr():
    f = _factors(20, warmup_steps=0, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.1)
    assert f[:15] == [1.0] * 15  # stable phase
    assert f[15:] == pytest.approx([0.1 + 0.9 * (1 - k / 5) for k in range(1, 6)])
    assert f[-1] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kind, curve",
    [
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_sqrt_and_cosine(kind, curve):
    f = _factors(12, warmup_steps=2, decay_type=kind, min_lr_factor=0.2)
    assert f[:2] == pytest.approx([1 / 3, 2 / 3])
    expected = [0.2 + 0.8 * curve(k / 10) for k in range(1, 11)]
    assert f[2:] == pytest.approx(expected)


def test_decay_ratio_zero_keeps_lr_constant():
    assert _factors(6, warmup_steps=1, decay_ratio=0.0)[1:] == [1.0] * 5


def test_warmup_longer_than_training_is_clamped():
    f = _factors(3, warmup_steps=100)
    assert f == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_scheduler_applies_factor_before_each_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    cfg = LRScheduler(warmup_steps=2, decay_type="linear", min_lr_factor=0.0)
    sched = build_lr_scheduler(opt, cfg, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2 * f for f in _factors(4, warmup_steps=2, min_lr_factor=0.0)])
    assert sched.state_dict()["last_epoch"] == 4


def test_optimizers_share_the_schedule_each_from_its_own_peak():
    """An ``Optimizers``' schedulers (AdamW and Muon beside it): each optimizer's lr is its own
    base lr times the one ``factor()`` the metrics report (``lr`` and ``lr/muon``)."""
    from torchtitan.optim.lr_scheduling import LRSchedulers

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    opts = [torch.optim.SGD([params[0]], lr=8e-4), torch.optim.SGD([params[1]], lr=0.02)]

    cfg = LRScheduler(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    sched = build_lr_scheduler(opts, cfg, total_steps=6)
    assert isinstance(sched, LRSchedulers)
    expected = _factors(6, warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    for step in range(6):
        assert sched.factor() == pytest.approx(expected[step])
        assert opts[0].param_groups[0]["lr"] == pytest.approx(8e-4 * expected[step])
        assert opts[1].param_groups[0]["lr"] == pytest.approx(0.02 * expected[step])
        for o in opts:
            o.step()
        sched.step()
