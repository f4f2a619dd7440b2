"""`mla_decode_paged` (MLA decode over the paged latent cache, read in place) against the reference
(gather each sequence's blocks, padded, then softmax attention) and against plain attention over
each sequence's rows.

Tolerances: fp32 cache, relative Frobenius error <= 1e-5; bf16 cache (rows converted to fp32 in the
kernel, the reference converts the same bf16 values) <= 1e-5 too, since both read identical values.
"""

from __future__ import annotations

import pytest
import torch
from k2_kernels import ops, reference
from k2_kernels.decode_ops import decode_kernel_serves


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def make(n=5, H=3, C=40, R=8, B=4, Nb=128, lens=(1, 4, 5, 17, 33), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = C + R
    cache = torch.randn(Nb, B, K, generator=g).to(dtype)
    perm = torch.randperm(Nb, generator=g)
    M = max(-(-L // B) for L in lens) + 1  # one spare table entry, as padded tables have
    table = perm[: n * M].view(n, M).clone()
    q = torch.randn(n, H, K, generator=g)
    return q, cache, table, torch.tensor(lens, dtype=torch.long), C


def plain(q, cache, table, lens, C, scale):
    """Attention over each sequence's rows, one sequence at a time."""
    B = cache.shape[1]
    out = []
    for i in range(q.shape[0]):
        L = int(lens[i])
        rows = torch.stack([cache[table[i, j // B], j % B] for j in range(L)]).float()
        p = torch.softmax(scale * q[i].float() @ rows.T, dim=-1)
        out.append(p @ rows[:, :C])
    return torch.stack(out)


@pytest.mark.parametrize("H", [3, 20], ids=["tiles", "gemm"])  # >= 16 heads: BLAS GEMMs where attached
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference_and_plain_attention(dtype, H):
    assert decode_kernel_serves("cpu"), "the compiled module has no mla_decode_paged_cpu"
    q, cache, table, lens, C = make(dtype=dtype, H=H)
    scale = 0.125
    got = ops.mla_decode_paged(q, cache, table, lens, C, scale)
    ref = reference.mla_decode_paged(q, cache, table, lens, C, scale)
    assert got.shape == (5, H, C) and got.dtype == torch.float32
    assert rel(got, ref) < 1e-5
    assert rel(got, plain(q, cache, table, lens, C, scale)) < 1e-5


def test_large_scores_and_one_thread_or_two_give_the_same_numbers():
    q, cache, table, lens, C = make(n=9, H=4, lens=(3, 8, 1, 30, 31, 32, 2, 16, 9))
    want = plain(q * 30, cache, table, lens, C, 1.0)  # sharp softmax: the online rescaling matters
    for threads in (1, 2):
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = ops.mla_decode_paged(q * 30, cache, table, lens, C, 1.0)
        finally:
            torch.set_num_threads(n)
        assert rel(got, want) < 1e-5


def test_bad_input_is_refused_by_name():
    q, cache, table, lens, C = make()
    with pytest.raises(ValueError, match="int64"):
        ops.mla_decode_paged(q, cache, table.int(), lens, C, 1.0)
    with pytest.raises(ValueError, match="length"):
        ops.mla_decode_paged(q, cache, table, torch.tensor([1, 4, 5, 17, 999]), C, 1.0)
    bad = table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="block 10000"):
        ops.mla_decode_paged(q, cache, bad, lens, C, 1.0)
    with pytest.raises(ValueError, match="C=99"):
        ops.mla_decode_paged(q, cache, table, lens, 99, 1.0)


def test_opcheck():
    q, cache, table, lens, C = make()
    torch.library.opcheck(torch.ops.k2.mla_decode_paged.default, (q, cache, table, lens, C, 0.5))
