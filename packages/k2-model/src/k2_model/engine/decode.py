"""MLA attention over the compressed cache: absorbed decode, expanded decode (reference), expanded prefill.

Shape legend: n sequences in the step, T packed prefill tokens, L cached length (keys; M blocks
times B tokens in a decode step), H heads, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
C kv_lora_rank, K = C + R, D hidden size, R2 = R // 2.

Absorbed decode (the DeepSeek-V2 paper's weight absorption): head h's key-nope is W_UK[h] c and its value
W_UV[h] c, with c the normalised latent. So
    q_nope[h] . k_nope[h]_j = (W_UK[h]^T q_nope[h]) . c_j      (W_UK folded into the query)
    sum_j p_j W_UV[h] c_j   = W_UV[h] (sum_j p_j c_j)          (W_UV folded into the output)
and every head attends over the shared K-dim cache rows [c_j, rope(k_rope)_j] directly: one
batched matmul for scores and one for the weighted sum, never expanding per-head keys/values.
W_UK and W_UV are views of `kv_b_proj.weight` taken at every call, and the projections' oneDNN
packs (`engine/linear.py`) are keyed by each weight's version counter: weights updated in place
between steps take effect on the next step.

Rows live in the paged cache: a step's `DecodeIndex` / `PrefillIndex` say where each new row goes
(block, offset) and which blocks hold each sequence's earlier rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from k2_kernels.decode_ops import mla_decode_paged
from torch import Tensor

from k2_model.engine.cache import MLACache
from k2_model.engine.linear import linear
from k2_model.model import MLAttention
from k2_model.rope import apply_rope_interleaved


@dataclass
class DecodeIndex:
    """Where a decode step's rows go and come from (built once per step, shared by every layer)."""

    pos_n: Tensor  # the new token's position
    block_n: Tensor  # the block its row goes to
    offset_n: Tensor  # and the offset in it
    table_nM: Tensor  # block tables, padded with any block id (masked by position)
    keys_n1L: Tensor  # True where key j exists for the sequence (j <= pos), [n, 1, M * B]
    rows: Tensor | None  # [n * M, B, K] buffer the layers gather their rows into; None: read in place
    lens_n: Tensor  # rows per sequence (pos + 1)


@dataclass
class PrefillIndex:
    """Where a prefill step's rows go (per packed token) and each sequence's cached prefix."""

    block_T: Tensor
    offset_T: Tensor
    starts: list[int]  # tokens already cached per sequence (its new tokens start there)
    lengths: list[int]  # new tokens per sequence
    prefix_tables: list[Tensor]  # the blocks holding rows 0..start-1 (empty when start == 0)


def _query(attn: MLAttention, x_nD: Tensor) -> Tensor:
    """[n, H, P + R] queries (q low-rank path or plain q_proj)."""
    H, P, R = attn.num_heads, attn.P, attn.R
    if attn.config.q_lora_rank is None:
        return linear(attn.q_proj, x_nD).view(-1, H, P + R)
    return linear(attn.q_b_proj, attn.q_a_layernorm(linear(attn.q_a_proj, x_nD))).view(-1, H, P + R)


def cache_rows(attn: MLAttention, x_nD: Tensor, cos_nR2: Tensor, sin_nR2: Tensor) -> Tensor:
    """The cache rows of new tokens: [kv_a_layernorm(c), rope(k_rope)], [n, C + R]."""
    c_nC, k_rope_nR = linear(attn.kv_a_proj_with_mqa, x_nD).split([attn.C, attn.R], dim=-1)
    return torch.cat((attn.kv_a_layernorm(c_nC), apply_rope_interleaved(k_rope_nR, cos_nR2, sin_nR2)), dim=-1)


def _up_weights(attn: MLAttention) -> tuple[Tensor, Tensor]:
    """W_UK [H, P, C] and W_UV [H, V, C]: views of kv_b_proj.weight [H * (P + V), C]."""
    w_HXC = attn.kv_b_proj.weight.view(attn.num_heads, attn.P + attn.V, attn.C)
    return w_HXC[:, : attn.P], w_HXC[:, attn.P :]


def decode_attention_absorbed(
    attn: MLAttention,
    x_nD: Tensor,
    cos_nR2: Tensor,
    sin_nR2: Tensor,
    cache: MLACache,
    layer: int,
    idx: DecodeIndex,
) -> Tensor:
    """One new token per sequence at positions idx.pos_n: writes its cache row, returns [n, D]."""
    n = x_nD.shape[0]
    H, C = attn.num_heads, attn.C
    q_nHX = _query(attn, x_nD)
    q_nope_nHP, q_rope_nHR = q_nHX.split([attn.P, attn.R], dim=-1)
    q_rope_nHR = apply_rope_interleaved(q_rope_nHR, cos_nR2.unsqueeze(1), sin_nR2.unsqueeze(1))
    cache.write(layer, idx.block_n, idx.offset_n, cache_rows(attn, x_nD, cos_nR2, sin_nR2))

    w_uk_HPC, w_uv_HVC = _up_weights(attn)
    q_lat_HnC = torch.bmm(q_nope_nHP.transpose(0, 1), w_uk_HPC)  # W_UK folded into the query
    q_nHK = torch.cat((q_lat_HnC.transpose(0, 1), q_rope_nHR), dim=-1)
    if idx.rows is None:  # k2-kernels reads each sequence's rows in the pool, once for all heads
        o_lat_nHC = mla_decode_paged(
            q_nHK, cache.kv_LyBbK[layer], idx.table_nM, idx.lens_n, C, attn.softmax_scale
        )
    else:
        kv_nLK = cache.gather(layer, idx.table_nM, out=idx.rows)
        scores_nHL = torch.bmm(q_nHK, kv_nLK.transpose(1, 2).to(q_nHK.dtype))
        scores_nHL = scores_nHL.mul_(attn.softmax_scale).masked_fill_(~idx.keys_n1L, float("-inf"))
        probs_nHL = F.softmax(scores_nHL, dim=-1, dtype=torch.float32).to(q_nHK.dtype)
        o_lat_nHC = torch.bmm(probs_nHL, kv_nLK[..., :C].to(q_nHK.dtype))
    return linear(attn.o_proj, _fold_uv(o_lat_nHC, w_uv_HVC).reshape(n, H * attn.V))


def _fold_uv(o_lat_nHC: Tensor, w_uv_HVC: Tensor) -> Tensor:
    """[n, H, V] = W_UV[h] o_lat[n, h] for every head: W_UV folded into the output. fp32 multiplies
    o_lat by W_UV^T (a transposed view the fp32 GEMM takes as it is); in bf16 torch's CPU bmm copies such a
    transposed weight on every call (288 vs 75 us at 8 rows, 4 heads of 128x512), so it multiplies
    W_UV by o_lat^T instead and transposes the small result."""
    if w_uv_HVC.dtype == torch.float32 or w_uv_HVC.device.type != "cpu":
        return torch.bmm(o_lat_nHC.transpose(0, 1), w_uv_HVC.transpose(1, 2)).transpose(0, 1)
    return torch.bmm(w_uv_HVC, o_lat_nHC.permute(1, 2, 0)).permute(2, 0, 1)


def decode_attention_expanded(
    attn: MLAttention,
    x_nD: Tensor,
    cos_nR2: Tensor,
    sin_nR2: Tensor,
    cache: MLACache,
    layer: int,
    idx: DecodeIndex,
) -> Tensor:
    """The same step in the expanded form (per-head keys and values rebuilt from the cache): the reference."""
    n = x_nD.shape[0]
    H, P, R, V, C = attn.num_heads, attn.P, attn.R, attn.V, attn.C
    q_nHX = _query(attn, x_nD)
    q_nope_nHP, q_rope_nHR = q_nHX.split([P, R], dim=-1)
    q_rope_nHR = apply_rope_interleaved(q_rope_nHR, cos_nR2.unsqueeze(1), sin_nR2.unsqueeze(1))
    cache.write(layer, idx.block_n, idx.offset_n, cache_rows(attn, x_nD, cos_nR2, sin_nR2))
    kv_nLK = cache.gather(layer, idx.table_nM, out=idx.rows).to(q_nHX.dtype)  # rows: never None here
    max_len = kv_nLK.shape[1]
    kv_nLHX = linear(attn.kv_b_proj, kv_nLK[..., :C]).view(n, max_len, H, P + V)
    k_nope_nHLP, v_nHLV = kv_nLHX.transpose(1, 2).split([P, V], dim=-1)
    k_nHLX = torch.cat((k_nope_nHLP, kv_nLK[..., C:].unsqueeze(1).expand(n, H, max_len, R)), dim=-1)
    q_nH1X = torch.cat((q_nope_nHP, q_rope_nHR), dim=-1).unsqueeze(2)
    mask_n11L = idx.keys_n1L.unsqueeze(1)
    o_nH1V = F.scaled_dot_product_attention(
        q_nH1X, k_nHLX, v_nHLV, attn_mask=mask_n11L, scale=attn.softmax_scale
    )
    return linear(attn.o_proj, o_nH1V.reshape(n, H * V))


def prefill_attention(
    attn: MLAttention,
    x_TD: Tensor,
    cos_TR2: Tensor,
    sin_TR2: Tensor,
    cache: MLACache,
    layer: int,
    idx: PrefillIndex,
) -> Tensor:
    """Packed new tokens (sequence i: `idx.lengths[i]` tokens from position `idx.starts[i]`) in the expanded form.

    Projections run once over all T tokens; causal attention runs per sequence (varlen), so no
    padding and no block-diagonal mask. A sequence with a cached prefix attends to the prefix's
    rows from the cache (their per-head keys and values rebuilt by `kv_b_proj`, as a full prefill
    computes them) plus its new tokens. Writes every new row into its block.
    """
    T = x_TD.shape[0]
    H, P, R, V, C = attn.num_heads, attn.P, attn.R, attn.V, attn.C
    q_THX = _query(attn, x_TD)
    q_nope_THP, q_rope_THR = q_THX.split([P, R], dim=-1)
    q_rope_THR = apply_rope_interleaved(q_rope_THR, cos_TR2.unsqueeze(1), sin_TR2.unsqueeze(1))
    rows_TK = cache_rows(attn, x_TD, cos_TR2, sin_TR2)
    cache.write(layer, idx.block_T, idx.offset_T, rows_TK)
    kv_THX = linear(attn.kv_b_proj, rows_TK[:, :C]).view(T, H, P + V)
    k_nope_THP, v_THV = kv_THX.split([P, V], dim=-1)
    q_HTX = torch.cat((q_nope_THP, q_rope_THR), dim=-1).transpose(0, 1)
    k_HTX = torch.cat((k_nope_THP, rows_TK[:, C:].unsqueeze(1).expand(T, H, R)), dim=-1).transpose(0, 1)
    v_HTV = v_THV.transpose(0, 1)
    outs, t0 = [], 0
    for start, S, table in zip(idx.starts, idx.lengths, idx.prefix_tables):
        sl = slice(t0, t0 + S)
        q_1HSX, k_HSX, v_HSV = q_HTX[None, :, sl], k_HTX[:, sl], v_HTV[:, sl]
        if start == 0:
            o_HSV = F.scaled_dot_product_attention(
                q_1HSX, k_HSX[None], v_HSV[None], is_causal=True, scale=attn.softmax_scale
            )[0]
        else:
            pre_LK = cache.gather(layer, table[None])[0, :start].to(x_TD.dtype)
            pre_LHX = linear(attn.kv_b_proj, pre_LK[:, :C]).view(start, H, P + V)
            pre_k_HLP, pre_v_HLV = pre_LHX.transpose(0, 1).split([P, V], dim=-1)
            pre_k_HLX = torch.cat((pre_k_HLP, pre_LK[:, C:].unsqueeze(0).expand(H, start, R)), dim=-1)
            keys = torch.cat((pre_k_HLX, k_HSX), dim=1)
            values = torch.cat((pre_v_HLV, v_HSV), dim=1)
            q_pos_S = torch.arange(start, start + S, device=x_TD.device)
            mask_SL = torch.arange(start + S, device=x_TD.device)[None] <= q_pos_S[:, None]
            o_HSV = F.scaled_dot_product_attention(
                q_1HSX, keys[None], values[None], attn_mask=mask_SL, scale=attn.softmax_scale
            )[0]
        outs.append(o_HSV)
        t0 += S
    o_HTV = torch.cat(outs, dim=1)
    return linear(attn.o_proj, o_HTV.transpose(0, 1).reshape(T, H * V))
