"""QK-Clip through the MHA/GQA hook adapter: a plain PyTorch attention and transformers' Llama."""

import math

import pytest
import torch
import torch.nn.functional as F
from k2_optim import MuonClip, attach_qk_clip
from torch import nn

# legend: B batch, S positions, D hidden, H query heads, K kv heads, E head dim


class PlainAttention(nn.Module):
    """Causal MHA/GQA without RoPE, with q/k biases; `logits()` is the reference."""

    def __init__(self, D=32, H=4, K=4, E=8, bias=True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, E
        self.scaling = E**-0.5
        self.q_proj = nn.Linear(D, H * E, bias=bias)
        self.k_proj = nn.Linear(D, K * E, bias=bias)
        self.v_proj = nn.Linear(D, K * E, bias=bias)
        self.o_proj = nn.Linear(H * E, D, bias=False)

    def logits(self, x_BSD):
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        return (q @ k.transpose(-1, -2) * self.scaling).masked_fill(~causal, -math.inf)

    def forward(self, x_BSD):
        B, S, _ = x_BSD.shape
        v = self.v_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        out = self.logits(x_BSD).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2))


class PlainModel(nn.Module):
    def __init__(self, K=4, layers=2, D=32):
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.attns = nn.ModuleList(PlainAttention(D, 4, K) for _ in range(layers))
        self.lm_head = nn.Linear(D, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for a in self.attns:
            h = h + a(F.rms_norm(h, (h.shape[-1],)))
        return self.lm_head(h)


def _capture(model, mods, run):
    xs = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach().clone())) for m in mods]
    run()
    for h in hooks:
        h.remove()
    return xs


@pytest.mark.parametrize("K", [4, 2])  # MHA, GQA
def test_plain_attention_exactness(K):
    torch.manual_seed(0)
    model = PlainModel(K=K)
    with torch.no_grad():
        for a in model.attns:
            a.q_proj.weight.mul_(8.0)
            a.k_proj.weight.mul_(8.0)
    adapter = attach_qk_clip(model)
    ids = torch.randint(0, 50, (2, 10))
    xs = _capture(model, model.attns, lambda: model(ids).logsumexp(-1).mean().backward())
    S_LH = adapter.attention_max_logits()
    ref = torch.stack([a.logits(x).amax(dim=(0, 2, 3)) for a, x in zip(model.attns, xs)]).detach()
    torch.testing.assert_close(S_LH, ref, rtol=1e-6, atol=1e-6)  # the hook records the true max logits
    tau = float(S_LH.flatten().median())
    clipped = S_LH > tau
    before = [(a.logits(x).detach(), a.k_proj.weight.clone(), a.k_proj.bias.clone()) for a, x in zip(model.attns, xs)]
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau, qk_clip=adapter)
    opt.step()
    for l, (a, x) in enumerate(zip(model.attns, xs)):
        after = a.logits(x).detach()
        for h in range(4):
            if clipped[l, h]:
                assert after[:, h].max().item() == pytest.approx(tau, rel=2e-6)
            else:
                assert torch.equal(after[:, h], before[l][0][:, h])
        if K < 4:  # GQA: the shared key head is never touched
            assert torch.equal(a.k_proj.weight, before[l][1]) and torch.equal(a.k_proj.bias, before[l][2])
    assert opt.last_clip_stats()["num_clipped"] == int(clipped.sum())
    # eval-mode forwards are not recorded
    model.eval()
    model(ids)
    assert adapter.attention_max_logits().max() < -1e30


def _tiny_llama(attn="eager", kv_heads=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, attention_bias=True,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 1.0)
            layer.self_attn.k_proj.weight.normal_(0, 1.0)
    return model


class _EagerRecorder:
    """Reference: wraps transformers' own eager attention and records q.k * scaling + mask."""

    def __init__(self, monkeypatch):
        from transformers.models.llama import modeling_llama

        self.logits = []
        orig = modeling_llama.eager_attention_forward

        def wrapped(module, query, key, value, attention_mask, scaling, **kw):
            k = modeling_llama.repeat_kv(key, module.num_key_value_groups)
            w = query @ k.transpose(2, 3) * scaling
            if attention_mask is not None:
                w = w.masked_fill(attention_mask[..., : k.shape[-2]] < -1e30, -math.inf)
            self.logits.append(w.detach())
            return orig(module, query, key, value, attention_mask, scaling=scaling, **kw)

        monkeypatch.setattr(modeling_llama, "eager_attention_forward", wrapped)


@pytest.mark.parametrize("kv_heads,block_elems", [(4, 1 << 24), (2, 1 << 24), (2, 300)])
def test_hf_llama_adapter_records_true_max_logits_and_clips_exactly(monkeypatch, kv_heads, block_elems):
    from k2_optim import adapters

    monkeypatch.setattr(adapters, "LOGIT_BLOCK_ELEMS", block_elems)  # 300: query blocks of 2 rows
    model = _tiny_llama("eager", kv_heads)
    model.train()
    rec = _EagerRecorder(monkeypatch)
    adapter = attach_qk_clip(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    S_LH = adapter.attention_max_logits()
    ref = torch.stack([w.amax(dim=(0, 2, 3)) for w in rec.logits])
    torch.testing.assert_close(S_LH, ref, rtol=1e-5, atol=1e-5)  # RoPE + causal mask reproduced
    tau = float(S_LH[0].median())
    clipped0 = S_LH[0] > tau
    k0 = model.model.layers[0].self_attn.k_proj.weight.clone()
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau, qk_clip=adapter)
    opt.step()
    rec.logits.clear()
    with torch.no_grad():
        model(input_ids=ids)  # layer 0 sees the same input (lr = 0): compare its logits
    before, after = ref[0], rec.logits[0].amax(dim=(0, 2, 3))
    for h in range(4):
        if clipped0[h]:
            assert after[h].item() == pytest.approx(tau, rel=1e-5)
        else:
            assert after[h].item() == before[h].item()
    if kv_heads < 4:
        assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, k0)


def test_hf_llama_sdpa_matches_eager_recording():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    maxes = []
    for impl in ("eager", "sdpa"):
        model = _tiny_llama(impl)
        model.train()
        adapter = attach_qk_clip(model)
        model(input_ids=ids)
        maxes.append(adapter.attention_max_logits())
    torch.testing.assert_close(maxes[0], maxes[1], rtol=1e-5, atol=1e-5)


def test_qk_norm_model_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="QK-norm"):
        attach_qk_clip(model)


def test_hf_deepseek_v3_routing_splits_fused_gate_up():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with pytest.warns(UserWarning, match="QK-Clip is off"):
        MuonClip(model, lr=1e-3)  # tau set, but no protocol and no adapter: say so
    opt = MuonClip(model, lr=1e-3, tau=None)
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
    gate_up = by_name["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up["algorithm"] == "muon" and tuple(gate_up["split_sizes"]) == (16, 16)
    assert by_name["model.layers.1.mlp.gate.weight"]["algorithm"] == "muon"
    assert by_name["model.embed_tokens.weight"]["algorithm"] == "adamw"
    assert by_name["lm_head.weight"]["algorithm"] == "adamw"
    assert by_name["model.layers.0.self_attn.kv_a_layernorm.weight"]["algorithm"] == "adamw"
    assert by_name["model.layers.0.self_attn.kv_b_proj.weight"]["algorithm"] == "muon"
