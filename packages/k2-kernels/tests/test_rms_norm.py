"""k2::rms_norm (fused CPU forward + backward) against F.rms_norm in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k2_kernels import _lib, ops, reference

pytestmark = pytest.mark.skipif(
    not hasattr(_lib.compiled(), "rms_norm_fwd_cpu"), reason="compiled rms_norm kernel not available"
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("shape", [(4, 256, 256), (1024, 128), (3, 5, 7), (1, 2), (2, 3, 4, 33)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_forward_and_gradients_match_float64(shape, threads):
    g0 = torch.Generator().manual_seed(sum(shape))
    D = shape[-1]
    x = (torch.randn(*shape, generator=g0) * 3).requires_grad_()
    w = torch.randn(D, generator=g0).requires_grad_()
    g = torch.randn(*shape, generator=g0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ops.rms_norm(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, (x, w), g)
    finally:
        torch.set_num_threads(prev)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.rms_norm(x64, (D,), w64, 1e-6)
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.double())
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel(y, ref) <= 1e-6 and rel(dx, rdx) <= 1e-5 and rel(dw, rdw) <= 1e-5
    torch.testing.assert_close(reference.rms_norm(x64, w64, 1e-6), ref)


def test_weight_gradient_is_deterministic_and_only_requested_grads():
    x = torch.randn(500, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    g = torch.randn(500, 64)
    runs = [torch.autograd.grad(ops.rms_norm(x, w), (w,), g)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    (dx,) = torch.autograd.grad(ops.rms_norm(x, w.detach()), (x,), g)  # w without grad
    assert dx.shape == x.shape


def test_non_kernel_inputs_fall_back_and_opcheck():
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ops.rms_norm(x, w), F.rms_norm(x, (16,), w, 1e-6))
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b), (x, w))
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(torch.randn(3, 8), torch.randn(7))
    torch.library.opcheck(torch.ops.k2.rms_norm.default, (torch.randn(5, 12), torch.randn(12), 1e-6))


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_no_grad_calls_skip_the_op_dispatch_with_the_same_result(grad_mode, monkeypatch):
    """Inference calls go straight to the kernel: bit-identical to the op's forward, strided input too."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2, 40, generator=gen)[:, 1]  # [9, 40], rows strided
    w = torch.randn(40, generator=gen)
    expect = torch.ops.k2.rms_norm(x, w, 1e-5)[0]
    from k2_kernels import norm_ops

    monkeypatch.setattr(norm_ops, "_rms_norm", None)  # the op is not called at all
    ctx = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    with ctx:
        got = ops.rms_norm(x, w, 1e-5)
    assert torch.equal(got, expect)
    assert rel(got, reference.rms_norm(x.double(), w.double(), 1e-5)) <= 1e-6
