"""QK-Clip through the MHA/GQA hook adapter: plain PyTorch attention, torch.nn.MultiheadAttention, transformers."""

import copy
import math
import warnings

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
    before = [
        (a.logits(x).detach(), a.k_proj.weight.clone(), a.k_proj.bias.clone())
        for a, x in zip(model.attns, xs)
    ]
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
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attention_bias=True,
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
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="QK-norm"):
        attach_qk_clip(model)


def test_hf_deepseek_v3_routing_splits_fused_gate_up():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
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


# --- torch.nn.MultiheadAttention ------------------------------------------------------------------
# legend for this part: B batch, S query positions, T key positions, E embed dim, H heads, D head dim

_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")


class TorchMHAModel(nn.Module):
    """Parallel nn.MultiheadAttention layers in every layout (each reads the same normed embedding, so
    a clip in one layer cannot change another layer's input):
    0 packed, batch_first, bool causal attn_mask + is_causal=True + bool key_padding_mask
    1 packed, seq-first, float additive attn_mask [B*H, S, T] (-inf above the diagonal, finite
      values elsewhere) + float key_padding_mask
    2 separate q/k weights (kdim != E), batch_first, bool causal mask + key_padding_mask
    3 separate weights, seq-first, add_bias_kv + add_zero_attn, is_causal=True + key_padding_mask
    """

    def __init__(self, E=32, H=4, kdim=24, loud=4.0):
        super().__init__()
        self.H = H
        self.embed = nn.Embedding(50, E)
        self.mem = nn.Linear(E, kdim)  # keys/values of the separate-weight layers
        self.attns = nn.ModuleList(
            [
                nn.MultiheadAttention(E, H, batch_first=True),
                nn.MultiheadAttention(E, H, batch_first=False),
                nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=kdim),
                nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, add_bias_kv=True, add_zero_attn=True),
            ]
        )
        self.lm_head = nn.Linear(E, 50, bias=False)
        with torch.no_grad():  # make some heads loud: per-head scales so heads differ
            for a in self.attns:
                for w in _qk_weights(a):
                    w.mul_(torch.linspace(1.0, loud, H).repeat_interleave(E // H)[:, None])

    def forward(self, ids_BS, pad_BT):
        B, S = ids_BS.shape
        h = self.embed(ids_BS)
        x = F.rms_norm(h, (h.shape[-1],))
        m = self.mem(x)
        causal_SS = torch.ones(S, S, dtype=torch.bool).triu(1)  # True = not allowed
        add = torch.linspace(-1.0, 1.0, B * self.H * S * S).view(B * self.H, S, S)
        float_mask = add.masked_fill(causal_SS, -math.inf)
        float_pad = torch.zeros(B, S).masked_fill(pad_BT, -math.inf)
        xs, ms = x.transpose(0, 1), m.transpose(0, 1)
        a0, a1, a2, a3 = self.attns
        outs = [
            a0(x, x, x, key_padding_mask=pad_BT, need_weights=False, attn_mask=causal_SS, is_causal=True)[0],
            a1(xs, xs, xs, float_pad, False, float_mask)[0].transpose(0, 1),  # positional arguments
            a2(x, m, m, key_padding_mask=pad_BT, attn_mask=causal_SS)[0],
            a3(xs, ms, ms, key_padding_mask=pad_BT, attn_mask=causal_SS, is_causal=True)[0].transpose(0, 1),
        ]
        return self.lm_head(h + sum(outs))


def _qk_weights(a: nn.MultiheadAttention):
    E = a.embed_dim
    if a._qkv_same_embed_dim:
        return [a.in_proj_weight[:E], a.in_proj_weight[E : 2 * E]]
    return [a.q_proj_weight, a.k_proj_weight]


def _qk_rows(a: nn.MultiheadAttention):
    """Every tensor whose rows belong to heads' q or k: weights, biases, bias_k."""
    E = a.embed_dim
    rows = _qk_weights(a) + [a.in_proj_bias[:E], a.in_proj_bias[E : 2 * E]]
    return rows + ([a.bias_k.view(E)] if a.bias_k is not None else [])


def _mha_inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (2, 10), generator=g)
    pad = torch.zeros(2, 10, dtype=torch.bool)  # True = padding; key 0 stays, so no query row is empty
    pad[0, 4:7] = True  # (with these inputs the padding changes 3 of the 4 layers' max logits)
    pad[1, 2:] = True
    return ids, pad


def _reference_logits(a: nn.MultiheadAttention, args, kwargs):
    """By hand from the module's parameters: (q.k / sqrt(D) with -inf on disallowed pairs [B, H, S, T'],
    the same plus the float masks' additive values, which is what softmax sees)."""
    inp = dict(zip(_MHA_ARGS, args)) | kwargs
    E, H = a.embed_dim, a.num_heads
    D = E // H
    query, key = inp["query"], inp["key"]
    if not a.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    B, S, T = query.shape[0], query.shape[1], key.shape[1]
    w_q, w_k = _qk_weights(a)
    q_BSE = torch.einsum("bse,fe->bsf", query, w_q) + a.in_proj_bias[:E]
    k_BTE = torch.einsum("bte,fe->btf", key, w_k) + a.in_proj_bias[E : 2 * E]
    if a.bias_k is not None:
        k_BTE = torch.cat([k_BTE, a.bias_k.expand(B, 1, E)], dim=1)
    if a.add_zero_attn:
        k_BTE = torch.cat([k_BTE, torch.zeros(B, 1, E)], dim=1)
    logits = torch.einsum("bshd,bthd->bhst", q_BSE.view(B, S, H, D), k_BTE.view(B, -1, H, D)) / math.sqrt(D)
    masked = torch.zeros_like(logits, dtype=torch.bool)
    additive = torch.zeros_like(logits)
    am, kpm = inp.get("attn_mask"), inp.get("key_padding_mask")
    if am is not None:
        am = am.view(1, 1, S, T) if am.dim() == 2 else am.view(B, H, S, T)
        masked[..., :T] |= am if am.dtype == torch.bool else am == -math.inf
        if am.is_floating_point():
            additive[..., :T] += am.masked_fill(am == -math.inf, 0.0)
    if kpm is not None:
        masked[..., :T] |= (kpm if kpm.dtype == torch.bool else kpm == -math.inf)[:, None, None, :]
    logits = logits.masked_fill(masked, -math.inf)
    return logits, logits + additive


def _capture_calls(mods, run):
    calls = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append((mod, args, kwargs)), with_kwargs=True
        )
        for m in mods
    ]
    run()
    for h in hooks:
        h.remove()
    return calls


def test_torch_mha_records_true_max_logits():
    torch.manual_seed(0)
    model = TorchMHAModel()
    adapter = attach_qk_clip(model)  # found automatically
    assert [layer["name"] for layer in adapter.qk_clip_layers()] == [f"attns.{i}" for i in range(4)]
    ids, pad = _mha_inputs()
    calls = _capture_calls(model.attns, lambda: model(ids, pad).logsumexp(-1).mean().backward())
    S_LH = adapter.attention_max_logits()
    with torch.no_grad():
        refs = [_reference_logits(a, args, kwargs) for a, args, kwargs in calls]
        ref_LH = torch.stack([logits.amax(dim=(0, 2, 3)) for logits, _ in refs])
        torch.testing.assert_close(S_LH, ref_LH, rtol=1e-5, atol=1e-5)
        # the reference's masks mean what PyTorch's do: its softmax is the module's attention weights
        for (a, args, kwargs), (_, with_additive) in zip(calls, refs):
            inp = dict(zip(_MHA_ARGS, args)) | kwargs | {"need_weights": True, "average_attn_weights": False}
            _, w_BHST = a(**inp)
            torch.testing.assert_close(w_BHST, with_additive.softmax(-1), rtol=1e-5, atol=1e-6)
    model.eval()  # eval-mode forwards are not recorded
    adapter.reset_attention_max_logits()
    with torch.no_grad():
        model(ids, pad)
    assert adapter.attention_max_logits().max() < -1e30


def test_torch_transformer_encoder_is_found():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
    adapter = attach_qk_clip(enc)
    x = torch.randn(2, 10, 32)
    _, pad = _mha_inputs()
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)
    mods = [layer.self_attn for layer in enc.layers]
    calls = _capture_calls(mods, lambda: enc(x, mask=mask, src_key_padding_mask=pad, is_causal=True))
    with torch.no_grad():
        ref_LH = torch.stack([_reference_logits(a, args, kw)[0].amax(dim=(0, 2, 3)) for a, args, kw in calls])
    torch.testing.assert_close(adapter.attention_max_logits(), ref_LH, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lr", [0.0, 0.02])
def test_muonclip_clips_torch_mha_heads_to_tau(lr):
    torch.manual_seed(0)
    model = TorchMHAModel()
    ref = copy.deepcopy(model)  # the same step without QK-Clip
    qk, qk_ref = attach_qk_clip(model), attach_qk_clip(ref)
    ids, pad = _mha_inputs()
    for m in (model, ref):
        m(ids, pad).logsumexp(-1).mean().backward()
    S_LH = qk.attention_max_logits()
    assert torch.equal(S_LH, qk_ref.attention_max_logits())
    tau = float(S_LH.flatten().median())
    clipped = S_LH > tau
    assert clipped.any() and (~clipped).any()
    opt = MuonClip(model, lr=lr, weight_decay=0.1, tau=tau, qk_clip=qk)
    opt_ref = MuonClip(ref, lr=lr, weight_decay=0.1, tau=None)
    E = model.attns[0].embed_dim
    packed = {id(a.in_proj_weight) for a in model.attns if a.in_proj_weight is not None}
    assert [
        tuple(g["split_sizes"]) for g in opt.param_groups if any(id(p) in packed for p in g["params"])
    ] == [(E, E, E)]  # the packed in_proj_weight is Muon'd as its three matrices
    opt.step()
    opt_ref.step()
    assert opt.last_clip_stats()["num_clipped"] == int(clipped.sum())
    gamma_LH = tau / S_LH
    D = E // model.H
    for l, (a, r) in enumerate(zip(model.attns, ref.attns)):
        for w, w_ref in zip(_qk_rows(a), _qk_rows(r)):  # the in-place scaling reached the real parameters
            for h in range(model.H):
                rows, rows_ref = w[h * D : (h + 1) * D], w_ref[h * D : (h + 1) * D]
                if clipped[l, h]:
                    torch.testing.assert_close(rows, rows_ref * gamma_LH[l, h] ** 0.5, rtol=1e-6, atol=0)
                else:
                    assert torch.equal(rows, rows_ref)  # bit-identical to Muon's update alone
        if a._qkv_same_embed_dim:
            assert torch.equal(a.in_proj_weight[2 * E :], r.in_proj_weight[2 * E :])  # value rows untouched
        else:
            assert torch.equal(a.v_proj_weight, r.v_proj_weight)
    # a fresh training forward: every layer sees the same input in both models (parallel layers, and
    # the embedding's update does not depend on the clip), so a clipped head's logit is gamma x Muon's
    qk_ref.reset_attention_max_logits()  # (MuonClip reset qk's record after its clip)
    for m in (model, ref):
        m(ids, pad)
    after, after_ref = qk.attention_max_logits(), qk_ref.attention_max_logits()
    for l in range(4):
        for h in range(model.H):
            if clipped[l, h]:
                assert after[l, h].item() == pytest.approx(
                    gamma_LH[l, h].item() * after_ref[l, h].item(), rel=1e-4
                )
                if lr == 0.0:
                    assert after[l, h].item() == pytest.approx(tau, rel=1e-4)
            else:
                assert after[l, h].item() == after_ref[l, h].item()


class _NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.lm_head = nn.Linear(16, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + self.mlp(h))


def test_no_attention_error_lists_what_to_expose():
    with pytest.raises(ValueError) as e:
        attach_qk_clip(_NoAttention())
    msg = str(e.value)
    for needed in (
        "q_proj",
        "k_proj",
        "nn.Linear",
        "head_dim",
        "num_heads",
        "num_key_value_heads",
        "scaling",
        "is_causal",
        "nn.MultiheadAttention",
        "attention_max_logits",
        "reset_attention_max_logits",
        "qk_clip_layers",
    ):
        assert needed in msg, needed
    # a module passed explicitly that is no attention: the same guidance, no AttributeError
    with pytest.raises(ValueError, match="q_proj/k_proj nn.Linear"):
        attach_qk_clip(_NoAttention(), attention_modules=[_NoAttention().mlp])

    class NoHeadDim(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(16, 16), nn.Linear(16, 16)

    with pytest.raises(ValueError, match="head_dim"):
        attach_qk_clip(NoHeadDim())
    m = NoHeadDim()
    m.num_heads = 4  # stands in for head_dim = 16 / 4
    assert attach_qk_clip(m).qk_clip_layers()[0]["num_heads"] == 4
    m.head_dim, m.num_key_value_heads = 4, 2  # k_proj gives 4 key heads of head_dim 4
    with pytest.raises(ValueError, match="num_key_value_heads = 2"):
        attach_qk_clip(m)
    mha = nn.MultiheadAttention(16, 2)
    assert attach_qk_clip(nn.ModuleList([mha]), attention_modules=[mha]).qk_clip_layers()[0]["num_heads"] == 2


def test_muonclip_without_qk_clip_source_warns_once():
    torch.manual_seed(0)
    model = _NoAttention()
    ids = torch.randint(0, 50, (2, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = MuonClip(model, lr=1e-3, tau=10.0)
        for _ in range(3):
            model(ids).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
    msgs = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum("QK-Clip is off" in m for m in msgs) == 1, msgs
    assert opt.last_clip_stats() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MuonClip(model, lr=1e-3, tau=None)  # tau=None: no warning
