"""Autograd, fake (meta) implementations, torch.compile/opcheck and the reference fallback of
k2_kernels.ops. Gradients are compared with autograd through k2_kernels.reference (fp32,
tolerance 1e-5) and, for the routing weights, checked with gradcheck in float64."""

import warnings

import pytest
import torch
from k2_kernels import _lib, ops, reference
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class _RouteWeights(torch.autograd.Function):
    """Routing weights for fixed experts in float64, with ops.route_weight_backward as backward."""

    @staticmethod
    def forward(ctx, logits_TE, idx_TK, scale, norm):
        ctx.save_for_backward(logits_TE, idx_TK)
        ctx.scale, ctx.norm = scale, norm
        s_TK = logits_TE.gather(1, idx_TK).sigmoid()
        w_TK = s_TK / (s_TK.sum(-1, keepdim=True) + 1e-20) if norm else s_TK
        return w_TK * scale

    @staticmethod
    def backward(ctx, g_TK):
        logits_TE, idx_TK = ctx.saved_tensors
        return ops.route_weight_backward(logits_TE, idx_TK, g_TK, ctx.scale, ctx.norm), None, None, None


@pytest.mark.parametrize("norm", [True, False])
def test_route_weight_backward_gradcheck_float64(norm):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    idx, _ = reference.moe_route(logits.detach(), None, 4, 4, 2, 2.5, norm)
    assert torch.autograd.gradcheck(lambda l: _RouteWeights.apply(l, idx, 2.5, norm), (logits,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_route_grad_matches_reference_autograd(device, grouped, norm):
    gen = torch.Generator().manual_seed(1)
    T, E, K = 64, 256, 8
    G, TG = (8, 4) if grouped else (1, 1)
    logits0 = torch.randn(T, E, generator=gen)
    bias = (0.05 * torch.randn(E, generator=gen)).requires_grad_()
    g = torch.randn(T, K, generator=gen)
    l1 = logits0.clone().to(device).requires_grad_()
    b1 = bias.detach().to(device).requires_grad_()
    idx, w = ops.moe_route(l1, b1, K, G, TG, 2.827, norm)
    (w * g.to(device)).sum().backward()
    # Autograd through the reference's weight formula, for the experts the kernel chose (on a
    # GPU an fp32 near-tie may order two experts differently from the CPU reference).
    l2 = logits0.clone().requires_grad_()
    s = l2.sigmoid().gather(1, idx.cpu())
    rw = (s / (s.sum(-1, keepdim=True) + 1e-20) if norm else s) * 2.827
    (rw * g).sum().backward()
    if device == "cpu":
        assert torch.equal(idx, reference.moe_route(logits0, bias.detach(), K, G, TG, 2.827, norm)[0])
    torch.testing.assert_close(l1.grad.cpu(), l2.grad, atol=1e-5, rtol=1e-5)
    assert b1.grad is None  # the selection bias gets no gradient


@pytest.mark.parametrize("norm", [True, False])
def test_route_backward_kernel_matches_the_composition(norm):
    """k2::moe_route_backward (one C++ pass on fp32 CPU) against ops.route_weight_backward's torch
    composition, with strided logits (a column slice); opcheck; an out-of-range index is named."""
    gen = torch.Generator().manual_seed(5)
    T, E, K = 77, 96, 6
    logits = torch.randn(T, E + 5, generator=gen)[:, :E]
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    g = torch.randn(T, K, generator=gen)
    got = torch.ops.k2.moe_route_backward(logits, idx, g, 2.5, norm)
    want = ops.route_weight_backward(logits, idx, g, 2.5, norm)
    assert got.shape == (T, E) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.count_nonzero(got) <= T * K
    opcheck(torch.ops.k2.moe_route_backward.default, (logits.contiguous(), idx, g, 2.5, norm))
    if _lib.has_cpu():
        with pytest.raises(ValueError, match=r"topk_idx\[.*\] = 96 is outside"):
            torch.ops.k2.moe_route_backward(logits, idx.clamp(max=E - 1) + 1, g, 2.5, norm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_grads_match_reference_autograd(device, dtype):
    gen = torch.Generator().manual_seed(2)
    T, E, K, D = 50, 32, 4, 24
    x0 = torch.randn(T, D, generator=gen).to(dtype)
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    w0 = torch.rand(T, K, generator=gen)
    scale_ND = torch.randn(T * K, D, generator=gen).to(dtype)  # a stand-in "expert"
    g = torch.randn(T, D, generator=gen).to(dtype)

    def run(mod, dev):
        x = x0.clone().to(dev).requires_grad_()
        w = w0.clone().to(dev).requires_grad_()
        x_ND, rows, _, _ = mod.moe_permute(x, idx.to(dev), E)
        out = mod.moe_unpermute(x_ND * scale_ND.to(dev), rows, w)
        (out.float() * g.to(dev).float()).sum().backward()
        return x.grad.cpu().float(), w.grad.cpu().float()

    gx, gw = run(ops, device)
    rx, rw = run(reference, "cpu")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)


def test_opcheck_cpu():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 64, generator=gen)
    # opcheck's aot test sums every output, which fails for the int64 index output when the
    # inputs require grad; the routing backward is covered by the compile test below.
    for args in [
        (logits, torch.randn(64, generator=gen), 4, 4, 2, 2.5, True),
        (logits, None, 6, 1, 1, 1.0, False),
    ]:
        opcheck(torch.ops.k2.moe_route.default, args)
    idx = torch.rand(9, 64, generator=gen).argsort(1)[:, :4]
    for x_dtype, i_dtype in [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)]:
        x = torch.randn(9, 16, generator=gen).to(x_dtype).requires_grad_()
        opcheck(torch.ops.k2.moe_permute.default, (x, idx.to(i_dtype), 64))
    _, rows, _, _ = reference.moe_permute(torch.zeros(9, 1), idx, 64)
    y = torch.randn(36, 16, generator=gen, requires_grad=True)
    w = torch.rand(9, 4, generator=gen, requires_grad=True)
    opcheck(torch.ops.k2.moe_unpermute.default, (y, rows, w))


def test_fake_shapes():
    with FakeTensorMode():
        logits = torch.empty(7, 384)
        idx, w = ops.moe_route(logits, torch.empty(384), 8)
        assert (idx.shape, idx.dtype, w.shape, w.dtype) == ((7, 8), torch.int64, (7, 8), torch.float32)
        x = torch.empty(7, 32, dtype=torch.bfloat16)
        x_ND, rows, counts, offsets = ops.moe_permute(x, idx, 384)
        assert (x_ND.shape, x_ND.dtype) == ((56, 32), torch.bfloat16)
        assert (rows.shape, rows.dtype) == ((56,), torch.int64)
        assert (counts.shape, counts.dtype, offsets.shape, offsets.dtype) == (
            (384,),
            torch.int32,
            (384,),
            torch.int32,
        )
        out = ops.moe_unpermute(x_ND, rows, w)
        assert (out.shape, out.dtype) == ((7, 32), torch.bfloat16)
        with pytest.raises(ValueError, match="y_ND"):
            ops.moe_unpermute(x_ND[:5], rows, w)


def test_torch_compile_fullgraph_forward_backward():
    gen = torch.Generator().manual_seed(5)
    T, E, K, D = 16, 64, 4, 8
    logits0, x0 = torch.randn(T, E, generator=gen), torch.randn(T, D, generator=gen)
    bias = 0.1 * torch.randn(E, generator=gen)
    expert = torch.randn(T * K, D, generator=gen)

    def moe(logits, x):
        idx, w = ops.moe_route(logits, bias, K, 4, 2, 2.0)
        x_ND, rows, counts, offsets = ops.moe_permute(x, idx, E)
        return ops.moe_unpermute(x_ND * expert, rows, w)

    results = []
    for fn in (moe, torch.compile(moe, fullgraph=True, backend="aot_eager")):
        logits, x = logits0.clone().requires_grad_(), x0.clone().requires_grad_()
        out = fn(logits, x)
        out.square().sum().backward()
        results.append((out.detach(), logits.grad, x.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def test_fallback_warns_once_and_matches(monkeypatch):
    monkeypatch.setattr(_lib, "_compiled", None)
    monkeypatch.setattr(_lib, "_LOAD_ERROR", "ImportError: simulated")
    monkeypatch.setattr(_lib, "_warned", False)
    assert not _lib.available() and _lib.info()["compiled"] is False
    logits = torch.randn(5, 32)
    with pytest.warns(RuntimeWarning, match=r"k2_kernels\._C could not be imported.*simulated"):
        idx, w = ops.moe_route(logits, None, 4)
    ridx, rw = reference.moe_route(logits, None, 4)
    assert torch.equal(idx, ridx) and torch.equal(w, rw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fallback must stay silent
        x_ND, rows, counts, offsets = ops.moe_permute(torch.randn(5, 3), idx, 32)
    assert torch.equal(rows, reference.moe_permute(torch.randn(5, 3), idx, 32)[1])


def test_info_reports_build():
    info = _lib.info()
    assert info["compiled"] and info["cpu_kernels"]
    if info["cuda_kernels"]:
        assert "90a" in info["cuda_archs"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 7])  # vectorised rows and unaligned rows
def test_unpermute_backward_kernel_matches_torch(device, dtype, D):
    """The fused backward kernel against autograd through the reference (grads of y and w)."""
    gen = torch.Generator().manual_seed(7)
    T, E, K = 120, 32, 6
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    _, rows, _, _ = reference.moe_permute(torch.zeros(T, 1), idx, E)
    y = torch.randn(T * K, D, generator=gen).to(dtype)
    w = torch.rand(T, K, generator=gen)
    g = torch.randn(T, D, generator=gen).to(dtype)
    yr, wr = y.clone().requires_grad_(), w.clone().requires_grad_()
    reference.moe_unpermute(yr, rows, wr).backward(g)
    for need_y, need_w in [(True, True), (True, False), (False, True)]:
        gy, gw = torch.ops.k2.moe_unpermute_backward(
            g.to(device), y.to(device), rows.to(device), w.to(device), need_y, need_w
        )
        if need_y:
            # the reference rounds w * g once into y's dtype; so does the kernel
            torch.testing.assert_close(gy.cpu(), yr.grad, atol=1e-6, rtol=1e-6)
        else:
            assert gy.numel() == 0
        if need_w:
            tol = 1e-5 if dtype == torch.float32 else 1e-4
            torch.testing.assert_close(gw.cpu(), wr.grad, atol=tol, rtol=tol)
        else:
            assert gw.numel() == 0


def test_opcheck_unpermute_backward_cpu():
    gen = torch.Generator().manual_seed(8)
    idx = torch.rand(9, 16, generator=gen).argsort(1)[:, :4]
    _, rows, _, _ = reference.moe_permute(torch.zeros(9, 1), idx, 16)
    args = (
        torch.randn(9, 8, generator=gen),
        torch.randn(36, 8, generator=gen),
        rows,
        torch.rand(9, 4, generator=gen),
    )
    for need in [(True, True), (False, True)]:
        opcheck(torch.ops.k2.moe_unpermute_backward.default, (*args, *need))


def test_meta_device_forward_backward():
    """The model instantiates on the meta device: the ops must trace shapes there, backward too."""
    logits = torch.empty(4, 16, device="meta", requires_grad=True)
    x = torch.empty(4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    idx, w = ops.moe_route(logits, None, 2)
    x_ND, rows, counts, offsets = ops.moe_permute(x, idx, 16)
    out = ops.moe_unpermute(x_ND, rows, w)
    out.float().sum().backward()
    assert out.shape == (4, 8) and x.grad.shape == (4, 8) and logits.grad.shape == (4, 16)
