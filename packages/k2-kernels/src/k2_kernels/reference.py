"""Plain PyTorch ground truth for every k2 kernel.

These functions define what each op computes. Tests compare the compiled kernels against them,
and `k2_kernels.ops` falls back to them when the compiled module is missing.

Shape legend: T tokens, E routed experts, K experts per token (top-k), D hidden size,
G expert groups, N = T * K permuted rows.
"""

from __future__ import annotations

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
