"""MLA's attention inputs in one op: `torch.ops.k2.mla_rope_pack` (+ `k2::mla_rope_pack_backward`).

`mla_rope_pack(q, kv, k_rope, cos, sin, nope_dim)` takes the projections as the model produces them
(q ``[T, H, P + R]``, kv ``[T, H, P + V]`` = [k_nope | v], the shared rotary key ``[T, R]``, cos/sin
``[T, R/2]``) and returns the contiguous ``q, k [T, H, P + R]`` and ``v [T, H, V]`` that
`k2_kernels.ops.mla_attention` reads, RoPE applied to the interleaved rotary parts (see
`k2_kernels.reference.mla_rope_pack`). fp32 CPU tensors run one C++ pass each way
(`csrc/cpu/rope_pack_cpu.cpp`); PyTorch composed it from ~20 small ops per layer forward and more
backward (zero-filled slice gradients, the expand's sum over heads), ~9 ms of a 300 ms training
step of the tiny model on 2 cores. Other devices and dtypes run the reference composition.

Shape legend: T tokens, H heads, P nope dim, R rotary dim, V value dim.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import torch
from torch import Tensor

from k2_kernels import _lib, reference

__all__ = ["mla_rope_pack"]


def _serves(*ts: Tensor) -> bool:
    C = _lib.compiled()
    return (
        C is not None and hasattr(C, "rope_pack_fwd_cpu")
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)
    )  # fmt: skip


def _check(
    q_THX: Tensor, kv_THY: Tensor, k_rope_TR: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, P: int
) -> None:
    if q_THX.dim() != 3 or kv_THY.dim() != 3 or k_rope_TR.dim() != 2:
        raise ValueError(
            "mla_rope_pack: need q [T, H, P + R], kv [T, H, P + V], k_rope [T, R]; got "
            f"{tuple(q_THX.shape)}, {tuple(kv_THY.shape)}, {tuple(k_rope_TR.shape)}"
        )
    T, H, Dh = q_THX.shape
    R = k_rope_TR.shape[1]
    if kv_THY.shape[:2] != (T, H) or k_rope_TR.shape[0] != T:
        raise ValueError(
            f"mla_rope_pack: kv {tuple(kv_THY.shape)} and k_rope {tuple(k_rope_TR.shape)} must match q's "
            f"[T={T}, H={H}]"
        )
    if R % 2 or Dh != P + R or kv_THY.shape[2] < P:
        raise ValueError(
            f"mla_rope_pack: q's last dim {Dh} must be nope_dim {P} + an even rotary dim R = {R} (k_rope's), "
            f"and kv's last dim ({kv_THY.shape[2]}) at least nope_dim"
        )
    for name, t in (("cos", cos_TR2), ("sin", sin_TR2)):
        if tuple(t.shape) != (T, R // 2):
            raise ValueError(f"mla_rope_pack: {name} must be [T={T}, R/2={R // 2}], got {tuple(t.shape)}")


def _rows(t: Tensor) -> Tensor:
    """Contiguous within each token (any token stride); copies only when not."""
    inner_contiguous = t.stride(-1) == 1 and (t.dim() < 3 or t.stride(1) == t.shape[2])
    return t if inner_contiguous else t.contiguous()


@torch.library.custom_op("k2::mla_rope_pack", mutates_args=())
def _mla_rope_pack(
    q_THX: Tensor, kv_THY: Tensor, k_rope_TR: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, nope_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    _check(q_THX, kv_THY, k_rope_TR, cos_TR2, sin_TR2, nope_dim)
    if not _serves(q_THX, kv_THY, k_rope_TR):
        q, k, v = reference.mla_rope_pack(q_THX, kv_THY, k_rope_TR, cos_TR2, sin_TR2, nope_dim)
        return q.contiguous(), k.contiguous(), v
    T, H, Dh = q_THX.shape
    P, R = nope_dim, k_rope_TR.shape[1]
    V = kv_THY.shape[2] - P
    q, kv, kr = _rows(q_THX), _rows(kv_THY), _rows(k_rope_TR)
    cos, sin = cos_TR2.float().contiguous(), sin_TR2.float().contiguous()
    q_out, k_out = torch.empty(T, H, Dh), torch.empty(T, H, Dh)
    v_out = torch.empty(T, H, V)
    C = _lib.compiled()
    C.set_num_threads(torch.get_num_threads())
    C.rope_pack_fwd_cpu(
        q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), kr.data_ptr(), kr.stride(0), cos.data_ptr(),
        sin.data_ptr(), T, H, P, R, V, q_out.data_ptr(), k_out.data_ptr(), v_out.data_ptr(),
    )  # fmt: skip
    return q_out, k_out, v_out


@_mla_rope_pack.register_fake
def _(q_THX, kv_THY, k_rope_TR, cos_TR2, sin_TR2, nope_dim):
    _check(q_THX, kv_THY, k_rope_TR, cos_TR2, sin_TR2, nope_dim)
    T, H, Dh = q_THX.shape
    V = kv_THY.shape[2] - nope_dim
    return q_THX.new_empty(T, H, Dh), q_THX.new_empty(T, H, Dh), kv_THY.new_empty(T, H, V)


@torch.library.custom_op("k2::mla_rope_pack_backward", mutates_args=())
def _mla_rope_pack_backward(
    dq_THD: Tensor, dk_THD: Tensor, dv_THV: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, nope_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    if not _serves(dq_THD, dk_THD, dv_THV):  # the closed-form reference (no autograd below the dispatcher)
        return reference.mla_rope_pack_backward(dq_THD, dk_THD, dv_THV, cos_TR2, sin_TR2, nope_dim)
    T, H, Dh = dq_THD.shape
    P, V = nope_dim, dv_THV.shape[2]
    R = Dh - P
    dq, dk, dv = dq_THD.contiguous(), dk_THD.contiguous(), dv_THV.contiguous()
    cos, sin = cos_TR2.float().contiguous(), sin_TR2.float().contiguous()
    dq_in, dkv_in, dk_rope = torch.empty(T, H, Dh), torch.empty(T, H, P + V), torch.empty(T, R)
    C = _lib.compiled()
    C.set_num_threads(torch.get_num_threads())
    C.rope_pack_bwd_cpu(
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H, P, R, V,
        dq_in.data_ptr(), dkv_in.data_ptr(), dk_rope.data_ptr(),
    )  # fmt: skip
    return dq_in, dkv_in, dk_rope


@_mla_rope_pack_backward.register_fake
def _(dq_THD, dk_THD, dv_THV, cos_TR2, sin_TR2, nope_dim):
    T, H, Dh = dq_THD.shape
    V = dv_THV.shape[2]
    return (
        dq_THD.new_empty(T, H, Dh),
        dq_THD.new_empty(T, H, nope_dim + V),
        dq_THD.new_empty(T, Dh - nope_dim),
    )


def _setup_context(ctx, inputs, output):
    _q, _kv, _kr, cos_TR2, sin_TR2, nope_dim = inputs
    ctx.save_for_backward(cos_TR2, sin_TR2)
    ctx.nope_dim = nope_dim


def _backward(ctx, dq_THD, dk_THD, dv_THV):
    cos_TR2, sin_TR2 = ctx.saved_tensors
    dq, dkv, dk_rope = torch.ops.k2.mla_rope_pack_backward(
        dq_THD, dk_THD, dv_THV, cos_TR2, sin_TR2, ctx.nope_dim
    )
    g = ctx.needs_input_grad
    return (dq if g[0] else None), (dkv if g[1] else None), (dk_rope if g[2] else None), None, None, None


_mla_rope_pack.register_autograd(_backward, setup_context=_setup_context)


def mla_rope_pack(
    q_THX: Tensor, kv_THY: Tensor, k_rope_TR: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, nope_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) for `mla_attention` from the MLA projections; see the module doc. Differentiable
    w.r.t. q, kv and k_rope (cos and sin are constants)."""
    return _mla_rope_pack(q_THX, kv_THY, k_rope_TR, cos_TR2, sin_TR2, int(nope_dim))
