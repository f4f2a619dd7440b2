"""The k2 kernels as torch ops: `torch.ops.k2.moe_route`, `moe_permute`, `moe_unpermute`,
`mla_attention`, `newton_schulz`, `grouped_mm`, `grouped_mm_wgrad` and `moe_swiglu_experts`
(defined in `k2_kernels.attention_ops`, `.newton_schulz_ops` and `.grouped_gemm_ops`, re-exported here).

Each op is a `torch.library.custom_op` with a fake (meta) implementation, so it traces under
`torch.compile`, and autograd where it has a backward. The real implementation dispatches CPU
tensors to the C++ kernel and CUDA tensors to the CUDA kernel in `k2_kernels._C`; when that
module (or its CUDA part) is missing it runs `k2_kernels.reference` and warns once per process.
Semantics are defined by `k2_kernels.reference`. Consumers choosing between an op and torch's own
path ask `preferred(op, device)`; `capabilities()` says what the install can run
(`k2_kernels.dispatch`).

Shape legend: T tokens, E routed experts, K experts per token (top-k), D hidden size,
N = T * K permuted rows.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from k2_kernels import _launch, reference
from k2_kernels.attention_ops import mla_attention
from k2_kernels.decode_ops import mla_decode_paged
from k2_kernels.dispatch import Capabilities, capabilities, preferred
from k2_kernels.grouped_gemm_ops import grouped_mm, grouped_mm_wgrad, moe_swiglu_experts
from k2_kernels.newton_schulz_ops import newton_schulz
from k2_kernels.norm_ops import rms_norm
from k2_kernels.rope_ops import mla_rope_pack

__all__ = [
    "Capabilities", "capabilities", "preferred",
    "grouped_mm", "grouped_mm_wgrad", "mla_attention", "mla_decode_paged", "mla_rope_pack", "rms_norm",
    "moe_swiglu_experts",
    "newton_schulz", "moe_permute", "moe_route", "moe_unpermute", "route_weight_backward",
]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# argument checks (shared by the real and the fake implementations)


def _check_route(logits_TE: Tensor, bias_E: Tensor | None, top_k: int, n_group: int, topk_group: int) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(
            f"moe_route: logits_TE must be 2-D [tokens, experts], got shape {tuple(logits_TE.shape)}"
        )
    if not logits_TE.dtype.is_floating_point:
        raise TypeError(f"moe_route: logits_TE must be floating point, got {logits_TE.dtype}")
    E = logits_TE.shape[1]
    if bias_E is not None and tuple(bias_E.shape) != (E,):
        raise ValueError(f"moe_route: bias_E must have shape ({E},), got {tuple(bias_E.shape)}")
    if bias_E is not None and bias_E.device != logits_TE.device:
        raise ValueError(f"moe_route: bias_E is on {bias_E.device} but logits_TE on {logits_TE.device}")
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, n_experts={E}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"moe_route: n_group={n_group} must be >= 1 and divide n_experts={E}")
    if n_group > 1:
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"moe_route: topk_group={topk_group} must be in [1, n_group={n_group}]")
        if E // n_group < 2:
            raise ValueError(f"moe_route: groups need >= 2 experts (n_experts={E}, n_group={n_group})")


def _check_permute(x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int) -> None:
    if x_TD.dim() != 2:
        raise ValueError(f"moe_permute: x_TD must be 2-D [tokens, hidden], got shape {tuple(x_TD.shape)}")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"moe_permute: topk_idx_TK must be [tokens={x_TD.shape[0]}, top_k], got {tuple(topk_idx_TK.shape)}"
        )
    if topk_idx_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_permute: topk_idx_TK must be int32 or int64, got {topk_idx_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"moe_permute: num_experts={num_experts} must be >= 1")


def _check_unpermute(y_ND: Tensor, row_to_slot_N: Tensor, topk_weight_TK: Tensor) -> None:
    if topk_weight_TK.dim() != 2:
        raise ValueError(
            f"moe_unpermute: topk_weight_TK must be 2-D, got shape {tuple(topk_weight_TK.shape)}"
        )
    N = topk_weight_TK.shape[0] * topk_weight_TK.shape[1]
    if y_ND.dim() != 2 or y_ND.shape[0] != N:
        raise ValueError(f"moe_unpermute: y_ND must be [T*K={N}, hidden], got {tuple(y_ND.shape)}")
    if tuple(row_to_slot_N.shape) != (N,) or row_to_slot_N.dtype != torch.int64:
        raise ValueError(
            f"moe_unpermute: row_to_slot_N must be int64 of shape ({N},), "
            f"got {row_to_slot_N.dtype} {tuple(row_to_slot_N.shape)}"
        )


def _check_index_range(topk_idx_TK: Tensor, num_experts: int) -> None:
    """Range check for the reference path on CPU (the C++ kernel checks on its own)."""
    if topk_idx_TK.numel() and topk_idx_TK.device.type == "cpu":
        lo, hi = int(topk_idx_TK.min()), int(topk_idx_TK.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"moe_permute: expert index out of range [0, {num_experts}): min {lo}, max {hi}")


# ----------------------------------------------------------------------------------------------
# moe_route


@torch.library.custom_op("k2::moe_route", mutates_args=())
def _moe_route(
    logits_TE: Tensor,
    bias_E: Optional[Tensor],  # noqa: UP045 - typing.Optional: the schema inference of older torch
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> tuple[Tensor, Tensor]:
    _check_route(logits_TE, bias_E, top_k, n_group, topk_group)
    out = _launch.run_route(
        logits_TE, bias_E, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob
    )
    if out is None:
        out = reference.moe_route(
            logits_TE, bias_E, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob
        )
    return out


@_moe_route.register_fake
def _(logits_TE, bias_E, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob):
    _check_route(logits_TE, bias_E, top_k, n_group, topk_group)
    T = logits_TE.shape[0]
    return (
        logits_TE.new_empty(T, top_k, dtype=torch.int64),
        logits_TE.new_empty(T, top_k, dtype=torch.float32),
    )


def route_weight_backward(
    logits_TE: Tensor,
    topk_idx_TK: Tensor,
    grad_weight_TK: Tensor,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> Tensor:
    """d loss / d logits for the routing weights (the indices are piecewise constant).

    With s = sigmoid(logits) at the chosen experts, S = sum_k s_k + 1e-20 and
    w_k = c * s_k / S (or c * s_k without normalisation), c = routed_scaling_factor:
    dL/ds_j = c * (g_j - sum_k g_k w_k / c) / S, and dL/dlogit_j = dL/ds_j * s_j * (1 - s_j)
    at the chosen experts, zero elsewhere. Computed in float32 (float64 stays float64).
    """
    cdt = torch.float64 if logits_TE.dtype == torch.float64 else torch.float32
    s_TK = logits_TE.to(cdt).gather(1, topk_idx_TK).sigmoid()
    g_TK = grad_weight_TK.to(cdt)
    c = routed_scaling_factor
    if norm_topk_prob:
        denom_T1 = s_TK.sum(-1, keepdim=True) + 1e-20
        # sum_k g_k * s_k / S: the normaliser's share of every chosen expert's gradient.
        dot_T1 = (g_TK * s_TK).sum(-1, keepdim=True) / denom_T1
        gs_TK = c * (g_TK - dot_T1) / denom_T1
    else:
        gs_TK = c * g_TK
    gl_TK = gs_TK * s_TK * (1 - s_TK)
    grad_TE = torch.zeros(logits_TE.shape, dtype=cdt, device=logits_TE.device)
    grad_TE.scatter_(1, topk_idx_TK, gl_TK)
    return grad_TE.to(logits_TE.dtype)


@torch.library.custom_op("k2::moe_route_backward", mutates_args=())
def _moe_route_backward(
    logits_TE: Tensor,
    topk_idx_TK: Tensor,
    grad_weight_TK: Tensor,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> Tensor:
    """`route_weight_backward` as an op: one C++ pass on fp32 CPU (the composition above was a dozen
    small ops, ~0.6 ms per MoE layer at 1024 tokens); the composition elsewhere."""
    out = _launch.run_route_backward(
        logits_TE, topk_idx_TK, grad_weight_TK, routed_scaling_factor, norm_topk_prob
    )
    if out is None:
        out = route_weight_backward(
            logits_TE, topk_idx_TK, grad_weight_TK, routed_scaling_factor, norm_topk_prob
        )
    return out


@_moe_route_backward.register_fake
def _(logits_TE, topk_idx_TK, grad_weight_TK, routed_scaling_factor, norm_topk_prob):
    return torch.empty_like(logits_TE)


def _route_setup_context(ctx, inputs, output):
    logits_TE, _bias, _k, _g, _tg, routed_scaling_factor, norm_topk_prob = inputs
    ctx.save_for_backward(logits_TE, output[0])
    ctx.routed_scaling_factor = routed_scaling_factor
    ctx.norm_topk_prob = norm_topk_prob
    ctx.set_materialize_grads(False)  # the indices get no gradient tensor


def _route_backward(ctx, grad_idx, grad_weight_TK):
    logits_TE, idx_TK = ctx.saved_tensors
    grad_logits = None
    if grad_weight_TK is not None and ctx.needs_input_grad[0]:
        grad_logits = torch.ops.k2.moe_route_backward(
            logits_TE, idx_TK, grad_weight_TK, ctx.routed_scaling_factor, ctx.norm_topk_prob
        )
    # The selection bias only moves the choice (piecewise constant): no gradient.
    return grad_logits, None, None, None, None, None, None


_moe_route.register_autograd(_route_backward, setup_context=_route_setup_context)


def moe_route(
    logits_TE: Tensor,
    bias_E: Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 / K2 router: see `k2_kernels.reference.moe_route`.

    Returns ``(topk_idx_TK int64, topk_weight_TK float32)``, experts by descending biased score.
    The weights are differentiable w.r.t. ``logits_TE``.
    """
    return _moe_route(
        logits_TE,
        bias_E,
        int(top_k),
        int(n_group),
        int(topk_group),
        float(routed_scaling_factor),
        bool(norm_topk_prob),
    )


# ----------------------------------------------------------------------------------------------
# moe_permute


@torch.library.custom_op("k2::moe_permute", mutates_args=())
def _moe_permute(
    x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_permute(x_TD, topk_idx_TK, num_experts)
    out = _launch.run_permute(x_TD, topk_idx_TK, num_experts)
    if out is None:
        _check_index_range(topk_idx_TK, num_experts)
        x_ND, row_to_slot_N, counts_E, offsets_E = reference.moe_permute(x_TD, topk_idx_TK, num_experts)
        out = (x_ND, row_to_slot_N.to(torch.int64), counts_E, offsets_E)
    return out


@_moe_permute.register_fake
def _(x_TD, topk_idx_TK, num_experts):
    _check_permute(x_TD, topk_idx_TK, num_experts)
    N = x_TD.shape[0] * topk_idx_TK.shape[1]
    return (
        x_TD.new_empty(N, x_TD.shape[1]),
        x_TD.new_empty(N, dtype=torch.int64),
        x_TD.new_empty(num_experts, dtype=torch.int32),
        x_TD.new_empty(num_experts, dtype=torch.int32),
    )


def _permute_setup_context(ctx, inputs, output):
    x_TD, topk_idx_TK, _E = inputs
    ctx.save_for_backward(output[1])
    ctx.T, ctx.K = topk_idx_TK.shape
    ctx.x_dtype = x_TD.dtype
    ctx.set_materialize_grads(False)  # nor do the index outputs


def _permute_backward(ctx, grad_x_ND, _g_rows, _g_counts, _g_offsets):
    (row_to_slot_N,) = ctx.saved_tensors
    if grad_x_ND is None:
        return None, None, None
    # Each token's gradient is the sum over its K copies: an unpermute with unit weights.
    ones_TK = grad_x_ND.new_ones(ctx.T, ctx.K, dtype=torch.float32)
    grad_x_TD = torch.ops.k2.moe_unpermute(grad_x_ND, row_to_slot_N, ones_TK)
    return grad_x_TD.to(ctx.x_dtype), None, None


_moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup_context)


def moe_permute(x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group token copies by expert: see `k2_kernels.reference.moe_permute`.

    Returns ``(x_ND, row_to_slot_N int64, counts_E int32, offsets_E int32)``; ``offsets_E`` is
    the ``offs`` argument of ``torch._grouped_mm``. Differentiable w.r.t. ``x_TD``.
    """
    return _moe_permute(x_TD, topk_idx_TK, int(num_experts))


# ----------------------------------------------------------------------------------------------
# moe_unpermute


@torch.library.custom_op("k2::moe_unpermute", mutates_args=())
def _moe_unpermute(y_ND: Tensor, row_to_slot_N: Tensor, topk_weight_TK: Tensor) -> Tensor:
    _check_unpermute(y_ND, row_to_slot_N, topk_weight_TK)
    out = _launch.run_unpermute(y_ND, row_to_slot_N, topk_weight_TK)
    if out is None:
        out = reference.moe_unpermute(y_ND, row_to_slot_N, topk_weight_TK)
    return out


@_moe_unpermute.register_fake
def _(y_ND, row_to_slot_N, topk_weight_TK):
    _check_unpermute(y_ND, row_to_slot_N, topk_weight_TK)
    return y_ND.new_empty(topk_weight_TK.shape[0], y_ND.shape[1])


def _unpermute_setup_context(ctx, inputs, output):
    y_ND, row_to_slot_N, topk_weight_TK = inputs
    ctx.save_for_backward(y_ND, row_to_slot_N, topk_weight_TK)


@torch.library.custom_op("k2::moe_unpermute_backward", mutates_args=())
def _moe_unpermute_backward(
    grad_out_TD: Tensor,
    y_ND: Tensor,
    row_to_slot_N: Tensor,
    topk_weight_TK: Tensor,
    need_grad_y: bool,
    need_grad_w: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_y_ND, grad_w_TK); an output not asked for is an empty tensor.

    Row i came from (t, k) = divmod(row_to_slot_N[i], K): its gradient is w[t, k] * g[t], and
    w[t, k] gets <g[t], y[i]>, accumulated in fp32 like the forward.
    """
    out = _launch.run_unpermute_backward(
        grad_out_TD, y_ND, row_to_slot_N, topk_weight_TK, need_grad_y, need_grad_w
    )
    if out is not None:
        grad_y, grad_w = out
        return grad_y, grad_w.to(topk_weight_TK.dtype)
    T, K = topk_weight_TK.shape
    g_ND = grad_out_TD.float().index_select(0, row_to_slot_N // K)
    grad_y = y_ND.new_empty(0)
    grad_w = topk_weight_TK.new_empty(0)
    if need_grad_y:
        w_N = topk_weight_TK.reshape(-1).float().index_select(0, row_to_slot_N)
        grad_y = (g_ND * w_N.unsqueeze(1)).to(y_ND.dtype)
    if need_grad_w:
        gw_N = (g_ND * y_ND.float()).sum(1)
        grad_w = torch.zeros(T * K, dtype=torch.float32, device=y_ND.device)
        grad_w.index_copy_(0, row_to_slot_N, gw_N)
        grad_w = grad_w.view(T, K).to(topk_weight_TK.dtype)
    return grad_y, grad_w


@_moe_unpermute_backward.register_fake
def _(grad_out_TD, y_ND, row_to_slot_N, topk_weight_TK, need_grad_y, need_grad_w):
    return (
        y_ND.new_empty(tuple(y_ND.shape) if need_grad_y else (0,)),
        topk_weight_TK.new_empty(tuple(topk_weight_TK.shape) if need_grad_w else (0,)),
    )


def _unpermute_backward(ctx, grad_out_TD):
    y_ND, row_to_slot_N, topk_weight_TK = ctx.saved_tensors
    if grad_out_TD is None:
        return None, None, None
    need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_y, grad_w = torch.ops.k2.moe_unpermute_backward(
        grad_out_TD.to(y_ND.dtype), y_ND, row_to_slot_N, topk_weight_TK, need_y, need_w
    )
    return (grad_y if need_y else None), None, (grad_w if need_w else None)


_moe_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


def moe_unpermute(y_ND: Tensor, row_to_slot_N: Tensor, topk_weight_TK: Tensor) -> Tensor:
    """Weighted scatter back: see `k2_kernels.reference.moe_unpermute` (fp32 accumulation).

    Differentiable w.r.t. ``y_ND`` and ``topk_weight_TK``.
    """
    return _moe_unpermute(y_ND, row_to_slot_N, topk_weight_TK)


def op_names() -> Sequence[str]:
    """The registered op names (for opcheck and docs)."""
    return (
        "k2::moe_route", "k2::moe_route_backward", "k2::moe_permute", "k2::moe_unpermute", "k2::moe_unpermute_backward",
        "k2::mla_attention", "k2::mla_attention_backward", "k2::newton_schulz",
        "k2::grouped_mm", "k2::grouped_mm_wgrad", "k2::moe_swiglu_experts", "k2::moe_swiglu_experts_backward",
        "k2::rms_norm", "k2::rms_norm_backward", "k2::mla_rope_pack", "k2::mla_rope_pack_backward",
        "k2::mla_decode_paged", "k2::moe_swiglu_experts_bf16w",
    )  # fmt: skip
