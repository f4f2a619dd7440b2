"""Grouped (per-expert) GEMM as a torch op: `torch.ops.k2.grouped_mm`.

`grouped_mm(x_NK, w_EKM, offsets_E)` has the semantics of `torch._grouped_mm(x_NK, w_EKM,
offs=offsets_E)` for a 2-D x and a 3-D w: the rows of x are grouped by expert, expert e owning
rows [offsets_E[e-1], offsets_E[e]) (int32 inclusive cumulative counts, as `moe_permute` returns
them), and those rows of the output are x's rows @ w_EKM[e]. Rows after offsets_E[-1] belong to
no expert: the kernel writes 0 there (torch leaves them unset). w may be contiguous or a
transposed view of [E, M, K] (nn.Linear's layout, as the model stores its experts).

fp32 CPU tensors run the compiled kernel (`csrc/cpu/grouped_gemm_cpu.cpp`: one single-threaded
OpenBLAS sgemm per expert, experts in parallel over `torch.get_num_threads()` threads, large experts
split across threads), which is faster than torch's CPU `_grouped_mm` (a loop of small multi-threaded
`mm`s). Anything else (other dtypes, CUDA) runs `torch._grouped_mm` itself. The op has a fake
implementation and autograd: dx = dy @ w[e]^T through the same op, and dw[e] = x_e^T @ dy_e through
`torch.ops.k2.grouped_mm_wgrad`, written directly in w's layout.

Shape legend: E experts, N grouped rows, K inner size, M output columns.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import torch
import torch.nn.functional as F
from torch import Tensor

from k2_kernels import _launch, _lib

__all__ = ["grouped_mm", "grouped_mm_wgrad", "kernel_available", "moe_swiglu_experts", "op_names"]


def _check(x_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> None:
    if x_NK.dim() != 2:
        raise ValueError(f"grouped_mm: x_NK must be 2-D [rows, in], got shape {tuple(x_NK.shape)}")
    if w_EKM.dim() != 3:
        raise ValueError(f"grouped_mm: w_EKM must be 3-D [experts, in, out], got shape {tuple(w_EKM.shape)}")
    if x_NK.shape[1] != w_EKM.shape[1]:
        raise ValueError(
            f"grouped_mm: x_NK has {x_NK.shape[1]} columns but w_EKM has in-size {w_EKM.shape[1]} "
            f"(shapes {tuple(x_NK.shape)} and {tuple(w_EKM.shape)})"
        )
    if x_NK.dtype != w_EKM.dtype:
        raise TypeError(f"grouped_mm: x_NK is {x_NK.dtype} but w_EKM is {w_EKM.dtype}")
    _check_offsets(offsets_E, w_EKM.shape[0], x_NK)
    if w_EKM.device != x_NK.device:
        raise ValueError(f"grouped_mm: w_EKM is on {w_EKM.device} but x_NK on {x_NK.device}")


def _check_offsets(offsets_E: Tensor, E: int | None, x_NK: Tensor) -> None:
    """offsets_E: 1-D int32 (of length E when given) on x's device."""
    if offsets_E.dim() != 1 or (E is not None and offsets_E.shape[0] != E) or offsets_E.dtype != torch.int32:
        want = f"({E},)" if E is not None else "(experts,)"
        raise ValueError(
            f"grouped_mm: offsets_E must be int32 of shape {want}, got {offsets_E.dtype} {tuple(offsets_E.shape)}"
        )
    if offsets_E.device != x_NK.device:
        raise ValueError(f"grouped_mm: offsets_E is on {offsets_E.device} but x_NK on {x_NK.device}")


def kernel_available() -> bool:
    """True when the compiled CPU grouped GEMM is built (fp32 CPU calls then run it)."""
    C = _lib.compiled()
    return C is not None and hasattr(C, "grouped_mm_cpu")


def _kernel(t: Tensor):
    """The compiled module when its CPU grouped GEMM serves this fp32 CPU tensor, else None."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    C = _lib.compiled()
    if C is None or not hasattr(C, "grouped_mm_cpu"):
        _lib.warn_fallback(t.device)
        return None
    return C


def _weight_layout(w_EKM: Tensor) -> tuple[Tensor, int, int, int]:
    """(w, stride_e, stride_k, stride_m) with a unit stride in k or m and a valid BLAS row stride."""
    _E, K, M = w_EKM.shape
    se, sk, sm = w_EKM.stride()
    if sm == 1 and (K <= 1 or sk >= M):
        return w_EKM, se, max(sk, M, 1), 1
    if sk == 1 and (M <= 1 or sm >= K):
        return w_EKM, se, 1, max(sm, K, 1)
    w_EKM = w_EKM.contiguous()
    return w_EKM, w_EKM.stride(0), max(M, 1), 1


# ----------------------------------------------------------------------------------------------
# grouped_mm


@torch.library.custom_op("k2::grouped_mm", mutates_args=())
def _grouped_mm(x_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> Tensor:
    _check(x_NK, w_EKM, offsets_E)
    C = _kernel(x_NK)
    if C is None:
        return torch._grouped_mm(x_NK, w_EKM, offs=offsets_E)
    E, K, M = w_EKM.shape
    N = x_NK.shape[0]
    x_NK = _launch._rows(x_NK)
    w_EKM, se, sk, sm = _weight_layout(w_EKM)
    offsets_E = offsets_E.contiguous()
    y_NM = torch.empty(N, M, dtype=x_NK.dtype)
    C.grouped_mm_cpu(
        x_NK.data_ptr(), _launch._row_stride(x_NK) if N else K, w_EKM.data_ptr(), se, sk, sm,
        offsets_E.data_ptr(), E, N, K, M, y_NM.data_ptr(), max(M, 1), torch.get_num_threads(),
    )  # fmt: skip
    return y_NM


@_grouped_mm.register_fake
def _(x_NK, w_EKM, offsets_E):
    _check(x_NK, w_EKM, offsets_E)
    return x_NK.new_empty(x_NK.shape[0], w_EKM.shape[2])


def _w_is_transposed(w_EKM: Tensor) -> bool:
    """True when w is a transposed view of [E, M, K] (its gradient is then produced in that layout)."""
    return w_EKM.stride(-2) == 1 and w_EKM.stride(-1) != 1 and w_EKM.shape[-2] > 1


def _grouped_mm_setup_context(ctx, inputs, output):
    x_NK, w_EKM, offsets_E = inputs
    ctx.save_for_backward(x_NK, w_EKM, offsets_E)


def _grouped_mm_backward(ctx, dy_NM):
    x_NK, w_EKM, offsets_E = ctx.saved_tensors
    dx = dw = None
    if dy_NM is None:
        return None, None, None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.k2.grouped_mm(dy_NM, w_EKM.transpose(-2, -1), offsets_E)
    if ctx.needs_input_grad[1]:
        # Written in w's own layout: a parameter stored [E, M, K] and used transposed gets a
        # contiguous gradient (no copy in AccumulateGrad).
        trans = _w_is_transposed(w_EKM)
        dw = torch.ops.k2.grouped_mm_wgrad(x_NK, dy_NM, offsets_E, trans)
        if trans:
            dw = dw.transpose(-2, -1)
    return dx, dw, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)


def grouped_mm(x_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> Tensor:
    """``torch._grouped_mm(x_NK, w_EKM, offs=offsets_E)`` for 2-D x, 3-D w (see the module doc).

    Returns ``y_NM``; differentiable w.r.t. ``x_NK`` and ``w_EKM``.
    """
    return _grouped_mm(x_NK, w_EKM, offsets_E)


# ----------------------------------------------------------------------------------------------
# grouped_mm_wgrad


@torch.library.custom_op("k2::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(x_NK: Tensor, dy_NM: Tensor, offsets_E: Tensor, trans_out: bool) -> Tensor:
    """dw[e] = x_e^T @ dy_e, [E, K, M] (``trans_out``: [E, M, K], each block transposed); 0 for empty experts."""
    _check_wgrad(x_NK, dy_NM, offsets_E)
    E, (N, K), M = offsets_E.shape[0], x_NK.shape, dy_NM.shape[1]
    C = _kernel(x_NK)
    if C is None:
        dw_EKM = torch._grouped_mm(x_NK.t(), dy_NM, offs=offsets_E)
        return dw_EKM.transpose(-2, -1).contiguous() if trans_out else dw_EKM
    x_NK, dy_NM = _launch._rows(x_NK), _launch._rows(dy_NM)
    offsets_E = offsets_E.contiguous()
    dw = torch.empty((E, M, K) if trans_out else (E, K, M), dtype=x_NK.dtype)
    C.grouped_mm_wgrad_cpu(
        x_NK.data_ptr(), _launch._row_stride(x_NK) if N else K, dy_NM.data_ptr(),
        _launch._row_stride(dy_NM) if N else M, offsets_E.data_ptr(), E, N, K, M, bool(trans_out),
        dw.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return dw


def _check_wgrad(x_NK: Tensor, dy_NM: Tensor, offsets_E: Tensor) -> None:
    if x_NK.dim() != 2 or dy_NM.dim() != 2 or x_NK.shape[0] != dy_NM.shape[0]:
        raise ValueError(
            f"grouped_mm_wgrad: x_NK and dy_NM must be 2-D with the same rows, got {tuple(x_NK.shape)} "
            f"and {tuple(dy_NM.shape)}"
        )
    if x_NK.dtype != dy_NM.dtype:
        raise TypeError(f"grouped_mm_wgrad: x_NK is {x_NK.dtype} but dy_NM is {dy_NM.dtype}")
    _check_offsets(offsets_E, None, x_NK)


@_grouped_mm_wgrad.register_fake
def _(x_NK, dy_NM, offsets_E, trans_out):
    _check_wgrad(x_NK, dy_NM, offsets_E)
    E, K, M = offsets_E.shape[0], x_NK.shape[1], dy_NM.shape[1]
    return x_NK.new_empty((E, M, K) if trans_out else (E, K, M))


def grouped_mm_wgrad(x_NK: Tensor, dy_NM: Tensor, offsets_E: Tensor, trans_out: bool = False) -> Tensor:
    """Per-expert ``x_e^T @ dy_e``: ``torch._grouped_mm(x_NK.t(), dy_NM, offs=offsets_E)``
    ([E, K, M]; with ``trans_out`` its per-expert transpose, [E, M, K], contiguous)."""
    return _grouped_mm_wgrad(x_NK, dy_NM, offsets_E, bool(trans_out))


# ----------------------------------------------------------------------------------------------
# fused SwiGLU experts: y = grouped_mm(silu(x Wg^T) * (x Wu^T), Wd^T) in one kernel per direction
#
# Legend: D hidden, I expert intermediate size. Weights in nn.Linear's layout, as the model stores
# them: gate_EID and up_EID [E, I, D], down_EDI [E, D, I].


def _check_swiglu(
    x_ND: Tensor, gate_EID: Tensor, up_EID: Tensor, down_EDI: Tensor, offsets_E: Tensor
) -> None:
    if x_ND.dim() != 2:
        raise ValueError(
            f"moe_swiglu_experts: x_ND must be 2-D [rows, hidden], got shape {tuple(x_ND.shape)}"
        )
    if gate_EID.dim() != 3 or gate_EID.shape[2] != x_ND.shape[1]:
        raise ValueError(
            f"moe_swiglu_experts: gate_EID must be [experts, inter, hidden={x_ND.shape[1]}], "
            f"got {tuple(gate_EID.shape)}"
        )
    E, I, D = gate_EID.shape
    if tuple(up_EID.shape) != (E, I, D):
        raise ValueError(
            f"moe_swiglu_experts: up_EID must have gate_EID's shape {(E, I, D)}, got {tuple(up_EID.shape)}"
        )
    if tuple(down_EDI.shape) != (E, D, I):
        raise ValueError(
            f"moe_swiglu_experts: down_EDI must have shape {(E, D, I)}, got {tuple(down_EDI.shape)}"
        )
    for name, t in (("gate_EID", gate_EID), ("up_EID", up_EID), ("down_EDI", down_EDI)):
        if t.dtype != x_ND.dtype or t.device != x_ND.device:
            raise TypeError(
                f"moe_swiglu_experts: {name} is {t.dtype} on {t.device} but x_ND is {x_ND.dtype} on {x_ND.device}"
            )
    _check_offsets(offsets_E, E, x_ND)


def _linear_layout(w: Tensor) -> tuple[Tensor, int, int]:
    """(w, expert stride, row stride) with contiguous rows (each expert a row-major matrix)."""
    _E, R, C = w.shape
    if (w.stride(2) == 1 or C <= 1) and (R <= 1 or w.stride(1) >= C):
        return w, w.stride(0), max(w.stride(1), C, 1)
    w = w.contiguous()
    return w, w.stride(0), max(C, 1)


def _swiglu_serves(x_ND: Tensor) -> bool:
    """True when the compiled kernel runs these (fp32 CPU) inputs; says once when it is missing."""
    return _kernel(x_ND) is not None


def _swiglu_torch(
    x_ND, gate_EID, up_EID, down_EDI, offsets_E, with_gate_up=True
) -> tuple[Tensor, Tensor | None]:
    """The composition the kernel fuses, through torch._grouped_mm: (y_ND, [gate | up]_N2I or None)."""
    g_NI = torch._grouped_mm(x_ND, gate_EID.transpose(-2, -1), offs=offsets_E)
    u_NI = torch._grouped_mm(x_ND, up_EID.transpose(-2, -1), offs=offsets_E)
    y_ND = torch._grouped_mm(F.silu(g_NI) * u_NI, down_EDI.transpose(-2, -1), offs=offsets_E)
    return y_ND, (torch.cat([g_NI, u_NI], 1) if with_gate_up else None)


@torch.library.custom_op("k2::moe_swiglu_experts", mutates_args=())
def _moe_swiglu_experts(
    x_ND: Tensor, gate_EID: Tensor, up_EID: Tensor, down_EDI: Tensor, offsets_E: Tensor
) -> tuple[Tensor, Tensor]:
    """(y_ND, gate_up_N2I): the expert MLP and its pre-activations [x Wg^T | x Wu^T] (kept for the backward)."""
    _check_swiglu(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    if not _swiglu_serves(x_ND):
        return _swiglu_torch(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    (N, D), (E, I, _D) = x_ND.shape, gate_EID.shape
    x_ND = _launch._rows(x_ND)
    wg, wu, wd = _linear_layout(gate_EID), _linear_layout(up_EID), _linear_layout(down_EDI)
    gate_up_N2I = torch.empty(N, 2 * I, dtype=x_ND.dtype)
    y_ND = torch.empty(N, D, dtype=x_ND.dtype)
    _lib.compiled().moe_swiglu_experts_cpu(
        x_ND.data_ptr(), _launch._row_stride(x_ND) if N else D,
        wg[0].data_ptr(), wg[1], wg[2], wu[0].data_ptr(), wu[1], wu[2], wd[0].data_ptr(), wd[1], wd[2],
        offsets_E.contiguous().data_ptr(), E, N, D, I, gate_up_N2I.data_ptr(), y_ND.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y_ND, gate_up_N2I


@_moe_swiglu_experts.register_fake
def _(x_ND, gate_EID, up_EID, down_EDI, offsets_E):
    _check_swiglu(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    N, D, I = x_ND.shape[0], x_ND.shape[1], gate_EID.shape[1]
    return x_ND.new_empty(N, D), x_ND.new_empty(N, 2 * I)


@torch.library.custom_op("k2::moe_swiglu_experts_backward", mutates_args=())
def _moe_swiglu_experts_backward(
    dy_ND: Tensor,
    x_ND: Tensor,
    gate_up_N2I: Tensor,
    gate_EID: Tensor,
    up_EID: Tensor,
    down_EDI: Tensor,
    offsets_E: Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx_ND, d gate_EID, d up_EID, d down_EDI); outputs not asked for are empty tensors."""
    (N, D), (E, I, _D) = x_ND.shape, gate_EID.shape

    def empty() -> Tensor:  # one per output: outputs may not alias each other
        return x_ND.new_empty(0)

    if not _swiglu_serves(x_ND):
        dy_ND, x_ND = dy_ND.contiguous(), x_ND.contiguous()  # torch._grouped_mm wants 16-byte strides
        g_NI, u_NI = gate_up_N2I[:, :I], gate_up_N2I[:, I:]
        s_NI = torch.sigmoid(g_NI)
        silu_NI = g_NI * s_NI
        dh_NI = torch._grouped_mm(dy_ND, down_EDI, offs=offsets_E)
        dg_NI = dh_NI * u_NI * s_NI * (1 + g_NI * (1 - s_NI))
        du_NI = dh_NI * silu_NI
        dx, dwg, dwu, dwd = empty(), empty(), empty(), empty()
        if need_dx:
            dx = torch._grouped_mm(dg_NI, gate_EID, offs=offsets_E) + torch._grouped_mm(
                du_NI, up_EID, offs=offsets_E
            )
        if need_dw:
            dwd = torch._grouped_mm(dy_ND.t(), (silu_NI * u_NI).contiguous(), offs=offsets_E)
            dwg = torch._grouped_mm(dg_NI.t(), x_ND, offs=offsets_E)
            dwu = torch._grouped_mm(du_NI.t(), x_ND, offs=offsets_E)
        return dx, dwg, dwu, dwd
    dy_ND, x_ND = _launch._rows(dy_ND), _launch._rows(x_ND)
    gate_up_N2I = gate_up_N2I.contiguous()
    wg, wu, wd = _linear_layout(gate_EID), _linear_layout(up_EID), _linear_layout(down_EDI)
    dx = torch.empty(N, D, dtype=x_ND.dtype) if need_dx else empty()
    dwg, dwu, dwd = (
        (torch.empty(E, I, D), torch.empty(E, I, D), torch.empty(E, D, I))
        if need_dw
        else (empty(), empty(), empty())
    )
    h_NI = torch.empty(N, I, dtype=x_ND.dtype)
    dgu_N2I = torch.empty(N, 2 * I, dtype=x_ND.dtype)
    _lib.compiled().moe_swiglu_experts_backward_cpu(
        dy_ND.data_ptr(), _launch._row_stride(dy_ND) if N else D, x_ND.data_ptr(),
        _launch._row_stride(x_ND) if N else D, gate_up_N2I.data_ptr(),
        wg[0].data_ptr(), wg[1], wg[2], wu[0].data_ptr(), wu[1], wu[2], wd[0].data_ptr(), wd[1], wd[2],
        offsets_E.contiguous().data_ptr(), E, N, D, I, dx.data_ptr() if need_dx else 0,
        dwg.data_ptr() if need_dw else 0, dwu.data_ptr() if need_dw else 0, dwd.data_ptr() if need_dw else 0,
        h_NI.data_ptr(), dgu_N2I.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return dx, dwg, dwu, dwd


@_moe_swiglu_experts_backward.register_fake
def _(dy_ND, x_ND, gate_up_N2I, gate_EID, up_EID, down_EDI, offsets_E, need_dx, need_dw):
    return (
        x_ND.new_empty(x_ND.shape if need_dx else (0,)),
        gate_EID.new_empty(gate_EID.shape if need_dw else (0,)),
        up_EID.new_empty(up_EID.shape if need_dw else (0,)),
        down_EDI.new_empty(down_EDI.shape if need_dw else (0,)),
    )


def _swiglu_setup_context(ctx, inputs, output):
    x_ND, gate_EID, up_EID, down_EDI, offsets_E = inputs
    ctx.save_for_backward(x_ND, output[1], gate_EID, up_EID, down_EDI, offsets_E)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # else autograd fills an [N, 2I] zero gradient for gate_up


def _swiglu_backward(ctx, dy_ND, _d_gate_up):
    x_ND, gate_up_N2I, gate_EID, up_EID, down_EDI, offsets_E = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:4])
    if dy_ND is None or not (need_dx or need_dw):
        return None, None, None, None, None
    dx, dwg, dwu, dwd = torch.ops.k2.moe_swiglu_experts_backward(
        dy_ND, x_ND, gate_up_N2I, gate_EID, up_EID, down_EDI, offsets_E, need_dx, need_dw
    )
    g = ctx.needs_input_grad
    return (
        (dx if g[0] else None),
        (dwg if g[1] else None),
        (dwu if g[2] else None),
        (dwd if g[3] else None),
        None,
    )


_moe_swiglu_experts.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


def _bf16w_serves(x_ND: Tensor, weights: tuple[Tensor, ...]) -> bool:
    """True when the compiled bf16-weight forward runs these bf16 CPU inputs and no gradient is wanted
    (it has no backward: training in bf16 keeps the differentiable torch composition)."""
    if x_ND.device.type != "cpu" or x_ND.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_ND, *weights)):
        return False
    C = _lib.compiled()
    return C is not None and hasattr(C, "moe_swiglu_experts_bf16w_cpu")


@torch.library.custom_op("k2::moe_swiglu_experts_bf16w", mutates_args=())
def _moe_swiglu_experts_bf16w(
    x_ND: Tensor, gate_EID: Tensor, up_EID: Tensor, down_EDI: Tensor, offsets_E: Tensor
) -> Tensor:
    """y_ND (bf16) of the expert MLP with bf16 weights, accumulated in fp32 (inference only)."""
    _check_swiglu(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    (N, D), (E, I, _D) = x_ND.shape, gate_EID.shape
    x32_ND = x_ND.float()  # a decode step's few rows: widened once here, read by every expert
    wg, wu, wd = _linear_layout(gate_EID), _linear_layout(up_EID), _linear_layout(down_EDI)
    gate_up_N2I = torch.empty(N, 2 * I, dtype=torch.float32)
    y_ND = torch.empty(N, D, dtype=torch.float32)
    _lib.compiled().moe_swiglu_experts_bf16w_cpu(
        x32_ND.data_ptr(), D,
        wg[0].data_ptr(), wg[1], wg[2], wu[0].data_ptr(), wu[1], wu[2], wd[0].data_ptr(), wd[1], wd[2],
        offsets_E.contiguous().data_ptr(), E, N, D, I, gate_up_N2I.data_ptr(), y_ND.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y_ND.to(torch.bfloat16)


@_moe_swiglu_experts_bf16w.register_fake
def _(x_ND, gate_EID, up_EID, down_EDI, offsets_E):
    _check_swiglu(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    return x_ND.new_empty(x_ND.shape[0], x_ND.shape[1])


def moe_swiglu_experts(
    x_ND: Tensor, gate_EID: Tensor, up_EID: Tensor, down_EDI: Tensor, offsets_E: Tensor
) -> Tensor:
    """The routed experts' SwiGLU MLP over rows grouped by expert, fused per expert:
    ``grouped_mm(silu(grouped_mm(x, gate^T)) * grouped_mm(x, up^T), down^T)`` with nn.Linear-layout
    weights (gate/up ``[E, I, D]``, down ``[E, D, I]``). Differentiable w.r.t. x and the weights.

    fp32 CPU tensors run one kernel per direction (the three GEMMs and the activation of an expert
    while its rows are in cache; the backward writes all weight gradients in their own layouts);
    bf16 CPU tensors without gradients (serving in bf16) run a forward kernel that reads the bf16
    weights and accumulates in fp32; anything else runs the same composition through
    ``torch._grouped_mm``.
    """
    if _bf16w_serves(x_ND, (gate_EID, up_EID, down_EDI)):
        return _moe_swiglu_experts_bf16w(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
    if not _swiglu_serves(x_ND):
        _check_swiglu(x_ND, gate_EID, up_EID, down_EDI, offsets_E)
        return _swiglu_torch(x_ND, gate_EID, up_EID, down_EDI, offsets_E, with_gate_up=False)[0]
    return _moe_swiglu_experts(x_ND, gate_EID, up_EID, down_EDI, offsets_E)[0]


def op_names() -> tuple[str, ...]:
    """The registered op names (for opcheck and docs)."""
    return (
        "k2::grouped_mm",
        "k2::grouped_mm_wgrad",
        "k2::moe_swiglu_experts",
        "k2::moe_swiglu_experts_backward",
        "k2::moe_swiglu_experts_bf16w",
    )
