"""Fused RMSNorm as a torch op: `torch.ops.k2.rms_norm` (forward) and `k2::rms_norm_backward`.

`rms_norm(x, w, eps)` = `w * (x * rsqrt(mean(x^2, -1) + eps))`, the fp32 form of K2's RMSNorm
(`torch.nn.functional.rms_norm`). fp32 CPU tensors run the C++ kernels (`csrc/cpu/rms_norm_cpu.cpp`):
one pass forward, one fused pass backward for dx and dw. On this CPU torch's composite backward
took 15-30x its forward (elementwise passes plus a column reduction for dw), about 20 ms of a
training step of the tiny model. Anything else runs `F.rms_norm` itself.

Shape legend: N rows (all leading dims), D normalised size.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import torch
import torch.nn.functional as F
from torch import Tensor

from k2_kernels import _lib, reference

__all__ = ["rms_norm"]


def _serves(x: Tensor, w: Tensor) -> bool:
    C = _lib.compiled()
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
        and C is not None and hasattr(C, "rms_norm_fwd_cpu")
    )  # fmt: skip


def _check(x: Tensor, w: Tensor) -> None:
    if x.dim() < 1 or w.dim() != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be [D={x.shape[-1] if x.dim() else '?'}], got {tuple(w.shape)}"
        )


@torch.library.custom_op("k2::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd [N] fp32)."""
    _check(x, w)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if not _serves(x, w):
        xf = x2.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        return F.rms_norm(x, (D,), w, eps), rstd
    x2 = x2.contiguous()
    wc = w.contiguous()
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32)
    C = _lib.compiled()
    C.set_num_threads(torch.get_num_threads())
    C.rms_norm_fwd_cpu(
        x2.data_ptr(), wc.data_ptr(), x2.shape[0], D, float(eps), y.data_ptr(), rstd.data_ptr()
    )
    return y.view(x.shape), rstd


@_rms_norm.register_fake
def _(x, w, eps):
    _check(x, w)
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x), x.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("k2::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, eps: float, need_dx: bool, need_dw: bool
) -> tuple[Tensor, Tensor]:
    D = x.shape[-1]
    if not _serves(x, w):  # the closed-form reference backward (no autograd below the dispatcher)
        # rstd again in x's own precision (the saved one is fp32, too coarse for float64 inputs)
        rstd_x = torch.rsqrt(x.reshape(-1, D).pow(2).mean(-1) + eps)
        dx, dw = reference.rms_norm_backward(g, x, w, rstd_x)
        return (dx if need_dx else x.new_empty(0)), (dw if need_dw else w.new_empty(0))
    g2, x2 = g.reshape(-1, D).contiguous(), x.reshape(-1, D).contiguous()
    wc, rc = w.contiguous(), rstd.contiguous()
    dx = torch.empty_like(x2) if need_dx else x2.new_empty(0)
    dw = torch.empty_like(wc) if need_dw else wc.new_empty(0)
    C = _lib.compiled()
    C.set_num_threads(torch.get_num_threads())
    C.rms_norm_bwd_cpu(
        g2.data_ptr(), x2.data_ptr(), wc.data_ptr(), rc.data_ptr(), x2.shape[0], D,
        dx.data_ptr() if need_dx else 0, dw.data_ptr() if need_dw else 0,
    )  # fmt: skip
    return (dx.view(x.shape) if need_dx else dx), dw


@_rms_norm_backward.register_fake
def _(g, x, w, rstd, eps, need_dx, need_dw):
    return (torch.empty_like(x) if need_dx else x.new_empty(0)), (
        torch.empty_like(w) if need_dw else w.new_empty(0)
    )


def _setup_context(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero tensor for rstd


def _backward(ctx, g, _grstd):
    x, w, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if g is None or not (need_dx or need_dw):
        return None, None, None
    dx, dw = torch.ops.k2.rms_norm_backward(g.contiguous(), x, w, rstd, ctx.eps, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None


_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def _forward_no_grad(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The C++ forward called directly: what the op's forward computes, without the custom-op
    dispatch (a decode step normalises 8 x 256 values ~17 times; dispatch was
    most of each 27 us call)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32)
    C = _lib.compiled()
    C.set_num_threads(torch.get_num_threads())
    C.rms_norm_fwd_cpu(x2.data_ptr(), w.data_ptr(), x2.shape[0], D, eps, y.data_ptr(), rstd.data_ptr())
    return y.view(x.shape)


def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    """``w * (x * rsqrt(mean(x^2, -1) + eps))`` over the last dim; differentiable in x and w.
    Without gradients (inference) fp32 CPU calls go straight to the kernel, same arithmetic."""
    if (
        not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and x.dim() >= 1
        and w.dim() == 1
        and w.shape[0] == x.shape[-1]
        and w.is_contiguous()
        and _serves(x, w)
        and not torch.compiler.is_compiling()
    ):
        return _forward_no_grad(x, w, float(eps))
    return _rms_norm(x, w, float(eps))[0]
