"""k2_model.engine.linear: oneDNN-packed linears of the decode step against nn.Linear.

Tolerances: fp32 within 1e-5 relative (the same products, another GEMM's summation order); bf16
within one bf16 rounding of the output (2^-8 relative), both GEMMs accumulating in fp32.
"""

from __future__ import annotations

import pytest
import torch
from k2_model.engine import linear as packed
from torch import nn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "dtype,out_features,tol",
    [(torch.float32, 4096, 1e-5), (torch.bfloat16, 96, 2.0**-8)],
    ids=["fp32-large", "bf16-small"],
)
def test_packed_linear_matches_nn_linear_and_follows_in_place_updates(dtype, out_features, tol):
    torch.manual_seed(0)
    mod = nn.Linear(256, out_features, bias=True).to(dtype)
    x = torch.randn(2, 5, 256).to(dtype)
    with torch.inference_mode():
        assert packed._packs_weight(mod.weight)
        y = packed.linear(mod, x)
        assert y.shape == (2, 5, out_features) and y.dtype == dtype
        assert rel(y, mod(x)) <= tol
    before = packed._packs[mod.weight][1]
    with torch.no_grad():  # a weight sync: copy_ into the parameter bumps its version
        mod.weight.copy_(torch.randn_like(mod.weight))
    with torch.inference_mode():
        assert rel(packed.linear(mod, x), mod(x)) <= tol  # re-packed, not the stale pack
    assert packed._packs[mod.weight][1] is not before


def test_small_fp32_gradients_and_other_devices_take_nn_linear():
    small = nn.Linear(256, 128)  # below FP32_MIN_ELEMENTS: oneDNN's fixed cost loses there
    assert not packed._packs_weight(small.weight)
    big = nn.Linear(256, 4096)
    x = torch.randn(3, 256, requires_grad=True)
    y = packed.linear(big, x)  # gradients wanted: nn.Linear, differentiable
    y.sum().backward()
    assert x.grad is not None and big.weight.grad is not None
    assert big.weight not in packed._packs
    assert not packed._packs_weight(torch.empty(4096, 256, device="meta"))


def test_a_refused_weight_or_input_falls_back_for_itself_not_for_the_process(monkeypatch):
    torch.manual_seed(0)
    refused, other = nn.Linear(256, 96).to(torch.bfloat16), nn.Linear(256, 96).to(torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)
    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(packed, "_pack", lambda w: None if w is refused.weight else real(w.detach(), None))
    with torch.inference_mode():
        assert torch.equal(packed.linear(refused, x), refused(x))  # F.linear, the same numbers
        assert packed._packs[refused.weight][1] is None
        assert rel(packed.linear(other, x), other(x)) <= 2.0**-8
    assert packed._packs[other.weight][1] is not None and not packed._unavailable
    with torch.inference_mode(), pytest.raises(RuntimeError):  # a caller's shape error still surfaces
        packed.linear(other, torch.randn(3, 128).to(torch.bfloat16))
    assert not packed._unavailable
