"""The model walk for generation: packed prefill and batched decode over the MLA cache.

Shape legend: T packed prefill tokens, n sequences, D hidden size, N vocabulary, R2 = R // 2.

Tables are block tables of the paged `MLACache`. Uses the modules of a `K2ForCausalLM` (embeddings, norms, MLP/MoE, head) and replaces only the
attention, which reads and writes the compressed cache. Logits are computed only at the
positions that are sampled (the last prompt token; every decode token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from k2_kernels import ops as _kops
from torch import Tensor

from k2_model.engine.cache import MLACache
from k2_model.engine.decode import (
    DecodeIndex,
    PrefillIndex,
    decode_attention_absorbed,
    decode_attention_expanded,
    prefill_attention,
)
from k2_model.engine.linear import linear
from k2_model.model import K2ForCausalLM
from k2_model.moe import MoE
from k2_model.rope import rope_cos_sin

DECODE_ATTENTION = {"absorbed": decode_attention_absorbed, "expanded": decode_attention_expanded}


def _mlp(layer: torch.nn.Module, h_TD: Tensor, routes: list[Tensor] | None) -> Tensor:
    """The layer's MLP; with `routes` (the cache records them), a MoE layer's chosen experts
    [T, K] are appended to it."""
    x_1TD = layer.post_attention_layernorm(h_TD).unsqueeze(0)
    if routes is not None and isinstance(layer.mlp, MoE):
        out_1TD, idx_TK = layer.mlp(x_1TD, return_routes=True)
        routes.append(idx_TK)
        return out_1TD.squeeze(0)
    return layer.mlp(x_1TD).squeeze(0)


def _record_routes(cache: MLACache, routes: list[Tensor] | None, block_T: Tensor, offset_T: Tensor) -> None:
    if routes:
        cache.write_routes(block_T, offset_T, torch.stack(routes, dim=1))


@torch.inference_mode()
def prefill(
    model: K2ForCausalLM,
    cache: MLACache,
    new_tokens: Sequence[Sequence[int]],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
) -> Tensor:
    """Run each sequence's new tokens (from position `starts[i]`, after its cached prefix) into the blocks
    of its table (covering every position it will hold); fp32 logits [len(new_tokens), N] at each last token."""
    B = cache.block_size
    device = model.lm_head.weight.device
    lengths = [len(p) for p in new_tokens]
    ids_T = torch.tensor([t for p in new_tokens for t in p], dtype=torch.long, device=device)
    pos = [s + j for s, S in zip(starts, lengths) for j in range(S)]
    blk = [tables[i][p // B] for i, (s, S) in enumerate(zip(starts, lengths)) for p in range(s, s + S)]
    pos_T = torch.tensor(pos, dtype=torch.long, device=device)
    idx = PrefillIndex(
        block_T=torch.tensor(blk, dtype=torch.long, device=device),
        offset_T=pos_T % B,
        starts=list(starts),
        lengths=lengths,
        prefix_tables=[
            torch.tensor(t[: cache.blocks_for(s)], dtype=torch.long, device=device)
            for s, t in zip(starts, tables)
        ],
    )
    inner = model.model
    cos_TR2, sin_TR2 = rope_cos_sin(inner.rope_inv_freq, pos_T, inner.rope_attention_factor)
    h_TD = inner.embed_tokens(ids_T)
    routes = [] if cache.routes_BbLK is not None else None
    for i, layer in enumerate(inner.layers):
        h_TD = h_TD + prefill_attention(
            layer.self_attn, layer.input_layernorm(h_TD), cos_TR2, sin_TR2, cache, i, idx
        )
        h_TD = h_TD + _mlp(layer, h_TD, routes)
    _record_routes(cache, routes, idx.block_T, idx.offset_T)
    last_n = torch.tensor(lengths, device=device).cumsum(0) - 1
    return linear(model.lm_head, inner.norm(h_TD[last_n])).float()


def paged_decode(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether absorbed decode reads the cache in place with k2-kernels' `mla_decode_paged` (CPU,
    fp32 or bf16 cache) instead of gathering each sequence's blocks into a padded copy per layer."""
    return dtype in (torch.float32, torch.bfloat16) and _kops.preferred("mla_decode_paged", device)


@torch.inference_mode()
def decode(
    model: K2ForCausalLM,
    cache: MLACache,
    tokens_n: Tensor,
    pos_n: Tensor,
    tables: Sequence[Sequence[int]],
    attention: str = "absorbed",
) -> Tensor:
    """One token per sequence at positions pos_n (their rows go into `tables[i][pos // B]`); fp32 logits [n, N]."""
    attend = DECODE_ATTENTION[attention]
    B, device = cache.block_size, pos_n.device
    M = max(len(t) for t in tables)
    pos = pos_n.tolist()
    paged = attention == "absorbed" and paged_decode(device, cache.dtype)
    idx = DecodeIndex(
        pos_n=pos_n,
        block_n=torch.tensor([t[p // B] for t, p in zip(tables, pos)], dtype=torch.long, device=device),
        offset_n=pos_n % B,
        table_nM=torch.tensor(
            [list(t) + [t[0]] * (M - len(t)) for t in tables], dtype=torch.long, device=device
        ),
        keys_n1L=(torch.arange(M * B, device=device)[None] <= pos_n[:, None]).unsqueeze(1),
        # the compiled kernel reads the pool in place; the PyTorch path gathers into this buffer
        rows=None
        if paged
        else torch.empty(len(tables) * M, B, cache.row_size, dtype=cache.dtype, device=device),
        lens_n=pos_n + 1,
    )
    inner = model.model
    cos_nR2, sin_nR2 = rope_cos_sin(inner.rope_inv_freq, pos_n, inner.rope_attention_factor)
    h_nD = inner.embed_tokens(tokens_n)
    routes = [] if cache.routes_BbLK is not None else None
    for i, layer in enumerate(inner.layers):
        h_nD = h_nD + attend(layer.self_attn, layer.input_layernorm(h_nD), cos_nR2, sin_nR2, cache, i, idx)
        h_nD = h_nD + _mlp(layer, h_nD, routes)
    _record_routes(cache, routes, idx.block_n, idx.offset_n)
    return linear(model.lm_head, inner.norm(h_nD)).float()
