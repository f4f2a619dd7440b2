"""The CUDA MLA attention kernels (`k2_kernels.ops.mla_attention` on GPU) against the reference.

Shape legend: T packed tokens, H heads, B documents, Dk query/key head dim, Dv value head dim.

Every test needs a GPU (marked `cuda`; run by scripts/gpu_check.sh). The ground truth is
`k2_kernels.reference.mla_attention` computed in float64 on the same (rounded) inputs.
Tolerances, as norm errors ||a - ref||:
  - fp32 (exact SIMT kernels): <= 1e-5 ||ref|| + 1e-6 sqrt(numel). The absolute floor only matters
    where the reference is exactly zero: dk of a one-token document (the softmax derivative of a
    single entry) is 0 in the reference and a few ulps of dP - delta in a kernel.
  - bf16 (tensor cores for (192, 128) and (64, 64); SIMT for other dims or unaligned pointers):
    <= 2x the error of the reference run on the bf16 tensors (fp32 math, bf16 results) + 1e-5
    sqrt(numel), the same floor scaled to bf16 inputs.
  - max logit: equal to the float64 reference's up to fp32 rounding of the dot products
    (rtol 1e-5, atol 1e-5); lse likewise (atol 1e-5 fp32, 1e-4 bf16: __expf).
"""

import math

import pytest
import torch
from k2_kernels import _lib, ops, reference

pytestmark = pytest.mark.cuda

# (document lengths, H, Dk, Dv, causal)
CASES = [
    ([1], 1, 192, 128, True),  # one token
    ([17], 4, 192, 128, True),
    ([129], 16, 192, 128, True),
    ([1000], 4, 192, 128, True),
    ([1000], 1, 192, 128, False),
    ([1, 17, 1, 0, 129, 64, 65, 1], 4, 192, 128, True),  # single tokens, an empty document, tile edges
    ([129, 17], 16, 192, 128, False),
    ([17, 129, 1000], 4, 64, 64, True),
    ([65, 1, 300], 16, 64, 64, False),
    ([100, 33, 1], 4, 48, 80, True),  # no tensor-core instantiation: SIMT for bf16 too
]


def case_id(c) -> str:
    lens, H, Dk, Dv, causal = c
    docs = "-".join(map(str, lens)) if len(lens) <= 4 else f"{len(lens)}docs"
    return f"L{docs}-H{H}-{Dk}x{Dv}-{'causal' if causal else 'full'}"


def packed(lens: list[int], H: int, Dk: int, Dv: int, dtype: torch.dtype, seed: int):
    """Random q, k, v (never zeros) on the GPU, and int32 cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, Dk, generator=gen)
    k = torch.randn(T, H, Dk, generator=gen)
    v = torch.randn(T, H, Dv, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), cu.cuda()


def run(fn, q, k, v, cu, causal, g, **kw):
    """(out, lse, max_logit, dq, dk, dv) of fn with autograd, for the output gradient g."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, mx = fn(*leaves, cu, causal=causal, **kw)
    out.backward(g.to(out.dtype))
    return out.detach(), lse, mx, *(t.grad for t in leaves)


def norm_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).norm().item()


def references(q, k, v, cu, causal, g, scale):
    """The float64 ground truth and, for bf16 inputs, the reference run in the inputs' dtype."""
    hi = run(reference.mla_attention, q.double(), k.double(), v.double(), cu, causal, g.double(),
             softmax_scale=scale)  # fmt: skip
    lo = (
        run(reference.mla_attention, q, k, v, cu, causal, g, softmax_scale=scale)
        if q.dtype != torch.float32
        else None
    )
    return hi, lo


def check_against(got, hi, lo, dtype) -> None:
    names = ("out", "lse", "max_logit", "dq", "dk", "dv")
    for i in (0, 3, 4, 5):
        a, ref = got[i], hi[i]
        assert a.shape == ref.shape and a.dtype == dtype, names[i]
        assert torch.isfinite(a).all(), f"{names[i]}: non-finite entries"
        floor = (1e-6 if dtype == torch.float32 else 1e-5) * math.sqrt(max(ref.numel(), 1))
        err = norm_err(a, ref)
        if dtype == torch.float32:
            bound = 1e-5 * ref.double().norm().item() + floor
        else:
            bound = 2.0 * norm_err(lo[i], ref) + floor
        assert err <= bound, (
            f"{names[i]}: ||a - ref|| = {err:.3e} > {bound:.3e} (||ref|| = {ref.double().norm():.3e})"
        )
    lse_atol = 1e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(got[1], hi[1].float(), rtol=1e-5, atol=lse_atol, msg="lse")
    torch.testing.assert_close(got[2], hi[2].float(), rtol=1e-5, atol=1e-5, msg="max_logit")


def test_cuda_kernels_built():
    """The tests below would pass on the reference fallback too: make sure they run the kernels."""
    C = _lib.compiled()
    assert _lib.has_cuda() and C is not None and hasattr(C, "mla_attention_fwd_cuda"), _lib.info()
    dims = {tuple(p) for p in C.cuda_attention_head_dims}
    assert {(192, 128), (64, 64), (48, 80)} <= dims
    assert {(192, 128), (64, 64)} <= {tuple(p) for p in C.cuda_attention_mma_head_dims}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, dtype):
    lens, H, Dk, Dv, causal = case
    q, k, v, cu = packed(lens, H, Dk, Dv, dtype, seed=sum(lens) + 7 * H + Dk)
    g = torch.randn(sum(lens), H, Dv, generator=torch.Generator().manual_seed(1)).cuda()
    scale = Dk**-0.5
    got = run(ops.mla_attention, q, k, v, cu, causal, g, max_seqlen=max(lens))
    hi, lo = references(q, k, v, cu, causal, g, scale)
    check_against(got, hi, lo, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_documents(dtype):
    """20 packed documents of random lengths (1 to 150), K2's head dims, 16 heads."""
    gen = torch.Generator().manual_seed(20)
    lens = torch.randint(1, 151, (20,), generator=gen).tolist()
    lens[3] = 1
    q, k, v, cu = packed(lens, 16, 192, 128, dtype, seed=3)
    g = torch.randn(sum(lens), 16, 128, generator=gen).cuda()
    for causal in (True, False):
        got = run(ops.mla_attention, q, k, v, cu, causal, g)  # max_seqlen computed by the op
        hi, lo = references(q, k, v, cu, causal, g, 192**-0.5)
        check_against(got, hi, lo, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 64)], ids=["192x128", "64x64"])
def test_document_boundaries(dims, dtype):
    """Perturbing a token of document 2 changes nothing in documents 1 and 3 (bitwise); with
    causal masking, perturbing a late token of document 2 changes none of its earlier outputs."""
    Dk, Dv = dims
    lens = [70, 90, 40]
    q, k, v, cu = packed(lens, 4, Dk, Dv, dtype, seed=5)
    for causal in (True, False):
        out, lse, _ = ops.mla_attention(q, k, v, cu, causal=causal)
        for t in (70, 70 + 89):  # first and last token of document 2
            k2_, v2_ = k.clone(), v.clone()
            k2_[t] += 3.0
            v2_[t] -= 2.0
            out2, lse2, _ = ops.mla_attention(q, k2_, v2_, cu, causal=causal)
            assert torch.equal(out2[:70], out[:70]) and torch.equal(out2[160:], out[160:])
            assert torch.equal(lse2[:, :70], lse[:, :70]) and torch.equal(lse2[:, 160:], lse[:, 160:])
            if causal:
                assert torch.equal(out2[70:t], out[70:t])
            changed = out2[t:160] if causal else out2[70:160]
            assert not torch.equal(changed, out[t:160] if causal else out[70:160])


def poison_allocator_cache() -> None:
    """Fill blocks of both caching-allocator pools with NaN and free them: the small pool (<= 1 MB
    requests, 2 MB segments) and the large one, so that the next torch.empty reuses NaN memory."""
    torch.cuda.synchronize()
    sizes = [1 << 18] * 64 + [1 << 20] * 16 + [64 << 20]  # fp32 elements: 1 MB, 4 MB, 256 MB
    bufs = [torch.full((n,), float("nan"), device="cuda") for n in sizes]
    torch.cuda.synchronize()
    del bufs


def test_every_element_written():
    """Outputs and gradients come from the caching allocator, poisoned with NaN first: any element
    a kernel fails to write stays NaN (the inputs give finite results everywhere)."""
    for dtype, dims in (
        (torch.bfloat16, (192, 128)),
        (torch.bfloat16, (64, 64)),
        (torch.float32, (192, 128)),
    ):
        Dk, Dv = dims
        lens = [1, 63, 64, 65, 0, 130, 1]
        q, k, v, cu = packed(lens, 4, Dk, Dv, dtype, seed=11)
        g = torch.randn(sum(lens), 4, Dv, device="cuda")
        for causal in (True, False):
            torch.cuda.synchronize()
            poison_allocator_cache()
            got = run(ops.mla_attention, q, k, v, cu, causal, g)
            torch.cuda.synchronize()
            for name, t in zip(("out", "lse", "max_logit", "dq", "dk", "dv"), got, strict=True):
                assert torch.isfinite(t).all(), (
                    f"{dtype} {dims} causal={causal}: {name} has unwritten/NaN entries"
                )


def test_unaligned_inputs_take_the_simt_path():
    """bf16 views at an odd element offset (not 16-byte aligned) still match the reference."""
    lens, H, Dk, Dv = [50, 77], 4, 192, 128
    T = sum(lens)
    gen = torch.Generator().manual_seed(13)

    def view(shape):
        n = math.prod(shape)
        return torch.randn(n + 1, generator=gen).to(torch.bfloat16).cuda()[1:].view(shape)

    q, k, v = view((T, H, Dk)), view((T, H, Dk)), view((T, H, Dv))
    assert q.data_ptr() % 16 != 0
    cu = torch.tensor([0, 50, 127], dtype=torch.int32, device="cuda")
    g = torch.randn(T, H, Dv, generator=gen).cuda()
    got = run(ops.mla_attention, q, k, v, cu, True, g)
    hi, lo = references(q, k, v, cu, True, g, Dk**-0.5)
    check_against(got, hi, lo, torch.bfloat16)


def test_side_stream_and_no_tokens():
    """The kernels run on the current stream; a batch without tokens gives -inf max logits."""
    q, k, v, cu = packed([300, 45], 4, 192, 128, torch.bfloat16, seed=17)
    ref = ops.mla_attention(q, k, v, cu)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = ops.mla_attention(q, k, v, cu)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)  # same kernels, same inputs: deterministic forward

    empty = torch.empty(0, 4, 192, dtype=torch.bfloat16, device="cuda")
    out, lse, mx = ops.mla_attention(
        empty, empty, empty[..., :128], torch.zeros(1, dtype=torch.int32, device="cuda")
    )
    assert out.shape == (0, 4, 128) and lse.shape == (4, 0)
    assert torch.equal(mx.cpu(), torch.full((4,), -math.inf))
