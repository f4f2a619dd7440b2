"""Shapes for tests and smoke runs: K2's structure (MLA, a dense first layer then MoE) at a size
that runs a training step in well under a second on a CPU core.

    K2Config.preset("tiny", **SMALL_OVERRIDES)
"""

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

__all__ = ["SMALL_OVERRIDES"]
