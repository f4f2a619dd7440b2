"""k2::mla_attention on CPU against the PyTorch reference (issue 7's tolerances).

fp32: ||ours - ref|| / ||ref|| <= 1e-5 for the output, lse and every gradient, the reference run
in float64. bf16: no more than twice the error of the reference computed in bf16, both measured
against the float64 reference. Max logits: equal to the reference's maximum up to fp32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from k2_kernels import _lib, ops, reference

pytestmark = pytest.mark.skipif(not _lib.has_cpu(), reason="compiled k2_kernels._C not available")

K2_DIMS = (192, 128)  # MLA: 128 nope + 64 rope, v 128


def rel(a: torch.Tensor, b: torch.Tensor, zero_ref_norm: float | None = None) -> float:
    """Norm-relative error. An exactly-zero reference (dq when every sequence has one token: the
    softmax over a single key has no gradient) is measured against `zero_ref_norm`, the size of
    the other gradients, so rounding-level residue passes and a real error does not."""
    a, b = a.detach().double(), b.detach().double()
    nb = float(b.norm())
    if nb == 0 and zero_ref_norm is not None:
        nb = zero_ref_norm
    return float((a - b).norm() / nb)


def grads_close(grads, ref_grads, tol: float) -> bool:
    scale = max(float(g.double().norm()) for g in ref_grads)
    return all(rel(g, rg, scale) <= tol for g, rg in zip(grads, ref_grads, strict=True))


def make(T: int, H: int, Dk: int, Dv: int, dtype=torch.float32, seed: int = 0, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, Dk, generator=g) * spread).to(dtype).requires_grad_()
    k = (torch.randn(T, H, Dk, generator=g) * spread).to(dtype).requires_grad_()
    v = torch.randn(T, H, Dv, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(T, H, Dv, generator=g).to(dtype)
    return q, k, v, dout


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run(fn, q, k, v, dout, cu_seqlens, scale, causal, **kw):
    out, lse, mx = fn(q, k, v, cu_seqlens, softmax_scale=scale, causal=causal, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return out, lse, mx, grads


def ref64(q, k, v, dout, cu_seqlens, scale, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    return run(reference.mla_attention, q64, k64, v64, dout.double(), cu_seqlens, scale, causal)


CASES = [
    # (lengths, H, Dk, Dv, causal)
    ([1], 1, *K2_DIMS, True),  # a single token
    ([17], 4, *K2_DIMS, True),  # odd length, smaller than a block
    ([129], 2, *K2_DIMS, True),  # just past a block boundary
    ([300], 4, *K2_DIMS, True),  # several blocks, partial last one
    ([1, 1, 1, 5, 1], 3, *K2_DIMS, True),  # single-token sequences between others
    ([37, 1, 200, 64, 3], 4, *K2_DIMS, True),  # packed documents of mixed length
    ([60, 90, 7], 2, 64, 64, True),  # other head dims
    ([45], 2, 48, 80, True),
    ([100, 157], 3, *K2_DIMS, False),  # non-causal, within documents
]


@pytest.mark.parametrize("lengths,H,Dk,Dv,causal", CASES)
def test_fp32_matches_reference(lengths, H, Dk, Dv, causal):
    T = sum(lengths)
    q, k, v, dout = make(T, H, Dk, Dv, seed=T + H)
    scale = Dk**-0.5 * 1.3  # not the default, as MLA's YaRN mscale makes it
    c = cu(lengths)
    out, lse, mx, grads = run(ops.mla_attention, q, k, v, dout, c, scale, causal)
    r_out, r_lse, r_mx, r_grads = ref64(q, k, v, dout, c, scale, causal)
    assert out.dtype == torch.float32 and lse.shape == (H, T) and mx.shape == (H,)
    assert rel(out, r_out) <= 1e-5
    assert rel(lse, r_lse) <= 1e-5
    assert grads_close(grads, r_grads, 1e-5)
    # the max logit is one of the logits: equal to the reference's up to fp32 rounding
    torch.testing.assert_close(mx, r_mx, rtol=2e-6, atol=1e-6)


def test_many_packed_documents():
    lengths = [int(x) for x in torch.randint(1, 40, (60,), generator=torch.Generator().manual_seed(3))]
    T, H, Dk, Dv = sum(lengths), 2, *K2_DIMS
    q, k, v, dout = make(T, H, Dk, Dv, seed=11)
    c = cu(lengths)
    out, lse, mx, grads = run(ops.mla_attention, q, k, v, dout, c, Dk**-0.5, True)
    r_out, r_lse, r_mx, r_grads = ref64(q, k, v, dout, c, Dk**-0.5, True)
    assert rel(out, r_out) <= 1e-5 and rel(lse, r_lse) <= 1e-5
    assert grads_close(grads, r_grads, 1e-5)
    torch.testing.assert_close(mx, r_mx, rtol=2e-6, atol=1e-6)


def test_document_boundaries_isolate_documents():
    """Changing document 2 leaves document 1's outputs bit-identical (and vice versa for causal order)."""
    lengths = [70, 90]
    T, H, Dk, Dv = 160, 2, *K2_DIMS
    q, k, v, _ = make(T, H, Dk, Dv, seed=5)
    c = cu(lengths)
    out1, _, _ = ops.mla_attention(q.detach(), k.detach(), v.detach(), c)
    k2_, v2_ = k.detach().clone(), v.detach().clone()
    k2_[75] += 5.0
    v2_[100] -= 3.0
    out2, _, _ = ops.mla_attention(q.detach(), k2_, v2_, c)
    assert torch.equal(out1[:70], out2[:70])
    assert not torch.equal(out1[70:], out2[70:])
    # causality inside a document: changing token 120 leaves tokens 70..119 unchanged
    v3 = v.detach().clone()
    v3[120] += 1.0
    out3, _, _ = ops.mla_attention(q.detach(), k.detach(), v3, c)
    assert torch.equal(out1[:120], out3[:120])
    assert not torch.equal(out1[120:], out3[120:])


def test_max_logit_is_the_largest_allowed_logit():
    """A planted huge logit in a masked (future) position must not count; one in an allowed one must."""
    T, H, Dk, Dv = 40, 2, 64, 64
    q, k, v, _ = make(T, H, Dk, Dv, seed=9)
    q, k, v = q.detach(), k.detach(), v.detach()
    k = k.clone()
    k[30, 0] = q[10, 0] * 50  # query 10 with key 30: future, masked when causal
    planted = float(q[10, 0].detach().double().square().sum() * 50 * Dk**-0.5)
    _, _, mx_causal = ops.mla_attention(q, k, v, causal=True)
    _, _, mx_full = ops.mla_attention(q, k, v, causal=False)
    _, _, r_causal = reference.mla_attention(q, k, v, None, Dk**-0.5, True)
    _, _, r_full = reference.mla_attention(q, k, v, None, Dk**-0.5, False)
    torch.testing.assert_close(mx_causal, r_causal, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(mx_full, r_full, rtol=2e-6, atol=1e-6)
    assert math.isclose(float(mx_full[0]), planted, rel_tol=1e-5)
    assert mx_causal[0] < 0.5 * planted


def test_bf16_within_twice_the_bf16_reference_error():
    lengths = [150, 61]
    T, H, Dk, Dv = sum(lengths), 4, *K2_DIMS
    q, k, v, dout = make(T, H, Dk, Dv, dtype=torch.bfloat16, seed=21)
    c = cu(lengths)
    out, _, mx, grads = run(ops.mla_attention, q, k, v, dout, c, Dk**-0.5, True)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    r_out, _, r_mx, r_grads = ref64(q, k, v, dout, c, Dk**-0.5, True)
    b_out, _, _, b_grads = run(
        reference.mla_attention, q, k, v, dout, c, Dk**-0.5, True, compute_dtype=torch.bfloat16
    )
    assert rel(out, r_out) <= 2 * rel(b_out, r_out)
    for g, rg, bg in zip(grads, r_grads, b_grads, strict=True):
        assert rel(g, rg) <= 2 * rel(bg, rg)
    torch.testing.assert_close(mx, r_mx, rtol=2e-6, atol=1e-6)


def test_large_logits_stay_finite():
    """Online softmax must not overflow when logits are in the hundreds (what QK-Clip guards against)."""
    T, H, Dk, Dv = 300, 2, *K2_DIMS
    q, k, v, dout = make(T, H, Dk, Dv, seed=2, spread=6.0)
    out, lse, mx, grads = run(ops.mla_attention, q, k, v, dout, cu([T]), Dk**-0.5, True)
    r_out, r_lse, r_mx, r_grads = ref64(q, k, v, dout, cu([T]), Dk**-0.5, True)
    assert float(r_mx.max()) > 150
    assert rel(out, r_out) <= 1e-5 and rel(lse, r_lse) <= 1e-5
    assert all(torch.isfinite(g).all() for g in grads)
    # Logits in the hundreds make the gradients ill-conditioned: the fp32 PyTorch reference itself
    # lands ~1.2e-5 from float64 here, so the bound is twice its error (as for bf16).
    f_grads = run(reference.mla_attention, q, k, v, dout, cu([T]), Dk**-0.5, True)[3]
    for g, rg, fg in zip(grads, r_grads, f_grads, strict=True):
        assert rel(g, rg) <= max(1e-5, 2 * rel(fg, rg))


def test_builtin_gemm_fallback_matches(monkeypatch):
    """The kernel is also right with the built-in GEMM (no OpenBLAS installed)."""
    C = _lib.compiled()
    T, H, Dk, Dv = 150, 2, *K2_DIMS
    q, k, v, dout = make(T, H, Dk, Dv, seed=4)
    c = cu([90, 60])
    expected = ref64(q, k, v, dout, c, Dk**-0.5, True)
    C.blas_set_sgemm(0)
    try:
        out, lse, mx, grads = run(ops.mla_attention, q, k, v, dout, c, Dk**-0.5, True)
    finally:
        _lib._attach_blas()
    assert rel(out, expected[0]) <= 1e-5 and rel(lse, expected[1]) <= 1e-5
    assert grads_close(grads, expected[3], 1e-5)


def test_defaults_and_empty_sequences():
    T, H, Dk, Dv = 33, 2, *K2_DIMS
    q, k, v, _ = make(T, H, Dk, Dv, seed=8)
    out, lse, mx = ops.mla_attention(q.detach(), k.detach(), v.detach())  # one sequence, scale Dk^-0.5
    r_out, r_lse, r_mx = reference.mla_attention(q.detach(), k.detach(), v.detach(), None, 1 / math.sqrt(Dk))
    assert rel(out, r_out) <= 1e-5
    # empty sequences in cu_seqlens are allowed and contribute nothing
    c = torch.tensor([0, 0, 10, 10, 33, 33], dtype=torch.int32)
    out_e, _, mx_e = ops.mla_attention(q.detach(), k.detach(), v.detach(), c)
    r_e, _, rmx_e = reference.mla_attention(q.detach(), k.detach(), v.detach(), c, 1 / math.sqrt(Dk))
    assert rel(out_e, r_e) <= 1e-5
    torch.testing.assert_close(mx_e, rmx_e, rtol=2e-6, atol=1e-6)


def test_bad_inputs_name_the_problem():
    q = torch.randn(10, 2, 64)
    v = torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match="q .* and k"):
        ops.mla_attention(q, torch.randn(10, 2, 32), v)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\]"):
        ops.mla_attention(q, q, v, torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.mla_attention(q, q, v, torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="3-D"):
        ops.mla_attention(q[0], q[0], v[0])


def test_opcheck():
    T, H, Dk, Dv = 20, 2, 64, 32
    q, k, v, _ = make(T, H, Dk, Dv, seed=1)
    c = cu([12, 8])
    for keep in (False, True):
        torch.library.opcheck(torch.ops.k2.mla_attention.default, (q, k, v, c, 12, Dk**-0.5, True, keep))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.k2.mla_attention.default, (*leaves, c, 12, Dk**-0.5, True, True))


@pytest.mark.parametrize("causal", [True, False])
def test_kept_probabilities_give_the_recomputed_gradients(causal):
    """Short sequences keep the forward's probabilities for the backward (attention_ops.
    PROBS_MAX_SEQLEN); gradients equal the recomputing backward's to fp32 rounding and the float64
    reference's within the usual bound; the kept probabilities are the softmax (upper part 0)."""
    from k2_kernels import attention_ops

    T, H, Dk, Dv = 300, 3, 192, 128
    lengths = [256, 1, 43]
    q, k, v, dout = make(T, H, Dk, Dv, seed=7)
    c = cu(lengths)
    assert attention_ops._keeps_probs(q, k, v, 256) and not attention_ops._keeps_probs(q, k, v, 257)
    q, k, v = (t.detach() for t in (q, k, v))

    def rel_err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    grads = {}
    for keep in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, mx, probs = torch.ops.k2.mla_attention(*leaves, c, 256, Dk**-0.5, causal, keep)
        assert probs.shape == ((H, T, 256) if keep else (0,))
        out.backward(dout)
        grads[keep] = [t.grad for t in leaves]
        if keep:  # the first sequence's probabilities: softmax of its scaled logits
            s = torch.einsum("qhd,khd->hqk", q[:256].double(), k[:256].double()) * Dk**-0.5
            if causal:
                s = s.masked_fill(torch.ones(256, 256, dtype=torch.bool).triu(1), float("-inf"))
            want = s.softmax(-1)
            got = probs[:, :256, :256].double()
            tri = (
                torch.ones(256, 256, dtype=torch.bool).tril()
                if causal
                else torch.ones(256, 256, dtype=torch.bool)
            )
            assert rel_err(got[:, tri], want[:, tri]) <= 1e-5
    for a, b in zip(grads[True], grads[False]):
        assert rel_err(a, b) <= 1e-6
    ref = [t.double().requires_grad_() for t in (q, k, v)]  # q, k, v are detached here
    reference.mla_attention(*ref, c, Dk**-0.5, causal)[0].backward(dout.double())
    for a, b in zip(grads[True], ref):
        assert rel_err(a, b.grad) <= 1e-5


def test_consumers_choose_cpu_kernels_only_with_openblas(monkeypatch):
    """Without OpenBLAS (k2-kernels[blas]) the ops still run the kernels when called, but the
    automatic choices of k2-model and k2-optim keep torch's paths on CPU."""
    from k2_kernels.newton_schulz_ops import kernel_serves

    monkeypatch.setattr(_lib, "BLAS", "builtin")
    assert not _lib.has_fast_blas()
    assert not kernel_serves("cpu", torch.float32)
    monkeypatch.setattr(_lib, "BLAS", "openblas 0.3.x (scipy-openblas32)")
    assert _lib.has_fast_blas() and kernel_serves("cpu", torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_float64_fallback_gradcheck(causal):
    """float64 takes the reference path, forward and (closed-form) backward: gradcheck holds."""
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(10, 2, 16, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(10, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
    c = cu([4, 1, 5])
    assert torch.autograd.gradcheck(
        lambda a, b, d: ops.mla_attention(a, b, d, c, causal=causal)[0], (q, k, v)
    )
