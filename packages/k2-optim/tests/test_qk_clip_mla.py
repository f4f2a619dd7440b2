"""QK-Clip exactness on an MLA-shaped module that implements the protocol, and MuonClip routing."""

import math

import pytest
import torch
from k2_optim import MuonClip, apply_qk_clip, muonclip_param_groups
from k2_optim.qk_clip import normalize_layers
from k2_optim.testing import TinyMLAModel, loud_mla_model
from torch import nn


def _capture_inputs(model, ids):
    inputs = []
    hooks = [
        a.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().clone()))
        for a in model.layers
    ]
    model(ids)
    for h in hooks:
        h.remove()
    return inputs


def test_mla_exactness_lr0():
    model = loud_mla_model()
    model.train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    x_in = _capture_inputs(model, ids)  # this forward also records the max logits
    S_LH = model.attention_max_logits().clone()
    tau = float(S_LH.flatten().median())  # about half the heads over tau
    clipped = S_LH > tau
    assert clipped.any() and (~clipped).any()
    before = [
        (a.logits_and_v(x)[0].detach(), a.kv_a_proj_with_mqa.weight.clone(), a.kv_b_proj.weight.clone())
        for a, x in zip(model.layers, x_in)
    ]
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau)
    model(ids).logsumexp(-1).mean().backward()  # grads exist; lr = 0 keeps Muon/AdamW a no-op
    model.reset_attention_max_logits()
    model(ids)  # the step's forward, recording S again (same weights, same S)
    opt.step()
    for l, (a, x) in enumerate(zip(model.layers, x_in)):
        logits_after, _ = a.logits_and_v(x)
        logits_before, kv_a_before, kv_b_before = before[l]
        for h in range(a.H):
            if clipped[l, h]:
                assert logits_after[:, h].max().item() == pytest.approx(tau, rel=2e-6)
            else:
                assert torch.equal(logits_after[:, h], logits_before[:, h])
        assert torch.equal(a.kv_a_proj_with_mqa.weight, kv_a_before)  # shared rotary key
        kv_b = a.kv_b_proj.weight.view(a.H, a.P + a.V, -1)
        assert torch.equal(kv_b[:, a.P :], kv_b_before.view(a.H, a.P + a.V, -1)[:, a.P :])  # values
    stats = opt.last_clip_stats()
    assert stats["num_clipped"] == int(clipped.sum())
    assert stats["max_logit_per_layer"]["layers.0"] == pytest.approx(float(S_LH[0].max()))
    assert stats["fraction_ever_clipped"] == pytest.approx(float(clipped.float().mean()))
    assert model.attention_max_logits().max() == -math.inf  # reset after the step


def test_apply_qk_clip_scales_rows_by_gamma_power():
    w = torch.ones(2 * 6, 3)
    layers = normalize_layers(
        [
            {
                "name": "l",
                "num_heads": 2,
                "spans": [{"param": w, "stride": 6, "start": 1, "length": 3, "power": 0.5}],
            }
        ]
    )
    clipped = apply_qk_clip(layers, torch.tensor([[400.0, 50.0]]), tau=100.0)
    assert clipped.tolist() == [[True, False]]
    expected = torch.ones(12)
    expected[1:4] = 0.5  # sqrt(100 / 400)
    assert torch.equal(w[:, 0], expected)


def test_protocol_errors_are_clear():
    w = torch.ones(6, 3)
    with pytest.raises(ValueError, match="missing"):
        normalize_layers([{"name": "l", "num_heads": 2, "spans": [{"param": w}]}])
    with pytest.raises(ValueError, match="fewer than num_heads"):
        normalize_layers(
            [
                {
                    "name": "l",
                    "num_heads": 2,
                    "spans": [{"param": w, "stride": 6, "start": 0, "length": 3, "power": 1.0}],
                }
            ]
        )
    with pytest.raises(ValueError, match="expected \\[1, num_heads\\]"):
        apply_qk_clip(normalize_layers([{"name": "l", "num_heads": 1, "spans": []}]), torch.zeros(2, 1), 1.0)


def test_param_routing():
    m = TinyMLAModel()
    groups = muonclip_param_groups(m)
    by_alg = {g["algorithm"]: {id(p) for p in g["params"]} for g in groups}
    assert id(m.embed_tokens.weight) in by_alg["adamw"]
    assert id(m.lm_head.weight) in by_alg["adamw"]
    assert all(id(n.weight) in by_alg["adamw"] for n in m.norms)
    assert id(m.gate.weight) in by_alg["muon"]  # router on Muon by default (Moonlight / K2)
    assert id(m.layers[0].q_proj.weight) in by_alg["muon"]
    groups = muonclip_param_groups(m, router="adamw")
    assert any(p is m.gate.weight for g in groups if g["algorithm"] == "adamw" for p in g["params"])
    with pytest.raises(ValueError, match="algorithm"):
        MuonClip([{"params": [m.gate.weight]}])


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    emb = nn.Parameter(torch.randn(10, 4))
    ref = nn.Parameter(emb.detach().clone())
    o1 = MuonClip(
        [{"params": [emb], "algorithm": "adamw"}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), tau=None
    )
    o2 = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(4):
        g = torch.randn(10, 4)
        emb.grad, ref.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(emb, ref, rtol=0, atol=1e-7)
