"""WSD schedule at its breakpoints, driven through a real optimizer."""

import math

import pytest
import torch
from k2_optim import Muon, wsd_schedule


def _lrs(warmup, stable, decay, ratio, n, base=2e-4):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = Muon([p], lr=base)
    sched = wsd_schedule(opt, warmup, stable, decay, ratio)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_breakpoints_k2_like():
    W, S, D, r, base = 5, 10, 8, 0.1, 2e-4
    lr = _lrs(W, S, D, r, W + S + D + 5, base)
    assert lr[0] == pytest.approx(base / W)  # first step already learns
    assert lr[W - 1] == pytest.approx(base)  # warmup ends exactly at the peak
    assert all(x == pytest.approx(base) for x in lr[W : W + S])  # stable plateau
    assert lr[W + S] == pytest.approx(base)  # decay starts from the peak (cos 0)
    mid = W + S + D // 2
    assert lr[mid] == pytest.approx(base * (r + (1 - r) * 0.5))  # cosine midpoint
    q = W + S + 2
    assert lr[q] == pytest.approx(base * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * 2 / D))))
    assert all(x == pytest.approx(base * r) for x in lr[W + S + D :])  # held at 2e-5
    assert all(a >= b for a, b in zip(lr[W + S :], lr[W + S + 1 :]))  # monotone decay


def test_no_warmup_no_decay_and_bad_args():
    lr = _lrs(0, 3, 0, 0.5, 5, base=1.0)
    assert lr == [1.0, 1.0, 1.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="min_lr_ratio"):
        _lrs(1, 1, 1, 1.5, 1)
    with pytest.raises(ValueError, match="warmup_steps"):
        _lrs(-1, 1, 1, 0.1, 1)
