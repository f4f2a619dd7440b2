"""Fused attention with per-head max logit as a torch op: `torch.ops.k2.mla_attention`.

QK-Clip needs every head's largest pre-softmax logit at every training step. A fused kernel's
online softmax already tracks each row's running maximum, so the kernels return it next to the
output and the log-sum-exp (saved for the backward), without materialising the [L, L] scores.

CPU tensors run the C++ (OpenMP + BLAS block products) kernel in fp32 (bf16 inputs are converted:
this project computes in fp32 on CPU); CUDA tensors run the sm_90a kernels for the head dims they
were built for. Anything else runs `k2_kernels.reference.mla_attention` (warned once per process).

Shape legend: T packed tokens, H heads, B sequences, Dk query/key head dim, Dv value head dim.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import functools
import math

import torch
from torch import Tensor

from k2_kernels import _lib, reference
from k2_kernels._launch import _backend, _stream

__all__ = ["kernel_serves", "mla_attention"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _check(q_THD: Tensor, k_THD: Tensor, v_THV: Tensor, cu_seqlens_B1: Tensor) -> None:
    for name, t in (("q", q_THD), ("k", k_THD), ("v", v_THV)):
        if t.dim() != 3:
            raise ValueError(
                f"mla_attention: {name} must be 3-D [tokens, heads, head_dim], got {tuple(t.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"mla_attention: {name} must be floating point, got {t.dtype}")
    if q_THD.shape != k_THD.shape:
        raise ValueError(
            f"mla_attention: q {tuple(q_THD.shape)} and k {tuple(k_THD.shape)} must have one shape"
        )
    if v_THV.shape[:2] != q_THD.shape[:2]:
        raise ValueError(
            f"mla_attention: v {tuple(v_THV.shape)} must match q {tuple(q_THD.shape)} in tokens and heads"
        )
    if not (q_THD.dtype == k_THD.dtype == v_THV.dtype):
        raise TypeError(f"mla_attention: q, k, v dtypes differ: {q_THD.dtype}, {k_THD.dtype}, {v_THV.dtype}")
    if not (q_THD.device == k_THD.device == v_THV.device == cu_seqlens_B1.device):
        raise ValueError("mla_attention: q, k, v and cu_seqlens must be on one device")
    if (
        cu_seqlens_B1.dim() != 1
        or cu_seqlens_B1.numel() < 1
        or cu_seqlens_B1.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"mla_attention: cu_seqlens must be a 1-D int32/int64 tensor [B + 1], got "
            f"{cu_seqlens_B1.dtype} {tuple(cu_seqlens_B1.shape)}"
        )


@functools.cache
def _cuda_head_dims() -> frozenset[tuple[int, int]]:
    return frozenset(tuple(p) for p in getattr(_lib.compiled(), "cuda_attention_head_dims", ()))


def kernel_serves(device: torch.device | str, Dk: int, Dv: int) -> bool:
    """Whether a compiled attention kernel runs for this device and these head dims (fp32/bf16)."""
    device = torch.device(device)
    C = _lib.compiled()
    if device.type == "cpu":
        return _lib.has_cpu() and hasattr(C, "mla_attention_fwd_cpu")
    if device.type == "cuda":
        return _lib.has_cuda() and hasattr(C, "mla_attention_fwd_cuda") and (Dk, Dv) in _cuda_head_dims()
    return False


def _use_kernel(t: Tensor, Dk: int, Dv: int) -> str | None:
    if t.dtype not in _KERNEL_DTYPES:
        return None
    backend = _backend(t)  # warns once when the compiled module lacks this device
    return backend if backend is not None and kernel_serves(t.device, Dk, Dv) else None


def _as_kernel_input(t: Tensor, backend: str) -> Tensor:
    # the CPU kernel computes in fp32 (no native bf16 GEMM to rely on); CUDA takes fp32 or bf16
    return (t.float() if backend == "cpu" else t).contiguous()


# The CPU forward can keep the softmax probabilities for sequences up to this long (one key block per
# query block), so that the backward reuses them instead of recomputing q k^T and the exponentials:
# the backward's QK^T product is ~23% of its FLOPs (measured at B = 4, S = 256, H = 4: backward
# 7.4 -> 5.8 ms per layer). The cost is H * T * max_seqlen fp32 (4 MB per layer there), which is
# why longer sequences keep memory linear in S instead.
PROBS_MAX_SEQLEN = 256


def _keeps_probs(q_THD: Tensor, k_THD: Tensor, v_THV: Tensor, max_seqlen: int) -> bool:
    """Whether a differentiable CPU-kernel call keeps its probabilities for the backward."""
    return (
        torch.is_grad_enabled() and any(t.requires_grad for t in (q_THD, k_THD, v_THV))
        and q_THD.device.type == "cpu" and q_THD.dtype in _KERNEL_DTYPES and max_seqlen <= PROBS_MAX_SEQLEN
        and kernel_serves(q_THD.device, q_THD.shape[-1], v_THV.shape[-1])
    )  # fmt: skip


@torch.library.custom_op("k2::mla_attention", mutates_args=())
def _mla_attention(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THV: Tensor,
    cu_seqlens_B1: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
    keep_probs: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, max_logit, probs): probs [H, T, max_seqlen] when keep_probs (CPU kernel only), else
    an empty tensor."""
    _check(q_THD, k_THD, v_THV, cu_seqlens_B1)
    T, H, Dk = q_THD.shape
    Dv = v_THV.shape[-1]
    backend = _use_kernel(q_THD, Dk, Dv)
    if keep_probs and (backend != "cpu" or max_seqlen > PROBS_MAX_SEQLEN):
        raise ValueError(
            f"mla_attention: keep_probs needs the CPU kernel and max_seqlen <= {PROBS_MAX_SEQLEN} "
            f"(got {q_THD.device.type}, max_seqlen {max_seqlen})"
        )
    if backend is None:
        with torch.no_grad():
            out = reference.mla_attention(q_THD, k_THD, v_THV, cu_seqlens_B1, softmax_scale, causal)
        return (*out, q_THD.new_empty(0, dtype=torch.float32))
    q, k, v = (_as_kernel_input(t, backend) for t in (q_THD, k_THD, v_THV))
    cu = cu_seqlens_B1.to(torch.int32).contiguous()
    dev = q.device
    out = torch.empty(T, H, Dv, dtype=q.dtype, device=dev)
    lse_HT = torch.empty(H, T, dtype=torch.float32, device=dev)
    max_logit_H = torch.empty(H, dtype=torch.float32, device=dev)
    probs_HTL = torch.empty((H, T, max_seqlen) if keep_probs else (0,), dtype=torch.float32, device=dev)
    args = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _lib.DTYPE_TAG[q.dtype], cu.data_ptr(), T, H, cu.numel() - 1,
        Dk, Dv, int(max_seqlen), float(softmax_scale), bool(causal), out.data_ptr(), lse_HT.data_ptr(),
        max_logit_H.data_ptr(),
    )  # fmt: skip
    C = _lib.compiled()
    if backend == "cpu":
        C.set_num_threads(torch.get_num_threads())  # torch.set_num_threads governs the kernel too
        C.mla_attention_fwd_cpu(*args, probs_HTL.data_ptr() if keep_probs else 0, int(max_seqlen))
    else:
        C.mla_attention_fwd_cuda(*_stream(q), *args)
    return out.to(q_THD.dtype), lse_HT, max_logit_H, probs_HTL


@_mla_attention.register_fake
def _(q_THD, k_THD, v_THV, cu_seqlens_B1, max_seqlen, softmax_scale, causal, keep_probs):
    _check(q_THD, k_THD, v_THV, cu_seqlens_B1)
    T, H, _ = q_THD.shape
    return (
        v_THV.new_empty(T, H, v_THV.shape[-1]),
        q_THD.new_empty(H, T, dtype=torch.float32),
        q_THD.new_empty(H, dtype=torch.float32),
        q_THD.new_empty((H, T, max_seqlen) if keep_probs else (0,), dtype=torch.float32),
    )


@torch.library.custom_op("k2::mla_attention_backward", mutates_args=())
def _mla_attention_backward(
    dout_THV: Tensor,
    q_THD: Tensor,
    k_THD: Tensor,
    v_THV: Tensor,
    out_THV: Tensor,
    lse_HT: Tensor,
    cu_seqlens_B1: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
    probs_HTL: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv); probs_HTL: the forward's kept probabilities (CPU kernel), or empty to recompute."""
    T, H, Dk = q_THD.shape
    Dv = v_THV.shape[-1]
    backend = _use_kernel(q_THD, Dk, Dv)
    if backend is None:  # the closed-form reference backward (no autograd below the dispatcher)
        return reference.mla_attention_backward(
            dout_THV, q_THD, k_THD, v_THV, out_THV, lse_HT, cu_seqlens_B1, softmax_scale, causal
        )
    q, k, v, out, dout = (_as_kernel_input(t, backend) for t in (q_THD, k_THD, v_THV, out_THV, dout_THV))
    cu = cu_seqlens_B1.to(torch.int32).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), _lib.DTYPE_TAG[q.dtype],
        lse_HT.contiguous().data_ptr(), cu.data_ptr(), T, H, cu.numel() - 1, Dk, Dv, int(max_seqlen),
        float(softmax_scale), bool(causal), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
    )  # fmt: skip
    C = _lib.compiled()
    if backend == "cpu":
        keep = probs_HTL.numel() > 0
        if keep and tuple(probs_HTL.shape) != (H, T, max_seqlen):
            raise ValueError(
                f"mla_attention_backward: probs must be [H, T, max_seqlen], got {tuple(probs_HTL.shape)}"
            )
        C.set_num_threads(torch.get_num_threads())
        C.mla_attention_bwd_cpu(*args, probs_HTL.contiguous().data_ptr() if keep else 0, int(max_seqlen))
    else:
        ws = torch.empty(C.mla_attention_bwd_workspace_bytes(T, H, Dk), dtype=torch.uint8, device=q.device)
        C.mla_attention_bwd_cuda(*_stream(q), *args, ws.data_ptr())
    return dq.to(q_THD.dtype), dk.to(k_THD.dtype), dv.to(v_THV.dtype)


@_mla_attention_backward.register_fake
def _(
    dout_THV,
    q_THD,
    k_THD,
    v_THV,
    out_THV,
    lse_HT,
    cu_seqlens_B1,
    max_seqlen,
    softmax_scale,
    causal,
    probs_HTL,
):
    return torch.empty_like(q_THD), torch.empty_like(k_THD), torch.empty_like(v_THV)


def _setup_context(ctx, inputs, output):
    q_THD, k_THD, v_THV, cu_seqlens_B1, max_seqlen, softmax_scale, causal, _keep = inputs
    out_THV, lse_HT, max_logit_H, probs_HTL = output
    ctx.save_for_backward(q_THD, k_THD, v_THV, out_THV, lse_HT, cu_seqlens_B1, probs_HTL)
    ctx.max_seqlen, ctx.softmax_scale, ctx.causal = max_seqlen, softmax_scale, causal
    ctx.mark_non_differentiable(lse_HT, max_logit_H, probs_HTL)
    ctx.set_materialize_grads(False)  # no zero tensors for the non-differentiable outputs


def _backward(ctx, dout_THV, _dlse, _dmax, _dprobs):
    q_THD, k_THD, v_THV, out_THV, lse_HT, cu_seqlens_B1, probs_HTL = ctx.saved_tensors
    if dout_THV is None:
        return None, None, None, None, None, None, None, None
    dq, dk, dv = torch.ops.k2.mla_attention_backward(
        dout_THV.contiguous(), q_THD, k_THD, v_THV, out_THV, lse_HT, cu_seqlens_B1, ctx.max_seqlen,
        ctx.softmax_scale, ctx.causal, probs_HTL,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None


_mla_attention.register_autograd(_backward, setup_context=_setup_context)


def mla_attention(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THV: Tensor,
    cu_seqlens_B1: Tensor | None = None,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused attention over packed sequences that also returns each head's max logit.

    q/k ``[T, H, Dk]``, v ``[T, H, Dv]`` with sequences back to back; ``cu_seqlens_B1`` (int32 on
    q's device, ``[B + 1]``, starting at 0 and ending at T) marks where each starts (None: one
    sequence). ``max_seqlen``: the longest sequence (computed when None, a device sync on GPU).
    The CPU kernel checks ``cu_seqlens`` and ``max_seqlen``; the CUDA kernels cannot (no sync), and
    a ``max_seqlen`` smaller than a sequence would leave its last rows unwritten there.
    ``softmax_scale`` defaults to ``Dk ** -0.5``; MLA passes its YaRN-adjusted scale.

    Returns ``(out [T, H, Dv], lse [H, T] fp32, max_logit [H] fp32)``: the output (differentiable
    in q, k, v), each query's log-sum-exp and each head's largest logit ``scale * q.k`` over
    every pair allowed to attend (the QK-Clip signal; -inf for a head with no tokens). See
    `k2_kernels.reference.mla_attention` for the exact semantics.
    """
    T = q_THD.shape[0]
    if cu_seqlens_B1 is None:
        cu_seqlens_B1 = torch.tensor([0, T], dtype=torch.int32, device=q_THD.device)
        max_seqlen = T if max_seqlen is None else max_seqlen
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens_B1[1:] - cu_seqlens_B1[:-1]).max()) if cu_seqlens_B1.numel() > 1 else 0
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q_THD.shape[-1])
    keep = _keeps_probs(q_THD, k_THD, v_THV, int(max_seqlen))
    out, lse, max_logit, _probs = _mla_attention(
        q_THD, k_THD, v_THV, cu_seqlens_B1, int(max_seqlen), float(softmax_scale), bool(causal), keep
    )
    return out, lse, max_logit
