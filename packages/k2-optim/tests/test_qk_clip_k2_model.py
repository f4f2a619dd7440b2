"""QK-Clip exactness against k2-model's K2ForCausalLM (MLA), through its QK-Clip protocol."""

import dataclasses

import pytest
import torch
from k2_optim import MuonClip

k2_model = pytest.importorskip("k2_model")


def _small_k2():
    cfg = dataclasses.replace(
        k2_model.K2Config.preset("tiny"),
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = k2_model.K2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(60.0)
            layer.self_attn.kv_b_proj.weight.mul_(60.0)
    return model


def test_k2_model_exactness_first_layer():
    model = _small_k2()
    cfg = model.config
    model.train()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    S_LH = model.attention_max_logits().clone()
    tau = float(S_LH[0].median())
    assert tau > 0
    clipped0 = S_LH[0] > tau
    assert clipped0.any() and (~clipped0).any()
    attn0 = model.model.layers[0].self_attn
    kv_a = attn0.kv_a_proj_with_mqa.weight.clone()
    P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    values = attn0.kv_b_proj.weight.view(cfg.num_attention_heads, P + V, -1)[:, P:].clone()
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau)
    muon_ids = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    assert id(model.model.layers[1].mlp.experts.gate_proj) in muon_ids  # stacked experts on Muon
    assert id(model.model.embed_tokens.weight) not in muon_ids and id(model.lm_head.weight) not in muon_ids
    opt.step()
    assert opt.last_clip_stats()["num_clipped"] == int((S_LH > tau).sum())
    with torch.no_grad():
        model(ids)  # layer 0 sees the same input (lr = 0)
    after0 = model.attention_max_logits()[0]
    for h in range(cfg.num_attention_heads):
        if clipped0[h]:
            assert after0[h].item() == pytest.approx(tau, rel=1e-5)
        else:
            assert after0[h].item() == S_LH[0, h].item()
    assert torch.equal(attn0.kv_a_proj_with_mqa.weight, kv_a)
    assert torch.equal(attn0.kv_b_proj.weight.view(cfg.num_attention_heads, P + V, -1)[:, P:], values)
