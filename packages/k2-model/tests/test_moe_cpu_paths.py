"""The CPU padded-bmm expert path equals the torch._grouped_mm path (outputs and gradients)."""

import pytest
import torch

from k2_model import K2Config
from k2_model.moe import RoutedExperts


@pytest.mark.parametrize("skew", [False, True])
def test_padded_bmm_equals_grouped_mm(skew):
    cfg = K2Config.preset("tiny", n_routed_experts=8, moe_intermediate_size=32, hidden_size=64)
    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(cfg)
    for p in experts.parameters():
        p.data.normal_(0, 0.05, generator=g)
    N = 96
    probs = torch.tensor([8.0] + [1.0] * 7) if skew else torch.ones(8)
    expert_N = torch.multinomial(probs, N, replacement=True, generator=g).sort().values
    counts_E = torch.bincount(expert_N, minlength=8)
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    x_ND = torch.randn(N, 64, generator=g, requires_grad=True)
    gy_ND = torch.randn(N, 64, generator=g)

    results = []
    for waste in (-1.0, 100.0):  # -1: never pad (grouped_mm); 100: always pad
        experts.cpu_padded_max_waste = waste
        y = experts(x_ND, offsets_E)
        grads = torch.autograd.grad(y, [x_ND, *experts.parameters()], gy_ND)
        results.append((y.detach(), grads))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_padding_is_skipped_when_loads_are_skewed(monkeypatch):
    cfg = K2Config.preset("tiny", n_routed_experts=8, moe_intermediate_size=32, hidden_size=64)
    experts = RoutedExperts(cfg)
    called = []
    monkeypatch.setattr(experts, "_forward_padded", lambda *a: called.append(a) or a[0])
    x = torch.randn(16, 64)
    experts(x, torch.tensor([9, 10, 11, 12, 13, 14, 15, 16], dtype=torch.int32))  # 9 rows on expert 0
    assert not called  # capacity 9 * 8 experts = 72 rows for 16: too much padding
    experts(x, torch.tensor([2, 4, 6, 8, 10, 12, 14, 16], dtype=torch.int32))  # perfectly balanced
    assert called
