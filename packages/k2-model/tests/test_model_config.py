"""K2Config (presets, HF round trips, errors) and model facts: meta-device parameter counts,
bf16 forward, the tiny preset's shape."""

from __future__ import annotations

import json

import pytest
import torch
from k2_model import K2Config, K2ForCausalLM


def test_kimi_k2_preset_is_the_released_config() -> None:
    c = K2Config.preset("kimi-k2")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.moe_intermediate_size) == (
        61,
        7168,
        18432,
        2048,
    )
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok, c.first_k_dense_replace) == (
        384,
        1,
        8,
        1,
    )
    assert (c.n_group, c.topk_group, c.scoring_func, c.topk_method, c.norm_topk_prob) == (
        1,
        1,
        "sigmoid",
        "noaux_tc",
        True,
    )
    assert c.routed_scaling_factor == 2.827
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.rope_theta == 50000 and c.max_position_embeddings == 131072
    assert c.rope_scaling == {
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    assert (c.vocab_size, c.rms_norm_eps, c.tie_word_embeddings) == (163840, 1e-6, False)
    # softmax scale: 1/sqrt(192) * (0.1 * ln 32 + 1)^2
    import math

    assert c.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(32) + 1) ** 2, rel=1e-12)


def test_tiny_preset_keeps_k2_heads_and_tokenizer_vocab() -> None:
    c = K2Config.preset("tiny")
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (8192, 7936, 7937, 8191)
    assert (c.n_group, c.scoring_func, c.topk_method, c.routed_scaling_factor) == (
        1,
        "sigmoid",
        "noaux_tc",
        2.827,
    )
    assert c.first_k_dense_replace == 1 and not c.is_moe_layer(0) and c.is_moe_layer(1)


def test_tiny_vllm_preset_is_tiny_with_k2s_mla_latent() -> None:
    """vLLM's CPU MLA backends take only MLA head 576 (kv_lora_rank 512 + rope 64): K2's own."""
    tiny, vllm = K2Config.preset("tiny"), K2Config.preset("tiny-vllm")
    assert tiny.kv_lora_rank == 128  # unchanged: results and demos depend on it
    assert vllm.kv_lora_rank + vllm.qk_rope_head_dim == 576
    assert vllm.kv_lora_rank == K2Config.preset("kimi-k2").kv_lora_rank
    assert vllm.replace(kv_lora_rank=128) == tiny


@pytest.mark.parametrize(
    ("preset", "expected"), [("kimi-k2", 1_026_408_209_408), ("deepseek-v3", 671_026_404_352)]
)
def test_meta_device_parameter_count(preset: str, expected: int) -> None:
    with torch.device("meta"):
        model = K2ForCausalLM(K2Config.preset(preset))
    assert model.num_parameters() == expected
    # the selection bias is a buffer, not a parameter
    name = "model.layers.3.mlp.gate.e_score_correction_bias"
    assert name in dict(model.named_buffers()) and name not in dict(model.named_parameters())


@pytest.mark.parametrize("preset", ["kimi-k2", "deepseek-v3", "tiny"])
def test_hf_round_trip_through_transformers(preset: str) -> None:
    transformers = pytest.importorskip("transformers")
    c = K2Config.preset(preset)
    hf = transformers.DeepseekV3Config(**c.to_hf())
    assert hf.n_routed_experts == c.n_routed_experts and hf.n_group == c.n_group
    assert hf.rope_parameters["rope_theta"] == c.rope_theta
    # transformers 5.x writes rope_parameters; reading that back gives our config again
    back = K2Config.from_hf(hf.to_dict())
    for f in ("hidden_size", "q_lora_rank", "rope_theta", "rope_scaling", "routed_scaling_factor", "n_group"):
        assert getattr(back, f) == getattr(c, f), f


def test_from_hf_reads_4x_rope_scaling_and_5x_rope_parameters(tmp_path) -> None:
    yarn = {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    base = K2Config.preset("kimi-k2").to_hf()
    base.pop("rope_parameters")
    base.pop("rope_scaling")
    v4 = dict(base, model_type="kimi_k2", rope_theta=50000.0, rope_scaling=dict(yarn, type="yarn"))
    v5 = dict(base, rope_parameters=dict(yarn, rope_type="yarn", rope_theta=50000.0))
    v5.pop("rope_theta")
    (tmp_path / "config.json").write_text(json.dumps(v4))
    a = K2Config.from_hf(tmp_path)  # a directory
    b = K2Config.from_hf(v5)
    assert a.model_type == "kimi_k2" and b.model_type == "deepseek_v3"
    assert a.rope_scaling == b.rope_scaling == dict(yarn, type="yarn")
    assert a.rope_theta == b.rope_theta == 50000.0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n_routed_experts": 10, "n_group": 4}, "n_group"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_bad_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        K2Config.preset("tiny", **change)


def test_bad_config_json_names_the_file(tmp_path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        K2Config.from_hf(p)
    p.write_text(json.dumps(dict(K2Config.preset("tiny").to_hf(), qk_rope_head_dim=63)))
    with pytest.raises(ValueError, match=r"config\.json.*qk_rope_head_dim"):
        K2Config.from_hf(p)
    with pytest.raises(ValueError, match="preset"):
        K2Config.preset("kimi-k3")


def test_bf16_forward_matches_fp32() -> None:
    """bf16 forward of a small model agrees with fp32 to bf16 precision (rel. Frobenius error < 3e-2)."""
    cfg = K2Config.preset("tiny", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          q_lora_rank=32, kv_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, intermediate_size=64, pad_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    m32 = K2ForCausalLM(cfg)
    m16 = K2ForCausalLM(cfg)
    m16.load_state_dict(m32.state_dict())
    m16.to(torch.bfloat16)
    assert m16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32  # kept fp32
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        a = m32(ids, labels=ids)
        b = m16(ids, labels=ids)
    assert b.logits.dtype == torch.bfloat16
    assert float((b.logits.float() - a.logits).norm() / a.logits.norm()) < 3e-2
    assert abs(b.loss.item() - a.loss.item()) < 2e-2 * a.loss.item()
