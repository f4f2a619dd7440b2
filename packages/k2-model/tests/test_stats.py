"""The cost model (k2_model.stats) against hand-computed formulas and meta-device parameter counts.

References: exact counts by hand for a small config; `transformers`' DeepseekV3ForCausalLM
instantiated on the meta device (param by param, per category); our K2ForCausalLM on the meta
device once it exists; the public numbers (1,026,408,209,408 and 671,026,404,352).
"""

from __future__ import annotations

import pytest
import torch
from k2_model import K2Config
from k2_model.stats import (
    attention_layer_params,
    ep_rank_bytes,
    flops_per_token,
    kv_cache_bytes_per_token,
    model_stats,
    param_breakdown,
    seed_comparisons,
)

K2_TOTAL = 1_026_408_209_408
V3_TOTAL = 671_026_404_352
EXPERT_FULL = 3 * 7168 * 2048  # one K2/V3 SwiGLU expert: 44,040,192 weights


def hand_config(**overrides) -> K2Config:
    """Small enough to count by hand; kv_lora_rank chosen so absorbed and naive decode differ."""
    kw = dict(
        vocab_size=100, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=10,
        first_k_dense_replace=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    kw.update(overrides)
    return K2Config(**kw)


# ---------------------------------------------------------------------------------- exact counts
def test_public_totals_exact():
    assert param_breakdown(K2Config.preset("kimi-k2")).total_params == K2_TOTAL
    assert param_breakdown(K2Config.preset("deepseek-v3")).total_params == V3_TOTAL


def test_hand_counted_small_config():
    b = param_breakdown(hand_config())
    # Per layer: q_a 16*12, q_b 12*2*(10+4), kv_a 16*(16+4), kv_b 16*2*(10+6), o 2*6*16.
    attn = attention_layer_params(hand_config())
    assert (attn.q_a, attn.q_b, attn.kv_a, attn.kv_b, attn.o, attn.norms) == (
        192,
        336,
        320,
        512,
        192,
        12 + 16,
    )
    assert b.attention.total == 3 * (192 + 336 + 320 + 512 + 192)
    assert b.attention_head_projections == 3 * (336 + 512 + 192)
    assert b.embeddings.total == b.lm_head.total == 100 * 16
    assert b.dense_mlp.total == 1 * 3 * 16 * 32  # first_k_dense_replace=1
    expert = 3 * 16 * 8
    assert b.routed_experts == type(b.routed_experts)(2 * 8 * expert, 2 * 2 * expert)  # 2 MoE layers, top-2
    assert b.shared_experts.total == 2 * expert
    assert b.router.total == 2 * 8 * 16
    assert b.norms.total == 3 * (2 * 16 + 12 + 16) + 16
    assert b.total_params == 16756
    assert b.active_params == 16756 - 2 * (8 - 2) * expert == 12148
    assert b.active_params_no_embedding == 12148 - 1600
    assert b.active_matmul_params == 12148 - 1600 - 196


def test_full_rank_q_and_attention_bias_counted():
    attn = attention_layer_params(hand_config(q_lora_rank=None, attention_bias=True))
    # q_proj is bias-free (as in DeepSeek-V3); kv_a and o carry biases when attention_bias is set.
    assert (attn.q_a, attn.q_b, attn.norms) == (0, 16 * 2 * 14, 16)
    assert attn.kv_a == 16 * 20 + 20 and attn.o == 2 * 6 * 16 + 16


def test_active_params_presets():
    """Active = total minus the routed experts a token does not use, by hand for K2 and V3."""
    k2 = param_breakdown(K2Config.preset("kimi-k2"))
    v3 = param_breakdown(K2Config.preset("deepseek-v3"))
    assert k2.active_params == K2_TOTAL - 60 * (384 - 8) * EXPERT_FULL == 32_861_477_888
    assert v3.active_params == V3_TOTAL - 58 * (256 - 8) * EXPERT_FULL == 37_552_282_624
    # Without the input embedding table (vocab x hidden): the FLOP-relevant count.
    assert k2.active_params_no_embedding == 32_861_477_888 - 163840 * 7168
    # The paper rounds to 32.6B / 37B (COST_MODEL.md); ours are within 1.5%.
    assert abs(k2.active_params / 32.6e9 - 1) < 0.015 and abs(v3.active_params / 37e9 - 1) < 0.015


def test_mtp_layer_explains_paper_total():
    """The paper's 1.04T counts one MTP layer; the released config (and our model) has none."""
    k2 = param_breakdown(K2Config.preset("kimi-k2"))
    assert (
        k2.mtp_layer
        == 2 * 7168 + 2 * 7168 * 7168 + 101_124_096 + 2 * 7168 + 385 * EXPERT_FULL + 384 * 7168 + 7168
    )
    assert round((K2_TOTAL + k2.mtp_layer) / 1e12, 2) == 1.04


# ---------------------------------------------------------------------------------- meta-device references
def _hf_meta_model(cfg: K2Config):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(**cfg.to_hf())
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(hf_cfg)


def _category(name: str) -> str:
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    if "layernorm" in name or name.startswith("model.norm."):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    raise AssertionError(f"uncategorised parameter {name}")


CONFIGS = {
    "tiny": lambda: K2Config.preset("tiny"),
    "hand": hand_config,
    "hand-fullrank-q-bias-2dense": lambda: hand_config(
        q_lora_rank=None, attention_bias=True, first_k_dense_replace=2
    ),
    "kimi-k2": lambda: K2Config.preset("kimi-k2"),
    "deepseek-v3": lambda: K2Config.preset("deepseek-v3"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_breakdown_matches_transformers_meta_model(name):
    cfg = CONFIGS[name]()
    model = _hf_meta_model(cfg)
    per_cat: dict[str, int] = {}
    head_proj = 0
    for pname, p in model.named_parameters():
        per_cat[_category(pname)] = per_cat.get(_category(pname), 0) + p.numel()
        if any(f".self_attn.{k}." in pname for k in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")):
            head_proj += p.numel()
    b = param_breakdown(cfg)
    assert {k: c.total for k, c in b.rows() if c.total} == per_cat
    assert b.total_params == sum(p.numel() for p in model.parameters())
    assert b.attention_head_projections == head_proj
    # Active: routed-expert tensors hold E experts; a token reads K of them.
    active = sum(v for k, v in per_cat.items() if k != "routed_experts")
    active += per_cat.get("routed_experts", 0) * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert b.active_params == active


@pytest.mark.parametrize("name", ["tiny", "kimi-k2", "deepseek-v3"])
def test_total_matches_our_model_on_meta(name):
    k2_model = pytest.importorskip("k2_model")
    if not hasattr(k2_model, "K2ForCausalLM"):
        pytest.skip("k2_model.K2ForCausalLM not available yet")
    cfg = K2Config.preset(name)
    with torch.device("meta"):
        model = k2_model.K2ForCausalLM(cfg)
    assert param_breakdown(cfg).total_params == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------- FLOPs
def test_flops_hand_config():
    cfg, s = hand_config(), 10
    f = flops_per_token(cfg, s)
    L, H, d_qk, d_v = 3, 2, 14, 6
    assert f.linear == 2 * 10352
    # Causal prefill: position i (1-based) attends to i keys; 2 FLOPs per MAC over scores and values.
    causal_total = sum(2 * L * H * i * (d_qk + d_v) for i in range(1, s + 1))
    assert f.prefill_attention * s == causal_total  # exact: the mean is an integer
    assert f.prefill_attention == 1320
    assert f.prefill_full_attention == 2 * L * H * s * (d_qk + d_v) == 2400
    assert f.decode_attention_naive == 2400
    # Absorbed MLA: scores over the latent + rope key (16 + 4), values over the latent (16).
    assert f.decode_attention_absorbed == 2 * L * H * s * (16 + 4 + 16) == 4320
    assert f.prefill == f.linear + 1320 and f.decode_absorbed == f.linear + 4320


def test_flops_context_validation():
    with pytest.raises(ValueError, match="context"):
        flops_per_token(hand_config(), 0)


def test_heads_ablation_at_128k():
    """K2 with 128 instead of 64 heads at 128K context: +76.7% (causal) / +86.5% (no mask); paper +83%."""
    k2 = K2Config.preset("kimi-k2")
    s = 131072
    comps = {
        c.key: c
        for c in seed_comparisons(k2, K2Config.preset("deepseek-v3"), s, 128, "kimi-k2", "deepseek-v3")
    }
    lin64 = 2 * 31_686_066_176
    lin128 = lin64 + 2 * 5_244_977_152  # doubling heads doubles q_b, kv_b and o
    c = comps["heads_prefill_flops"]
    assert c.ours_a == lin64 + 61 * 64 * 320 * (s + 1)
    assert c.ours_b == lin128 + 61 * 128 * 320 * (s + 1)
    assert round(c.ours_change, 3) == 0.767
    full = comps["heads_prefill_full_flops"]
    assert full.ours_a == lin64 + 2 * 61 * 64 * 320 * s
    assert round(full.ours_change, 3) == 0.865
    # The paper's +83% lies between the two conventions (COST_MODEL.md).
    assert c.paper_change == pytest.approx(0.83)
    assert c.ours_change < c.paper_change < full.ours_change


# ---------------------------------------------------------------------------------- memory
def test_kv_cache_bytes():
    kv = kv_cache_bytes_per_token(hand_config())
    assert kv.compressed == 3 * (16 + 4) * 2 == 120
    assert kv.expanded == 3 * 2 * (14 + 6) * 2 == 240
    k2, v3 = (
        kv_cache_bytes_per_token(K2Config.preset("kimi-k2")),
        kv_cache_bytes_per_token(K2Config.preset("deepseek-v3")),
    )
    assert k2.compressed == v3.compressed == 61 * 576 * 2 == 70_272
    assert k2.expanded == 61 * 64 * 320 * 2 == 2_498_560
    assert v3.expanded == 2 * k2.expanded
    assert kv_cache_bytes_per_token(hand_config(), dtype_bytes=1).compressed == 60


def test_ep_rank_bytes_hand_config():
    expert = 3 * 16 * 8
    r = ep_rank_bytes(hand_config(), ep=4)  # 8 experts / 4 ranks = 2 per MoE layer, + 1 shared, 2 MoE layers
    assert (r.routed_experts_per_layer, r.evenly_divided, r.moe_layers) == (2, True, 2)
    assert r.routed_bytes == 2 * 2 * expert and r.shared_bytes == 2 * 1 * expert
    assert r.expert_bytes == 2304
    assert r.block_scale_bytes == 2 * 3 * 3 * 4  # 6 experts x 3 matrices x one 128x128 block x fp32
    assert r.dense_mlp_bytes == 3 * 16 * 32 and r.attention_bytes == 3 * 1552
    uneven = ep_rank_bytes(hand_config(), ep=3)  # ceil(8/3) = 3 on the fullest rank
    assert (uneven.routed_experts_per_layer, uneven.evenly_divided) == (3, False)
    assert uneven.expert_bytes == 2 * (3 + 1) * expert
    for bad in (0, 9, True):
        with pytest.raises(ValueError, match="ep"):
            ep_rank_bytes(hand_config(), ep=bad)


def test_ep128_per_rank_bytes_presets():
    """Seed 003: at EP=128 about 7.5 GB (V3: 2 routed + 1 shared) vs 10 GB (K2: 3 + 1) per rank."""
    k2 = ep_rank_bytes(K2Config.preset("kimi-k2"), 128)
    v3 = ep_rank_bytes(K2Config.preset("deepseek-v3"), 128)
    assert k2.expert_bytes == 60 * (3 + 1) * EXPERT_FULL == 10_569_646_080
    assert v3.expert_bytes == 58 * (2 + 1) * EXPERT_FULL == 7_662_993_408
    assert abs(k2.expert_bytes / 10e9 - 1) < 0.06 and abs(v3.expert_bytes / 7.5e9 - 1) < 0.03
    # Block scales: per expert 2 x (16 x 56) + (56 x 16) blocks of 4 bytes.
    assert k2.block_scale_bytes == 60 * 4 * 3 * 16 * 56 * 4


def test_qkvo_params_presets():
    k2 = param_breakdown(K2Config.preset("kimi-k2"))
    v3 = param_breakdown(K2Config.preset("deepseek-v3"))
    assert k2.attention_head_projections == 61 * (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * 7168)
    assert v3.attention_head_projections == 2 * k2.attention_head_projections == 10_489_954_304
    # The seed: "QKVO 10B vs 5B", and the 5B difference in active parameters.
    assert abs(v3.attention_head_projections / 10e9 - 1) < 0.05


def test_model_stats_dict():
    d = model_stats(K2Config.preset("kimi-k2"), context=4096, ep=128, name="kimi-k2").to_dict()
    assert d["total_params"] == K2_TOTAL and d["active_params"] == 32_861_477_888
    assert d["flops_per_token"]["context"] == 4096
    assert d["ep_rank_bytes"]["expert_bytes"] == 10_569_646_080
    assert sum(c["total"] for c in d["params"].values()) == K2_TOTAL
