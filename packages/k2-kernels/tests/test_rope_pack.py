"""k2::mla_rope_pack (MLA's RoPE + q/k/v packing) against the PyTorch composition it replaces:
forward bit-identical in fp32 (same products and sums, no contraction), gradients against autograd
through the composition in float64 (relative Frobenius error <= 1e-6), the closed-form fallback
backward gradchecked in float64, strided inputs (k_rope as a column slice of the kv_a projection),
1-3 threads, opcheck, bf16 through the reference, and bad shapes named."""

import pytest
import torch
from k2_kernels import _lib, reference
from k2_kernels.rope_ops import mla_rope_pack
from torch.library import opcheck

KERNEL = _lib.compiled() is not None and hasattr(_lib.compiled(), "rope_pack_fwd_cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(T=45, H=3, P=16, R=8, V=12, C=20, dtype=torch.float32, seed=0):
    """q and kv as views of projection outputs, k_rope as the last R columns of [T, C + R]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H * (P + R), generator=g).to(dtype).view(T, H, P + R)
    kv = torch.randn(T, H * (P + V), generator=g).to(dtype).view(T, H, P + V)
    k_rope = torch.randn(T, C + R, generator=g).to(dtype)[:, C:]
    pos = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(R // 2, generator=g)
    return q, kv, k_rope, pos.cos() * 1.3, pos.sin() * 1.3, P


@pytest.mark.skipif(not KERNEL, reason="k2_kernels._C without the rope-pack kernel")
def test_forward_is_bit_identical_to_the_composition(threads):
    args = inputs()
    for ours, ref in zip(mla_rope_pack(*args), reference.mla_rope_pack(*args)):
        assert ours.is_contiguous() and torch.equal(ours, ref)


@pytest.mark.parametrize("shape", [dict(), dict(T=1, H=1), dict(T=70, H=4, P=128, R=64, V=128)], ids=str)
def test_gradients_match_autograd_through_the_composition(shape, threads):
    q, kv, kr, cos, sin, P = inputs(**shape, seed=1)
    g = torch.Generator().manual_seed(2)
    outs_shape = [o.shape for o in reference.mla_rope_pack(q, kv, kr, cos, sin, P)]
    douts = [torch.randn(s, generator=g) for s in outs_shape]
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, kr)]
    torch.autograd.backward(mla_rope_pack(*leaves, cos, sin, P), douts)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, kv, kr)]
    ref = reference.mla_rope_pack(*leaves64, cos.double(), sin.double(), P)
    torch.autograd.backward(ref, [d.double() for d in douts])
    for ours, theirs in zip(leaves, leaves64):
        assert rel_err(ours.grad, theirs.grad) <= 1e-6


def test_fallback_backward_gradchecks_in_float64():
    q, kv, kr, cos, sin, P = inputs(T=6, H=2, P=3, R=4, V=2, C=3, dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, kr)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: mla_rope_pack(a, b, c, cos.double(), sin.double(), P), leaves
    )


def test_bf16_runs_the_reference():
    args = inputs(dtype=torch.bfloat16)
    for ours, ref in zip(mla_rope_pack(*args), reference.mla_rope_pack(*args)):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref.contiguous())


def test_opcheck():
    q, kv, kr, cos, sin, P = inputs(T=9, H=2)
    opcheck(torch.ops.k2.mla_rope_pack.default, (q, kv, kr.contiguous(), cos, sin, P))
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, kr.contiguous())]
    opcheck(torch.ops.k2.mla_rope_pack.default, (*leaves, cos, sin, P))


def test_bad_shapes_are_named():
    q, kv, kr, cos, sin, P = inputs()
    with pytest.raises(ValueError, match="even rotary dim"):
        mla_rope_pack(q, kv, kr, cos, sin, P + 1)
    with pytest.raises(ValueError, match="cos must be"):
        mla_rope_pack(q, kv, kr, cos[:-1], sin, P)
    with pytest.raises(ValueError, match="must match q"):
        mla_rope_pack(q, kv[:-1], kr, cos, sin, P)
