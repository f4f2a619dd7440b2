"""Marshalling torch tensors to the framework-agnostic kernels in `k2_kernels._C`.

The compiled functions take raw pointers (as integers), sizes, row strides, dtype tags and, on
CUDA, a device index and a stream handle. Each `run_*` returns None when no compiled kernel
serves this device/dtype, and the caller falls back to `k2_kernels.reference`.

Shape legend: T tokens, E routed experts, K experts per token, D hidden size, N = T * K rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k2_kernels import _lib


def _backend(t: Tensor) -> str | None:
    """ "cpu" / "cuda" when a compiled kernel serves the tensor's device, else None (and warn once)."""
    if t.device.type == "cpu" and _lib.has_cpu():
        return "cpu"
    if t.device.type == "cuda" and _lib.has_cuda():
        return "cuda"
    if t.device.type in ("cpu", "cuda"):
        _lib.warn_fallback(t.device)
    return None


def _stream(t: Tensor) -> tuple[int, int]:
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return dev, torch.cuda.current_stream(dev).cuda_stream


def _rows(t: Tensor) -> Tensor:
    """A 2-D tensor with contiguous, non-overlapping rows (any row stride), copying only if needed."""
    inner_ok = t.stride(1) == 1 or t.shape[1] <= 1
    rows_ok = t.shape[0] <= 1 or t.stride(0) >= t.shape[1]
    return t if inner_ok and rows_ok else t.contiguous()


def _row_stride(t: Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def run_route(
    logits_TE: Tensor,
    bias_E: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> tuple[Tensor, Tensor] | None:
    backend = _backend(logits_TE)
    # float64 logits are read (as float32, like the reference) by the CPU kernel only.
    ok_dtypes = _lib.FLOAT_TAGS + ((torch.float64,) if backend == "cpu" else ())
    if backend is None or logits_TE.dtype not in ok_dtypes:
        return None
    if bias_E is not None and not bias_E.dtype.is_floating_point:
        return None
    T, E = logits_TE.shape
    C = _lib.compiled()
    if backend == "cuda" and (top_k > C.cuda_route_max_k or E > C.cuda_route_max_e):
        return None
    logits_TE = _rows(logits_TE)
    if bias_E is not None:
        bias_E = bias_E.to(torch.float32).contiguous()  # tiny; the kernels read fp32 bias
    idx_TK = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    weight_TK = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    args = (
        logits_TE.data_ptr(),
        _lib.DTYPE_TAG[logits_TE.dtype],
        _row_stride(logits_TE),
        0 if bias_E is None else bias_E.data_ptr(),
        0 if bias_E is None else _lib.DTYPE_TAG[bias_E.dtype],
        T,
        E,
        top_k,
        n_group,
        topk_group,
        float(routed_scaling_factor),
        bool(norm_topk_prob),
        idx_TK.data_ptr(),
        weight_TK.data_ptr(),
    )
    if backend == "cpu":
        C.moe_route_cpu(*args)
    else:
        C.moe_route_cuda(*_stream(logits_TE), *args)
    return idx_TK, weight_TK


def run_route_backward(
    logits_TE: Tensor,
    topk_idx_TK: Tensor,
    grad_weight_TK: Tensor,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> Tensor | None:
    """d loss / d logits of the routing weights on fp32 CPU tensors (see `ops.route_weight_backward`)."""
    if (
        logits_TE.device.type != "cpu" or logits_TE.dtype != torch.float32 or not _lib.has_cpu()
        or not hasattr(_lib.compiled(), "moe_route_backward_cpu")
    ):  # fmt: skip
        return None
    logits_TE = _rows(logits_TE)
    idx_TK = topk_idx_TK.to(torch.int64).contiguous()
    g_TK = grad_weight_TK.to(torch.float32).contiguous()
    T, E = logits_TE.shape
    grad_TE = torch.empty(T, E, dtype=torch.float32)
    _lib.compiled().moe_route_backward_cpu(
        logits_TE.data_ptr(), _row_stride(logits_TE), idx_TK.data_ptr(), g_TK.data_ptr(), T, E, idx_TK.shape[1],
        float(routed_scaling_factor), bool(norm_topk_prob), grad_TE.data_ptr(),
    )  # fmt: skip
    return grad_TE


def run_permute(
    x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    backend = _backend(x_TD)
    if backend is None or topk_idx_TK.dtype not in _lib.INDEX_DTYPES:
        return None
    T, D = x_TD.shape
    K = topk_idx_TK.shape[1]
    C = _lib.compiled()
    if backend == "cuda" and num_experts > C.cuda_permute_max_e:
        return None
    x_TD = _rows(x_TD)
    topk_idx_TK = topk_idx_TK.contiguous()
    dev = x_TD.device
    x_ND = torch.empty(T * K, D, dtype=x_TD.dtype, device=dev)
    row_to_slot_N = torch.empty(T * K, dtype=torch.int64, device=dev)
    counts_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    offsets_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    args = (
        x_TD.data_ptr(),
        x_TD.element_size(),
        _row_stride(x_TD),
        topk_idx_TK.data_ptr(),
        _lib.DTYPE_TAG[topk_idx_TK.dtype],
        T,
        K,
        D,
        num_experts,
        x_ND.data_ptr(),
        row_to_slot_N.data_ptr(),
        counts_E.data_ptr(),
        offsets_E.data_ptr(),
    )
    if backend == "cpu":
        C.moe_permute_cpu(*args)
    else:
        ws = torch.empty(C.moe_permute_workspace_bytes(T, K, num_experts), dtype=torch.uint8, device=dev)
        C.moe_permute_cuda(*_stream(x_TD), *args, ws.data_ptr())
    return x_ND, row_to_slot_N, counts_E, offsets_E


def run_unpermute(y_ND: Tensor, row_to_slot_N: Tensor, topk_weight_TK: Tensor) -> Tensor | None:
    backend = _backend(y_ND)
    if (
        backend is None
        or y_ND.dtype not in _lib.FLOAT_TAGS
        or topk_weight_TK.dtype not in _lib.FLOAT_TAGS
        or row_to_slot_N.dtype != torch.int64
    ):
        return None
    T, K = topk_weight_TK.shape
    D = y_ND.shape[1]
    C = _lib.compiled()
    if backend == "cuda" and K > C.cuda_unpermute_max_k:
        return None
    y_ND = _rows(y_ND)
    row_to_slot_N = row_to_slot_N.contiguous()
    # The weights are T*K values: read as fp32 (same values as the reference's .float()).
    topk_weight_TK = topk_weight_TK.to(torch.float32).contiguous()
    out_TD = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    args = (
        y_ND.data_ptr(),
        _lib.DTYPE_TAG[y_ND.dtype],
        _row_stride(y_ND),
        row_to_slot_N.data_ptr(),
        topk_weight_TK.data_ptr(),
        _lib.DTYPE_TAG[topk_weight_TK.dtype],
        T,
        K,
        D,
        out_TD.data_ptr(),
    )
    if backend == "cpu":
        C.moe_unpermute_cpu(*args)
    else:
        ws = torch.empty(C.moe_unpermute_workspace_bytes(T, K), dtype=torch.uint8, device=y_ND.device)
        C.moe_unpermute_cuda(*_stream(y_ND), *args, ws.data_ptr())
    return out_TD


def run_unpermute_backward(
    grad_out_TD: Tensor,
    y_ND: Tensor,
    row_to_slot_N: Tensor,
    topk_weight_TK: Tensor,
    need_grad_y: bool,
    need_grad_w: bool,
) -> tuple[Tensor, Tensor] | None:
    """(grad_y_ND or an empty tensor, grad_w_TK fp32 or an empty tensor); None when no kernel serves."""
    backend = _backend(y_ND)
    if (
        backend is None
        or y_ND.dtype not in _lib.FLOAT_TAGS
        or grad_out_TD.dtype != y_ND.dtype
        or topk_weight_TK.dtype not in _lib.FLOAT_TAGS
        or row_to_slot_N.dtype != torch.int64
    ):
        return None
    T, K = topk_weight_TK.shape
    D = y_ND.shape[1]
    dev = y_ND.device
    grad_out_TD, y_ND = _rows(grad_out_TD), _rows(y_ND)
    row_to_slot_N = row_to_slot_N.contiguous()
    topk_weight_TK = topk_weight_TK.to(torch.float32).contiguous()
    grad_y = torch.empty((T * K, D) if need_grad_y else (0,), dtype=y_ND.dtype, device=dev)
    grad_w = torch.zeros((T, K) if need_grad_w else (0,), dtype=torch.float32, device=dev)
    args = (
        grad_out_TD.data_ptr(),
        _row_stride(grad_out_TD),
        y_ND.data_ptr(),
        _lib.DTYPE_TAG[y_ND.dtype],
        _row_stride(y_ND),
        row_to_slot_N.data_ptr(),
        topk_weight_TK.data_ptr(),
        _lib.DTYPE_TAG[torch.float32],
        T,
        K,
        D,
        grad_y.data_ptr() if need_grad_y else 0,
        grad_w.data_ptr() if need_grad_w else 0,
    )
    C = _lib.compiled()
    if backend == "cpu":
        C.moe_unpermute_backward_cpu(*args)
    else:
        C.moe_unpermute_backward_cuda(*_stream(y_ND), *args)
    return grad_y, grad_w
