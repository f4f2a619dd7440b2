"""Shapes for tests and smoke runs: K2's structure (MLA, a dense first layer then MoE) at a size
that runs a training step in well under a second on a CPU core.

    tiny_model()                 # K2ForCausalLM(K2Config.preset("tiny", **SMALL_OVERRIDES))
    tiny_model(vocab_size=100)   # overrides on top
    plant_next_token(state, after=7900, token=7938)  # greedy says 7938 right after 7900
"""

from __future__ import annotations

from typing import Any

SMALL_OVERRIDES: dict[str, int] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
}


def tiny_config(**overrides: Any):
    """The tiny preset at test size (SMALL_OVERRIDES), with `overrides` on top."""
    from k2_model.config import K2Config

    return K2Config.preset("tiny", **{**SMALL_OVERRIDES, **overrides})


def tiny_model(**overrides: Any):
    """A K2ForCausalLM of `tiny_config(**overrides)` (random init, the global RNG's state)."""
    from k2_model.model import K2ForCausalLM

    return K2ForCausalLM(tiny_config(**overrides))


def plant_next_token(state: dict, after: int, token: int, seed: int = 0) -> None:
    """Edit HF-named weights (a model's state_dict or a safetensors dict) in place so that `token` is
    the clear greedy choice right after `after`, and no likelier than any other token elsewhere:
    a large direction v added to `after`'s embedding dominates the final hidden state at that
    position (every sublayer sees a normalised input, so the rest of the model works as before),
    and `token`'s output row becomes v at a typical row's norm. For tests of stop tokens on
    untrained weights, which otherwise never say a given token."""
    import torch

    emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    v = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    v = (v / v.norm()).to(emb.dtype)
    with torch.no_grad():
        emb[after] += 64 * emb.norm(dim=1).mean() * v
        head[token] = head.norm(dim=1).mean() * v


__all__ = ["SMALL_OVERRIDES", "plant_next_token", "tiny_config", "tiny_model"]
