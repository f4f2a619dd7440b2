"""k2_kernels.ops (compiled kernels) against k2_kernels.reference, on CPU and (marked `cuda`) GPU.

Shape legend: T tokens, E experts, K experts per token, G groups, D hidden, N = T * K rows.
Tolerances: permutations exact; routing indices exact except at near-ties (selection scores
within 1e-6, which fp32 rounding may order either way: `route_mismatches`); routing weights 2e-6
absolute (fp32 sigmoid and normalisation, x ~2.8 scale); unpermute fp32 1e-6 relative, bf16/fp16
at most one ulp of the dtype.
"""

import math

import pytest
import torch
from k2_kernels import _lib, ops, reference
from k2_kernels.selfcheck import route_mismatches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SCALE = 2.827  # Kimi K2's routed_scaling_factor

pytestmark = pytest.mark.skipif(not _lib.has_cpu(), reason="k2_kernels._C not built")


def distinct_logits(T: int, E: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Per-row permutations of a grid exactly representable in bf16/fp16: no ties in any dtype."""
    step = 2.0 ** -math.ceil(math.log2(E / 8))  # a power of two; |logits| <= 4
    rows = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]) if T else torch.empty(0, E)
    return ((rows.float() - E / 2) * step).to(dtype)


ROUTE_CASES = [
    # (T, E, K, n_group, topk_group)
    (1, 384, 8, 1, 1),  # Kimi K2, one token
    (257, 384, 8, 1, 1),  # Kimi K2, no groups
    (1, 256, 8, 8, 4),  # DeepSeek-V3, one token
    (300, 256, 8, 8, 4),  # DeepSeek-V3 grouped routing
    (40, 64, 6, 4, 2),
    (17, 48, 3, 3, 1),
    (70, 32, 32, 1, 1),  # K = E: everything chosen, order by score
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "T{}-E{}-K{}-G{}-TG{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_route_matches_reference(device, case, dtype):
    T, E, K, G, TG = case
    gen = torch.Generator().manual_seed(T * 1000 + E)
    logits = distinct_logits(T, E, dtype, gen).to(device)
    bias = (0.05 * torch.randn(E, generator=gen)).to(device)
    for b, norm in ((bias, True), (None, True), (bias, False)):
        idx, w = ops.moe_route(logits, b, K, G, TG, SCALE, norm)
        assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.device.type == device
        assert route_mismatches(idx, w, logits, b, K, G, TG, SCALE, norm) == [], (
            f"bias={b is not None} norm={norm}"
        )
        if device == "cpu":  # same fp32 arithmetic as the reference on this CPU: identical
            ridx, rw = reference.moe_route(logits, b, K, G, TG, SCALE, norm)
            assert torch.equal(idx, ridx)
            torch.testing.assert_close(w, rw, atol=2e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_route_random_fp32_and_strided(device):
    """Plain randn logits (ties have probability ~0), non-contiguous rows, float64 on CPU."""
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(513, 400, generator=gen)
    logits = big[:, :384].to(device)  # row stride 400
    bias = 0.1 * torch.randn(384, generator=gen).to(device)
    idx, w = ops.moe_route(logits, bias, 8, 1, 1, SCALE, True)
    assert route_mismatches(idx, w, logits, bias, 8, 1, 1, SCALE, True) == []
    l64 = logits.double()
    idx, w = ops.moe_route(l64, bias.double(), 8, 8, 3, 1.0, True)
    assert route_mismatches(idx, w, l64, bias.double(), 8, 8, 3, 1.0, True, weight_tol=1e-6) == []


def test_route_mismatches_detects_errors_and_allows_near_ties():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    idx, w = reference.moe_route(logits, None, 2)
    assert route_mismatches(idx, w, logits, None, 2) == []
    assert route_mismatches(idx.flip(1), w, logits, None, 2)  # swapped, 0.05 apart: an error
    assert route_mismatches(idx, w + 1e-5, logits, None, 2)  # weights off
    near = torch.tensor([[0.0, 1.0, 3.0, 3.0 + 2e-7]])  # fp32 near-tie: either order is fine
    idx, w = reference.moe_route(near, None, 2)
    swapped = idx.flip(1)
    assert route_mismatches(swapped, w.flip(1), near, None, 2) == []


@pytest.mark.parametrize("device", DEVICES)
def test_route_empty_and_bad_arguments(device):
    idx, w = ops.moe_route(torch.empty(0, 64, device=device), None, 4)
    assert idx.shape == (0, 4) and w.shape == (0, 4)
    x = torch.randn(3, 64, device=device)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(x, None, 65)
    with pytest.raises(ValueError, match="n_group"):
        ops.moe_route(x, None, 4, n_group=5)
    with pytest.raises(ValueError, match="topk_group"):
        ops.moe_route(x, None, 4, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="bias_E"):
        ops.moe_route(x, torch.zeros(63, device=device), 4)


def random_topk(T: int, E: int, K: int, gen: torch.Generator, skew: bool = False) -> torch.Tensor:
    """K distinct experts per token; with skew, most tokens share a few hot experts."""
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    scores = torch.rand(T, E, generator=gen)
    if skew:
        scores[:, :K] += 0.9
    return scores.argsort(dim=1, descending=True)[:, :K].contiguous()


PERMUTE_CASES = [
    # (T, E, K, D, skew)
    (1, 384, 8, 64, False),
    (300, 256, 8, 96, False),
    (5000, 384, 8, 16, False),  # N = 40000: many chunks on the GPU
    (777, 64, 6, 40, True),  # hot experts: stability across long runs of one expert
    (0, 16, 2, 8, False),
    (9, 8, 8, 7, False),  # K = E, odd hidden size (unaligned rows)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", PERMUTE_CASES, ids=lambda c: "T{}-E{}-K{}-D{}-skew{}".format(*c))
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_matches_reference(device, case, idx_dtype, dtype):
    T, E, K, D, skew = case
    gen = torch.Generator().manual_seed(T + E + K)
    x = torch.randn(T, D + 3, generator=gen).to(dtype)[:, :D]  # strided rows
    idx = random_topk(T, E, K, gen, skew).to(idx_dtype)
    got = ops.moe_permute(x.to(device), idx.to(device), E)
    want = reference.moe_permute(x, idx, E)
    names = ("x_ND", "row_to_slot_N", "counts_E", "offsets_E")
    for name, g, r in zip(names, got, want):
        assert g.device.type == device
        assert g.dtype == (torch.int64 if name == "row_to_slot_N" else r.dtype), name
        assert torch.equal(g.cpu(), r.to(g.dtype)), f"{name} differs"


def test_permute_rejects_out_of_range_index_on_cpu():
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 16]])
    with pytest.raises(ValueError, match=r"topk_idx\[3, 1\] = 16"):
        ops.moe_permute(x, idx, 16)


@pytest.mark.cuda
def test_permute_cuda_out_of_range_goes_last():
    """On the GPU an invalid expert id cannot raise: its rows come after all valid rows, uncounted."""
    x = torch.randn(4, 8, device="cuda")
    idx = torch.tensor([[0, 1], [-1, 3], [4, 5], [6, 16]], device="cuda")
    x_ND, rows, counts, offsets = ops.moe_permute(x, idx, 16)
    assert int(counts.sum()) == 6 and int(offsets[-1]) == 6
    assert rows[6:].tolist() == [2, 7]
    assert torch.equal(rows.sort().values.cpu(), torch.arange(8))


UNPERMUTE_TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-8, atol=1e-6),  # one bf16 ulp
    torch.float16: dict(rtol=2**-11, atol=1e-6),  # one fp16 ulp
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    [(1, 384, 8, 64), (300, 256, 8, 96), (64, 16, 4, 7), (50, 32, 2, 1024)],
    ids=lambda c: "T{}-E{}-K{}-D{}".format(*c),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_unpermute_matches_reference(device, case, dtype, w_dtype):
    T, E, K, D = case
    gen = torch.Generator().manual_seed(T * 7 + D)
    idx = random_topk(T, E, K, gen)
    _, rows, _, _ = reference.moe_permute(torch.zeros(T, 1), idx, E)
    y = torch.randn(T * K, D, generator=gen).to(dtype)
    w = torch.rand(T, K, generator=gen).to(w_dtype)
    got = ops.moe_unpermute(y.to(device), rows.to(device), w.to(device))
    want = reference.moe_unpermute(y, rows, w)
    assert got.dtype == dtype and got.shape == (T, D)
    torch.testing.assert_close(got.cpu().float(), want.float(), **UNPERMUTE_TOL[dtype])


def test_unpermute_rejects_non_permutation_on_cpu():
    rows = torch.tensor([0, 1, 1, 3])
    with pytest.raises(ValueError, match="not a permutation"):
        ops.moe_unpermute(torch.randn(4, 8), rows, torch.ones(2, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_route_permute_unpermute_roundtrip(device):
    """Unit weights and identity experts give K * x back: the pipeline the model runs."""
    gen = torch.Generator().manual_seed(3)
    T, E, K, D = 200, 384, 8, 64
    x = torch.randn(T, D, generator=gen).to(device)
    idx, _ = ops.moe_route(torch.randn(T, E, generator=gen).to(device), None, K)
    x_ND, rows, counts, offsets = ops.moe_permute(x, idx, E)
    assert torch.equal(offsets.cpu(), torch.cumsum(counts.cpu(), 0, dtype=torch.int32))
    out = ops.moe_unpermute(x_ND, rows, torch.ones(T, K, device=device))
    torch.testing.assert_close(out, K * x, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_rows_are_copied_not_misread(device):
    """Row stride 0 (an expanded tensor) is made contiguous before the kernels see it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 16, generator=gen).expand(5, 16).to(device)
    idx = torch.rand(5, 8, generator=gen).argsort(1)[:, :2].to(device)
    for g, r in zip(ops.moe_permute(x, idx, 8), reference.moe_permute(x.cpu(), idx.cpu(), 8)):
        assert torch.equal(g.cpu(), r.to(g.dtype))
    logits = torch.randn(1, 8, generator=gen).expand(3, 8).to(device)
    assert route_mismatches(*ops.moe_route(logits, None, 2), logits, None, 2) == []


@pytest.mark.cuda
def test_cuda_side_stream_and_limits():
    """Kernels run on the caller's current stream; shapes beyond the CUDA limits use the reference."""
    gen = torch.Generator().manual_seed(9)
    T, E, K, D = 2048, 384, 8, 256
    logits = torch.randn(T, E, generator=gen).cuda()
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        idx, w = ops.moe_route(logits, None, K)
        x_ND, rows, counts, offsets = ops.moe_permute(x, idx, E)
        out = ops.moe_unpermute(x_ND, rows, w)
    torch.cuda.current_stream().wait_stream(stream)
    assert route_mismatches(idx, w, logits, None, K) == []
    want = reference.moe_unpermute(*reference.moe_permute(x.cpu(), idx.cpu(), E)[:2], w.cpu())
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2**-8, atol=1e-6)
    # top_k = 40 > 32 (CUDA routing limit) and E = 3000 > 2048 (CUDA permute limit)
    logits = torch.randn(16, 3000, generator=gen)
    idx, w = ops.moe_route(logits.cuda(), None, 40)
    assert route_mismatches(idx, w, logits, None, 40) == []
    got = ops.moe_permute(torch.randn(16, 4).cuda(), idx, 3000)
    assert torch.equal(got[2].cpu(), torch.bincount(idx.cpu().flatten(), minlength=3000).int())


@pytest.mark.cuda
def test_selfcheck_cuda():
    """`python -m k2_kernels.selfcheck` (what gpu_check.sh runs under compute-sanitizer) passes."""
    from k2_kernels import selfcheck

    assert selfcheck.check("cuda") == []
