"""Shapes for tests and smoke runs: K2's structure (MLA, a dense first layer then MoE) at a size
that runs a training step in well under a second on a CPU core.

    tiny_model()                 # K2ForCausalLM(K2Config.preset("tiny", **SMALL_OVERRIDES))
    tiny_model(vocab_size=100)   # overrides on top
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


__all__ = ["SMALL_OVERRIDES", "tiny_config", "tiny_model"]
