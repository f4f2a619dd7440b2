"""The model walk for generation: packed prefill and batched decode over the MLA cache.

Shape legend: T packed prefill tokens, n sequences, D hidden size, N vocabulary, R2 = R // 2.

Uses the modules of a `K2ForCausalLM` (embeddings, norms, MLP/MoE, head) and replaces only the
attention, which reads and writes the compressed cache. Logits are computed only at the
positions that are sampled (the last prompt token; every decode token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k2_model.engine.cache import MLACache
from k2_model.engine.decode import decode_attention_absorbed, decode_attention_expanded, prefill_attention
from k2_model.model import K2ForCausalLM
from k2_model.rope import rope_cos_sin

DECODE_ATTENTION = {"absorbed": decode_attention_absorbed, "expanded": decode_attention_expanded}


def _mlp(layer: torch.nn.Module, h_TD: Tensor) -> Tensor:
    return layer.mlp(layer.post_attention_layernorm(h_TD).unsqueeze(0)).squeeze(0)


@torch.inference_mode()
def prefill(
    model: K2ForCausalLM, cache: MLACache, prompts: Sequence[Sequence[int]], slots: Sequence[int]
) -> Tensor:
    """Run fresh prompts (positions from 0) into their cache slots; fp32 logits [len(prompts), N] at each last token."""
    lengths = [len(p) for p in prompts]
    device = model.lm_head.weight.device
    ids_T = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    pos_T = torch.cat([torch.arange(S, device=device) for S in lengths])
    inner = model.model
    cos_TR2, sin_TR2 = rope_cos_sin(inner.rope_inv_freq, pos_T, inner.rope_attention_factor)
    h_TD = inner.embed_tokens(ids_T)
    for i, layer in enumerate(inner.layers):
        h_TD = h_TD + prefill_attention(
            layer.self_attn, layer.input_layernorm(h_TD), cos_TR2, sin_TR2, cache, i, list(slots), lengths
        )
        h_TD = h_TD + _mlp(layer, h_TD)
    last_n = torch.tensor(lengths, device=device).cumsum(0) - 1
    return model.lm_head(inner.norm(h_TD[last_n])).float()


@torch.inference_mode()
def decode(
    model: K2ForCausalLM, cache: MLACache, tokens_n: Tensor, pos_n: Tensor, attention: str = "absorbed"
) -> Tensor:
    """One token per sequence in slots 0..n-1 at positions pos_n; fp32 logits [n, N]."""
    attend = DECODE_ATTENTION[attention]
    max_len = int(pos_n.max()) + 1
    inner = model.model
    cos_nR2, sin_nR2 = rope_cos_sin(inner.rope_inv_freq, pos_n, inner.rope_attention_factor)
    h_nD = inner.embed_tokens(tokens_n)
    for i, layer in enumerate(inner.layers):
        h_nD = h_nD + attend(
            layer.self_attn, layer.input_layernorm(h_nD), cos_nR2, sin_nR2, cache, i, pos_n, max_len
        )
        h_nD = h_nD + _mlp(layer, h_nD)
    return model.lm_head(inner.norm(h_nD)).float()
