"""k2_kernels.reference's grouped GEMM and SwiGLU experts agree with torch._grouped_mm and the ops."""

from __future__ import annotations

import torch
from k2_kernels import ops, reference


def test_reference_grouped_mm_matches_torch_and_op():
    g = torch.Generator().manual_seed(0)
    E, D, M = 6, 24, 12  # torch._grouped_mm wants 16-byte row strides
    offsets = torch.tensor([4, 4, 17, 30, 30, 45], dtype=torch.int32)
    x = torch.randn(45, D, generator=g)
    w = torch.randn(E, D, M, generator=g)
    ref = reference.grouped_mm(x, w, offsets)
    torch.testing.assert_close(ref, torch._grouped_mm(x, w, offs=offsets), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.grouped_mm(x, w, offsets), ref, rtol=1e-5, atol=1e-5)


def test_reference_swiglu_experts_matches_op():
    g = torch.Generator().manual_seed(1)
    E, D, I = 5, 16, 12
    offsets = torch.tensor([3, 3, 20, 31, 40], dtype=torch.int32)
    x = torch.randn(40, D, generator=g)
    gate, up = torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g)
    down = torch.randn(E, D, I, generator=g)
    got = ops.moe_swiglu_experts(x, gate, up, down, offsets)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(
        got, reference.moe_swiglu_experts(x, gate, up, down, offsets), rtol=1e-5, atol=1e-5
    )
