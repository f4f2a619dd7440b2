"""Plain PyTorch ground truth for every k2 kernel.

These functions define what each op computes. Tests compare the compiled kernels against them,
and `k2_kernels.ops` falls back to them when the compiled module is missing.

Shape legend: T tokens, E routed experts, K experts per token (top-k), D hidden size,
G expert groups, N = T * K permuted rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def moe_route(
    logits_TE: Tensor,
    bias_E: Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 / Kimi K2 router (``topk_method="noaux_tc"``).

    scores = sigmoid(logits); the selection uses scores + bias (the aux-loss-free balancing
    bias); with ``n_group > 1`` only the ``topk_group`` groups with the largest sum of their two
    best biased scores are eligible. The weights come from the *unbiased* scores of the chosen
    experts, optionally normalised to sum to one, then multiplied by ``routed_scaling_factor``.

    Returns ``(topk_idx_TK int64, topk_weight_TK float32)``, experts sorted by descending
    biased score.
    """
    T, E = logits_TE.shape
    scores_TE = logits_TE.float().sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if n_group > 1:
        if E % n_group:
            raise ValueError(f"n_routed_experts={E} is not divisible by n_group={n_group}")
        group_scores_TG = choice_TE.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        group_idx = group_scores_TG.topk(topk_group, dim=-1, sorted=False).indices
        group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1.0)
        score_mask_TE = group_mask_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        # Same masking value as the DeepSeek-V3 reference implementation.
        choice_TE = choice_TE.masked_fill(score_mask_TE == 0, 0.0)
    topk_idx_TK = choice_TE.topk(top_k, dim=-1, sorted=True).indices
    topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
    if norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx_TK, topk_weight_TK * routed_scaling_factor


def moe_permute(x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group token copies by expert.

    Returns ``(x_ND, row_to_slot_N, counts_E, offsets_E)``: ``x_ND[i] = x_TD[row_to_slot_N[i] // K]``
    with rows ordered by expert (stable: by token, then slot, within an expert);
    ``row_to_slot_N[i]`` is the flat index ``t * K + k`` of the (token, slot) pair that row i came
    from; ``counts_E`` the rows per expert (int32) and ``offsets_E`` their cumulative sums (int32),
    the ``offs`` argument of ``torch._grouped_mm``.
    """
    K = topk_idx_TK.shape[1]
    flat_N = topk_idx_TK.reshape(-1)
    row_to_slot_N = torch.argsort(flat_N, stable=True)
    x_ND = x_TD.index_select(0, row_to_slot_N // K)
    counts_E = torch.bincount(flat_N, minlength=num_experts).to(torch.int32)
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return x_ND, row_to_slot_N, counts_E, offsets_E


def moe_unpermute(y_ND: Tensor, row_to_slot_N: Tensor, topk_weight_TK: Tensor) -> Tensor:
    """Weighted scatter back: ``out[t] = sum_k weight[t, k] * y_ND[row of (t, k)]``.

    Accumulates in fp32 and returns ``y_ND``'s dtype.
    """
    T, K = topk_weight_TK.shape
    w_N = topk_weight_TK.reshape(-1).float().index_select(0, row_to_slot_N)
    out_TD = torch.zeros(T, y_ND.shape[1], dtype=torch.float32, device=y_ND.device)
    out_TD.index_add_(0, row_to_slot_N // K, y_ND.float() * w_N.unsqueeze(1))
    return out_TD.to(y_ND.dtype)


def mla_attention(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THV: Tensor,
    cu_seqlens_B1: Tensor | None,
    softmax_scale: float,
    causal: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention over packed sequences with materialised scores; the ground truth of the fused kernels.

    q/k [T, H, Dk], v [T, H, Dv]: sequences back to back, sequence b = tokens
    [cu_seqlens[b], cu_seqlens[b+1]) (None: one sequence). Queries attend only inside their
    sequence (and, when causal, to keys at or before them). Logits are `softmax_scale * q . k`.

    Returns (out [T, H, Dv] in q's dtype, lse [H, T] fp32 = logsumexp of each query's logits,
    max_logit [H] fp32 = each head's largest logit over all allowed pairs, -inf if none). Computes
    in `compute_dtype` (default float32, float64 for float64 inputs); differentiable through out.
    """
    T, H, _ = q_THD.shape
    cdt = compute_dtype or (torch.float64 if q_THD.dtype == torch.float64 else torch.float32)
    bounds = [0, T] if cu_seqlens_B1 is None else [int(x) for x in cu_seqlens_B1.tolist()]
    outs, lses = [], []
    max_logit_H = torch.full((H,), -math.inf, dtype=torch.float32, device=q_THD.device)
    for s0, s1 in zip(bounds[:-1], bounds[1:], strict=True):
        if s1 == s0:
            continue
        q_HLD = q_THD[s0:s1].to(cdt).transpose(0, 1)
        k_HLD = k_THD[s0:s1].to(cdt).transpose(0, 1)
        v_HLV = v_THV[s0:s1].to(cdt).transpose(0, 1)
        s_HLL = torch.matmul(q_HLD, k_HLD.transpose(-1, -2)) * softmax_scale
        if causal:
            L = s1 - s0
            future = torch.ones(L, L, dtype=torch.bool, device=q_THD.device).triu(1)
            s_HLL = s_HLL.masked_fill(future, -math.inf)
        max_logit_H = torch.maximum(max_logit_H, s_HLL.detach().amax(dim=(1, 2)).float())
        lses.append(torch.logsumexp(s_HLL.detach().float(), dim=-1))
        p_HLL = torch.softmax(s_HLL, dim=-1)
        outs.append(torch.matmul(p_HLL, v_HLV).transpose(0, 1))
    Dv = v_THV.shape[-1]
    out_THV = torch.cat(outs) if outs else q_THD.new_zeros(0, H, Dv, dtype=cdt)
    lse_HT = torch.cat(lses, dim=1) if lses else q_THD.new_zeros(H, 0, dtype=torch.float32)
    return out_THV.to(q_THD.dtype), lse_HT, max_logit_H


def mla_attention_backward(
    dout_THV: Tensor,
    q_THD: Tensor,
    k_THD: Tensor,
    v_THV: Tensor,
    out_THV: Tensor,
    lse_HT: Tensor,
    cu_seqlens_B1: Tensor | None,
    softmax_scale: float,
    causal: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `mla_attention` from the saved output and LSE, in closed form (no
    autograd): P = exp(scale q.k - lse), dv = P^T dout, dS = P * (dout v^T - rowsum(dout * out)),
    dq = scale dS k, dk = scale dS^T q. Computes in float32 (float64 for float64 inputs)."""
    T, H, _ = q_THD.shape
    cdt = torch.float64 if q_THD.dtype == torch.float64 else torch.float32
    bounds = [0, T] if cu_seqlens_B1 is None else [int(x) for x in cu_seqlens_B1.tolist()]
    dq, dk, dv = (torch.zeros(t.shape, dtype=cdt, device=t.device) for t in (q_THD, k_THD, v_THV))
    for s0, s1 in zip(bounds[:-1], bounds[1:], strict=True):
        if s1 == s0:
            continue
        q, k, v, o, g = (t[s0:s1].to(cdt).transpose(0, 1) for t in (q_THD, k_THD, v_THV, out_THV, dout_THV))
        s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
        if causal:
            L = s1 - s0
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), -math.inf)
        p = torch.exp(s - lse_HT[:, s0:s1].to(cdt).unsqueeze(-1))
        dv[s0:s1] = torch.matmul(p.transpose(-1, -2), g).transpose(0, 1)
        ds = p * (torch.matmul(g, v.transpose(-1, -2)) - (g * o).sum(-1, keepdim=True))
        dq[s0:s1] = (torch.matmul(ds, k) * softmax_scale).transpose(0, 1)
        dk[s0:s1] = (torch.matmul(ds.transpose(-1, -2), q) * softmax_scale).transpose(0, 1)
    return dq.to(q_THD.dtype), dk.to(k_THD.dtype), dv.to(v_THV.dtype)


def grouped_mm(x_NK: Tensor, w_EKM: Tensor, offsets_E: Tensor) -> Tensor:
    """Per-expert product: rows [offsets[e-1], offsets[e]) of x times w_EKM[e] (torch._grouped_mm's
    semantics; rows after offsets[-1] belong to no expert and come out 0 here)."""
    out = x_NK.new_zeros(x_NK.shape[0], w_EKM.shape[-1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        out[start:end] = x_NK[start:end] @ w_EKM[e]
        start = end
    return out


def moe_swiglu_experts(
    x_ND: Tensor, gate_EID: Tensor, up_EID: Tensor, down_EDI: Tensor, offsets_E: Tensor
) -> Tensor:
    """The routed experts' SwiGLU MLP on expert-grouped rows: down(silu(gate x) * up x) per expert,
    weights in nn.Linear's layout ([E, out, in])."""
    h_NI = torch.nn.functional.silu(grouped_mm(x_ND, gate_EID.transpose(-2, -1), offsets_E))
    h_NI = h_NI * grouped_mm(x_ND, up_EID.transpose(-2, -1), offsets_E)
    return grouped_mm(h_NI, down_EDI.transpose(-2, -1), offsets_E)


def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim, as K2's fp32 layers compute it: w * (x * rsqrt(mean(x^2) + eps))."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_backward(g: Tensor, x: Tensor, w: Tensor, rstd_N: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw) of `rms_norm` in closed form from the saved per-row rstd:
    dx = rstd * (g w - xhat * mean(g w xhat)), dw = sum over rows of g * xhat, xhat = x * rstd."""
    D = x.shape[-1]
    x2, g2 = x.reshape(-1, D), g.reshape(-1, D)
    r = rstd_N.to(x.dtype).unsqueeze(-1)
    xhat, gw = x2 * r, g2 * w
    dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return dx.view(x.shape), (g2 * xhat).sum(0)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on interleaved pairs of the last dim ([..., R]; cos/sin broadcast to [..., R/2]),
    written as [rotated evens | rotated odds] (the layout K2 / DeepSeek-V3 checkpoints imply)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_interleaved_backward(d: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Gradient of `rope_interleaved` w.r.t. x: pairs (a, b) of d's halves -> (a c + b s, b c - a s)."""
    R2 = d.shape[-1] // 2
    a, b = d[..., :R2], d[..., R2:]
    return torch.stack((a * cos + b * sin, b * cos - a * sin), dim=-1).flatten(-2)


def mla_rope_pack(
    q_THX: Tensor, kv_THY: Tensor, k_rope_TR: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, nope_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """MLA's attention inputs: q [T, H, P + R] with RoPE on its last R dims; k [T, H, P + R] =
    [k_nope | RoPE(k_rope) shared by every head] from kv [T, H, P + V] and k_rope [T, R]; v [T, H, V].
    cos/sin [T, R/2] are cast to the inputs' dtype first."""
    P = nope_dim
    T, H = q_THX.shape[:2]
    R = k_rope_TR.shape[-1]
    cos, sin = cos_TR2.to(q_THX.dtype), sin_TR2.to(q_THX.dtype)
    q = torch.cat((q_THX[..., :P], rope_interleaved(q_THX[..., P:], cos[:, None], sin[:, None])), dim=-1)
    k_rope = rope_interleaved(k_rope_TR, cos, sin)[:, None].expand(T, H, R)
    k = torch.cat((kv_THY[..., :P], k_rope), dim=-1)
    return q, k, kv_THY[..., P:].contiguous()


def mla_rope_pack_backward(
    dq_THD: Tensor, dk_THD: Tensor, dv_THV: Tensor, cos_TR2: Tensor, sin_TR2: Tensor, nope_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(d q, d kv, d k_rope) of `mla_rope_pack` in closed form (k_rope's gradient summed over heads)."""
    P = nope_dim
    cos, sin = cos_TR2.to(dq_THD.dtype), sin_TR2.to(dq_THD.dtype)
    dq = torch.cat(
        (dq_THD[..., :P], rope_interleaved_backward(dq_THD[..., P:], cos[:, None], sin[:, None])), -1
    )
    dkv = torch.cat((dk_THD[..., :P], dv_THV), dim=-1)
    dk_rope = rope_interleaved_backward(dk_THD[..., P:].sum(1), cos, sin)
    return dq, dkv, dk_rope


def mla_decode_paged(
    q_nHK: Tensor, cache_NbBK: Tensor, table_nM: Tensor, lens_n: Tensor, C: int, scale: float
) -> Tensor:
    """MLA decode attention over a paged latent cache (absorbed form), fp32 [n, H, C].

    Row j < lens[i] of sequence i is `cache[table[i, j // B], j % B]` ([K] = latent C + rope R);
    `out[i, h] = sum_j softmax_j(scale * q[i, h] . row_j) * row_j[:C]`."""
    n, M = table_nM.shape
    B, K = cache_NbBK.shape[1], cache_NbBK.shape[2]
    rows_nLK = cache_NbBK.index_select(0, table_nM.reshape(-1)).view(n, M * B, K).float()
    scores_nHL = torch.bmm(q_nHK.float(), rows_nLK.transpose(1, 2)) * scale
    keep_n1L = (torch.arange(M * B, device=q_nHK.device)[None] < lens_n[:, None]).unsqueeze(1)
    probs_nHL = torch.softmax(scores_nHL.masked_fill(~keep_n1L, float("-inf")), dim=-1)
    return torch.bmm(probs_nHL, rows_nLK[..., :C])
