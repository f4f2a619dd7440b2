"""k2::grouped_mm (CPU grouped GEMM over experts) against torch._grouped_mm and a per-expert loop:
forward and both gradients in fp32 (relative Frobenius error <= 1e-5), for contiguous weights
and transposed views, empty experts, one expert holding every row (split across threads), odd
sizes, rows after the last group; the weight-gradient op; opcheck; bad input. The fused SwiGLU
experts op (k2::moe_swiglu_experts) against the same MLP through torch._grouped_mm and F.silu."""

import pytest
import torch
import torch.nn.functional as F
from k2_kernels import _lib
from k2_kernels import grouped_gemm_ops as gg
from torch.library import opcheck

pytestmark = pytest.mark.skipif(not gg.kernel_available(), reason="k2_kernels._C without the grouped GEMM")

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def offsets_from_counts(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def skewed_counts(E: int, N: int, seed: int) -> list[int]:
    """Random counts summing to N with a few heavy experts and some empty ones."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(E, generator=gen) ** 4
    p[torch.randperm(E, generator=gen)[: E // 4]] = 0.0
    idx = torch.multinomial(p / p.sum(), N, replacement=True, generator=gen)
    return idx.bincount(minlength=E).tolist()


def loop_grouped_mm(x_NK, w_EKM, offsets_E):
    """Reference: one fp64 matmul per expert; rows after the last group are 0."""
    y = torch.zeros(x_NK.shape[0], w_EKM.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        y[start:end] = x_NK[start:end].double() @ w_EKM[e].double()
        start = end
    return y


def make_weight(E, K, M, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    if transposed:  # stored [E, M, K] (nn.Linear's layout) and used as a transposed view
        return torch.randn(E, M, K, generator=gen).requires_grad_(), lambda p: p.transpose(-2, -1)
    return torch.randn(E, K, M, generator=gen).requires_grad_(), lambda p: p


@pytest.fixture(params=[16, 0, 7], ids=lambda c: f"panel{c}")
def panel(request):
    """Column-panel width of the few-row GEMMs (k2::sgemm_few_rows): the default, one BLAS call,
    and an odd width whose last panel is partial."""
    C = _lib.compiled()
    old = C.blas_panel_columns()
    C.blas_set_panel_columns(request.param)
    yield request.param
    C.blas_set_panel_columns(old)


CASES = {
    "skewed": (skewed_counts(16, 700, 0), 64, 48),
    "empty_experts": ([0, 5, 0, 0, 40, 1, 0, 0], 32, 16),
    "one_expert_all_rows": ([0, 0, 515, 0], 64, 32),
    "single_expert": ([333], 16, 64),
}


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_torch_grouped_mm(case, transposed, threads, panel):
    counts, K, M = CASES[case]
    E, N = len(counts), sum(counts)
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(N, K, generator=gen)
    dy = torch.randn(N, M, generator=gen)
    p1, view = make_weight(E, K, M, transposed, seed=2)
    p2 = p1.detach().clone().requires_grad_()
    x1, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()

    y1 = gg.grouped_mm(x1, view(p1), offs)
    y2 = torch._grouped_mm(x2, view(p2), offs=offs)
    assert y1.shape == y2.shape == (N, M)
    assert rel_err(y1, y2) <= TOL
    assert rel_err(y1, loop_grouped_mm(x0, view(p1.detach()), offs)) <= TOL
    y1.backward(dy)
    y2.backward(dy)
    assert rel_err(x1.grad, x2.grad) <= TOL
    assert rel_err(p1.grad, p2.grad) <= TOL
    # A parameter used transposed gets its gradient in its own layout (no copy when accumulated).
    assert p1.grad.is_contiguous()
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(p1.grad[e]) == 0


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_odd_sizes_and_rows_after_last_group(transposed, threads):
    # Sizes torch._grouped_mm rejects (rows not 16-byte aligned): against the per-expert loop.
    counts, K, M = [7, 0, 30, 1, 0, 19], 37, 23
    N = sum(counts) + 5  # 5 rows after the last group: output 0, gradient 0
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, K, generator=gen, requires_grad=True)
    p, view = make_weight(len(counts), K, M, transposed, seed=4)
    y = gg.grouped_mm(x, view(p), offs)
    ref = loop_grouped_mm(x.detach(), view(p.detach()), offs)
    assert rel_err(y, ref) <= TOL
    assert torch.count_nonzero(y[-5:]) == 0
    dy = torch.randn(N, M, generator=gen)
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    pr = p.detach().double().requires_grad_()
    loop_grouped_mm_autograd(xr, view(pr), offs).backward(dy.double())
    assert rel_err(x.grad, xr.grad) <= TOL
    assert rel_err(p.grad, pr.grad) <= TOL
    assert torch.count_nonzero(x.grad[-5:]) == 0


def loop_grouped_mm_autograd(x_NK, w_EKM, offsets_E):
    parts, start = [], 0
    for e, end in enumerate(offsets_E.tolist()):
        parts.append(x_NK[start:end] @ w_EKM[e])
        start = end
    parts.append(x_NK.new_zeros(x_NK.shape[0] - start, w_EKM.shape[2]))
    return torch.cat(parts)


def test_strided_rows_and_expanded_weight():
    counts = [10, 0, 22]
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(32, 40, generator=gen)
    x = big[:, 4:36]  # row stride 40
    w = torch.randn(1, 32, 8, generator=gen).expand(3, 32, 8)  # expert stride 0
    assert (
        rel_err(gg.grouped_mm(x, w, offs), torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offs))
        <= TOL
    )


@pytest.mark.parametrize("trans_out", [False, True])
def test_wgrad_matches_torch(trans_out, threads):
    counts = skewed_counts(12, 400, 6)
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(400, 48, generator=gen), torch.randn(400, 24, generator=gen)
    got = gg.grouped_mm_wgrad(x, dy, offs, trans_out)
    ref = torch._grouped_mm(x.t(), dy, offs=offs)
    assert got.shape == ((12, 24, 48) if trans_out else (12, 48, 24)) and got.is_contiguous()
    assert rel_err(got.transpose(-2, -1) if trans_out else got, ref) <= TOL


def test_opcheck():
    offs = offsets_from_counts([3, 0, 9, 4])
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(16, 12, generator=gen, requires_grad=True)
    w = torch.randn(4, 20, 12, generator=gen).requires_grad_()
    opcheck(torch.ops.k2.grouped_mm.default, (x, w.transpose(-2, -1), offs))
    opcheck(
        torch.ops.k2.grouped_mm.default, (x, torch.randn(4, 12, 8, generator=gen, requires_grad=True), offs)
    )
    opcheck(
        torch.ops.k2.grouped_mm_wgrad.default, (x.detach(), torch.randn(16, 8, generator=gen), offs, True)
    )
    meta = gg.grouped_mm(torch.empty(16, 12, device="meta"), torch.empty(4, 12, 8, device="meta"),
                         torch.empty(4, dtype=torch.int32, device="meta"))  # fmt: skip
    assert meta.shape == (16, 8) and meta.device.type == "meta"


def test_other_dtypes_run_torch_grouped_mm():
    offs = offsets_from_counts([8, 0, 24])
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(32, 16, generator=gen).bfloat16()
    w = torch.randn(3, 16, 8, generator=gen).bfloat16()
    assert torch.equal(gg.grouped_mm(x, w, offs), torch._grouped_mm(x, w, offs=offs))


def test_bad_input_names_the_argument():
    x, w = torch.randn(10, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="offsets_E"):
        gg.grouped_mm(x, w, torch.tensor([4, 10]))  # int64
    with pytest.raises(ValueError, match="offsets_E"):
        gg.grouped_mm(x, w, torch.tensor([4, 6, 10], dtype=torch.int32))  # wrong length
    with pytest.raises(ValueError, match="offsets"):
        gg.grouped_mm(x, w, torch.tensor([6, 4], dtype=torch.int32))  # decreasing
    with pytest.raises(ValueError, match="offsets"):
        gg.grouped_mm(x, w, torch.tensor([4, 11], dtype=torch.int32))  # past the rows
    with pytest.raises(ValueError, match="w_EKM"):
        gg.grouped_mm(x, torch.randn(2, 7, 4), torch.tensor([4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="x_NK"):
        gg.grouped_mm(x[0], w, torch.tensor([4, 10], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# fused SwiGLU experts


def swiglu_reference(x_ND, gate_EID, up_EID, down_EDI, offsets_E):
    g = loop_grouped_mm_autograd(x_ND, gate_EID.transpose(-2, -1), offsets_E)
    u = loop_grouped_mm_autograd(x_ND, up_EID.transpose(-2, -1), offsets_E)
    return loop_grouped_mm_autograd(F.silu(g) * u, down_EDI.transpose(-2, -1), offsets_E)


SWIGLU_CASES = {
    "skewed": (skewed_counts(16, 700, 10), 64, 32, 0),
    "empty_experts": ([0, 5, 0, 0, 40, 1, 0, 0], 32, 16, 0),
    "one_expert_all_rows": ([0, 0, 515, 0], 64, 32, 0),
    "odd_sizes_rows_after_last_group": ([7, 0, 30, 1, 0, 19], 37, 23, 5),
}


@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_swiglu_experts_forward_and_grads(case, threads, panel):
    counts, D, I, extra = SWIGLU_CASES[case]
    E, N = len(counts), sum(counts) + extra
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(N, D, generator=gen)
    ws0 = [torch.randn(E, I, D, generator=gen) / D**0.5, torch.randn(E, I, D, generator=gen) / D**0.5,
           torch.randn(E, D, I, generator=gen) / I**0.5]  # fmt: skip
    ws0[0][0, 0, 0] = 200.0  # a far-out pre-activation: silu and its gradient saturate
    dy = torch.randn(N, D, generator=gen)
    x1, ws1 = x0.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws0]
    x2, ws2 = x0.double().requires_grad_(), [w.double().requires_grad_() for w in ws0]
    y1 = gg.moe_swiglu_experts(x1, *ws1, offs)
    y2 = swiglu_reference(x2, *ws2, offs)
    assert rel_err(y1, y2) <= TOL
    if extra:
        assert torch.count_nonzero(y1[-extra:]) == 0
    y1.backward(dy)
    y2.backward(dy.double())
    assert rel_err(x1.grad, x2.grad) <= TOL
    for w1, w2 in zip(ws1, ws2):
        assert w1.grad.is_contiguous() and rel_err(w1.grad, w2.grad) <= TOL
    if 0 in counts:
        e = counts.index(0)
        assert all(torch.count_nonzero(w.grad[e]) == 0 for w in ws1)


def test_swiglu_experts_matches_torch_grouped_mm_and_input_grad_only():
    counts = skewed_counts(8, 256, 12)
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(13)
    x0 = torch.randn(256, 64, generator=gen)
    ws = [torch.randn(8, 32, 64, generator=gen) * 0.1, torch.randn(8, 32, 64, generator=gen) * 0.1,
          torch.randn(8, 64, 32, generator=gen) * 0.1]  # fmt: skip
    x1, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    y1 = gg.moe_swiglu_experts(x1, *ws, offs)  # weights without grad: the backward skips their GEMMs
    g = torch._grouped_mm(x2, ws[0].transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(x2, ws[1].transpose(-2, -1), offs=offs)
    y2 = torch._grouped_mm(F.silu(g) * u, ws[2].transpose(-2, -1), offs=offs)
    assert rel_err(y1, y2) <= TOL
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    assert rel_err(x1.grad, x2.grad) <= TOL


def test_swiglu_experts_opcheck_and_fallback(monkeypatch):
    offs = offsets_from_counts([3, 0, 9, 4])
    gen = torch.Generator().manual_seed(14)
    args = (torch.randn(16, 12, generator=gen, requires_grad=True),
            torch.randn(4, 8, 12, generator=gen, requires_grad=True),
            torch.randn(4, 8, 12, generator=gen, requires_grad=True),
            torch.randn(4, 12, 8, generator=gen, requires_grad=True), offs)  # fmt: skip
    opcheck(torch.ops.k2.moe_swiglu_experts.default, args)
    y = gg.moe_swiglu_experts(*args)
    y.backward(torch.ones_like(y))
    # Without the kernel: the torch._grouped_mm composition and its own backward formula.
    monkeypatch.setattr(gg, "_kernel", lambda t: None)
    opcheck(torch.ops.k2.moe_swiglu_experts.default, args)
    args2 = tuple(a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args)
    y2, _gate_up = torch.ops.k2.moe_swiglu_experts(*args2)
    assert rel_err(y2, y) <= TOL
    y2.backward(torch.ones_like(y2))
    for a, b in zip(args[:4], args2[:4]):
        assert rel_err(b.grad, a.grad) <= TOL
    with pytest.raises(ValueError, match="down_EDI"):
        gg.moe_swiglu_experts(args[0], args[1], args[2], torch.randn(4, 8, 12), offs)


# ---------------------------------------------------------------------------------------------
# bf16 weights, no gradients (serving in bf16): k2::moe_swiglu_experts_bf16w

needs_bf16w = pytest.mark.skipif(
    not hasattr(_lib.compiled(), "moe_swiglu_experts_bf16w_cpu"),
    reason="k2_kernels._C without the bf16w kernel",
)


@needs_bf16w
@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_swiglu_experts_bf16_weights_match_fp64_on_the_rounded_inputs(case, threads, panel):
    """The bf16 inputs are exact in fp64, so the fp64 reference on them is the exact answer; the kernel
    accumulates in fp32 and rounds its output to bf16 once: error <= one bf16 rounding of the output
    (relative 2^-8) plus fp32 accumulation. torch's bf16 composition rounds after every GEMM."""
    counts, D, I, extra = SWIGLU_CASES[case]
    E, N = len(counts), sum(counts) + extra
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(N, D, generator=gen).bfloat16()
    ws = [(torch.randn(E, I, D, generator=gen) / D**0.5).bfloat16(),
          (torch.randn(E, I, D, generator=gen) / D**0.5).bfloat16(),
          (torch.randn(E, D, I, generator=gen) / I**0.5).bfloat16()]  # fmt: skip
    with torch.no_grad():
        y = gg.moe_swiglu_experts(x, *ws, offs)
    exact = swiglu_reference(x.double(), *(w.double() for w in ws), offs)
    assert y.dtype == torch.bfloat16
    err = rel_err(y, exact)
    assert err <= 2.0**-8, err
    if D % 8 == 0 and I % 8 == 0:  # torch._grouped_mm wants 16-byte aligned bf16 rows
        with torch.no_grad():
            y_torch = gg._swiglu_torch(x, *ws, offs, with_gate_up=False)[0]
        assert err <= rel_err(y_torch, exact) + 1e-6  # never worse than torch's own bf16 path
    if extra:
        assert torch.count_nonzero(y[-extra:]) == 0


@needs_bf16w
def test_swiglu_experts_bf16_weights_strided_and_gradients_keep_the_torch_path(monkeypatch):
    """Transposed (strided) expert views run the kernel like contiguous ones; with gradients wanted
    the differentiable composition runs instead (the bf16w op has no backward)."""
    counts = [3, 0, 9, 4]
    offs = offsets_from_counts(counts)
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(16, 24, generator=gen).bfloat16()  # sizes torch._grouped_mm takes in bf16 (x 8)
    gate = torch.randn(4, 24, 8, generator=gen).bfloat16().transpose(1, 2)  # [E, I, D] view, row stride 1
    up, down = (
        torch.randn(4, 8, 24, generator=gen).bfloat16(),
        torch.randn(4, 24, 8, generator=gen).bfloat16(),
    )
    exact = swiglu_reference(x.double(), gate.double(), up.double(), down.double(), offs)
    with torch.no_grad():
        assert rel_err(gg.moe_swiglu_experts(x, gate, up, down, offs), exact) <= 2.0**-8
    opcheck(torch.ops.k2.moe_swiglu_experts_bf16w.default, (x, gate.contiguous(), up, down, offs))
    called = []
    monkeypatch.setattr(gg, "_moe_swiglu_experts_bf16w", lambda *a: called.append(1))
    xg = x.clone().requires_grad_()
    y = gg.moe_swiglu_experts(xg, gate, up, down, offs)
    y.float().sum().backward()
    assert not called and xg.grad is not None and xg.grad.dtype == torch.bfloat16
