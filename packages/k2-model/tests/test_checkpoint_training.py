"""FP8 block dequantisation, MTP skipping, checkpoint errors; max-logit recording, the QK-Clip
spans, and aux-loss-free balancing."""

from __future__ import annotations

import gc
import json
import logging
import math

import pytest
import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.checkpoint import dequantize_fp8_blocks
from safetensors.torch import load_file, save_file


def small_config(**kw) -> K2Config:
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32,
                kv_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                intermediate_size=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)  # fmt: skip
    base.update(kw)
    return K2Config.preset("tiny", **base)


# ------------------------------------------------------------------------------------------- FP8
def test_fp8_block_dequant_matches_hand_computation_with_partial_edges() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 300, generator=g) * 50).to(torch.float8_e4m3fn)  # 2 x 3 blocks, last ones partial
    s = torch.rand(2, 3, generator=g) + 0.5
    ref = torch.empty(200, 300)
    for i in range(2):
        for j in range(3):
            rows, cols = slice(128 * i, min(128 * (i + 1), 200)), slice(128 * j, min(128 * (j + 1), 300))
            ref[rows, cols] = w[rows, cols].float() * s[i, j]
    assert torch.equal(dequantize_fp8_blocks(w, s), ref)
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequantize_fp8_blocks(w, s[:, :2])


def _quantize_fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, m = w.shape
    a, b = math.ceil(n / block), math.ceil(m / block)
    scale = torch.empty(a, b)
    for i in range(a):
        for j in range(b):
            tile = w[block * i : block * (i + 1), block * j : block * (j + 1)]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :m]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_load_fp8_checkpoint_with_mtp_layer(tmp_path, caplog) -> None:
    """A released-style checkpoint: FP8 2-D weights with scales, an MTP layer, 2 shards + index."""
    cfg = small_config(hidden_size=160, q_lora_rank=136)  # non-multiples of 128: partial edge blocks
    torch.manual_seed(0)
    src = K2ForCausalLM(cfg)
    src.save_pretrained(str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    quantised, expected = {}, {}
    for name, t in sd.items():
        if t.dim() == 2 and name.endswith("proj.weight") and "layernorm" not in name:
            q, s = _quantize_fp8_blocks(t)
            quantised[name], quantised[name + "_scale_inv"] = q, s
            expected[name] = dequantize_fp8_blocks(q, s)
        else:
            quantised[name] = expected[name] = t
    # an MTP layer (model.layers.{num_hidden_layers}) as released DeepSeek-V3 checkpoints have
    quantised["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)
    quantised["model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    quantised["model.layers.2.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    names = sorted(quantised)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: quantised[k].contiguous() for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(hf))

    with caplog.at_level(logging.WARNING, logger="k2_model"):
        model = K2ForCausalLM.from_pretrained(str(tmp_path))
    assert any("multi-token-prediction" in r.message for r in caplog.records)
    got = dict(model.state_dict())
    for name, ref in expected.items():
        if ".mlp.experts." in name:
            prefix, j, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            assert torch.equal(got[f"{prefix}.{proj}"][j], ref), name
        else:
            assert torch.equal(got[name], ref), name
    # dequantised weights are close to the originals (FP8 e4m3 has a 3-bit mantissa)
    w0 = src.model.layers[0].self_attn.q_a_proj.weight
    w1 = model.model.layers[0].self_attn.q_a_proj.weight
    assert float((w1 - w0).detach().norm() / w0.detach().norm()) < 0.05


def test_checkpoint_errors_name_tensor_and_shape(tmp_path) -> None:
    cfg = small_config()
    K2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    missing = dict(sd)
    missing.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight \(32, 64\)"
    ):
        K2ForCausalLM.from_pretrained(str(tmp_path))
    extra = dict(sd, **{"model.layers.0.self_attn.bogus.weight": torch.zeros(3, 5)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"unexpected tensor model\.layers\.0\.self_attn\.bogus\.weight \(3, 5\)"
    ):
        K2ForCausalLM.from_pretrained(str(tmp_path))
    wrong = dict(sd, **{"lm_head.weight": torch.zeros(128, 63)})
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lm_head\.weight: checkpoint shape \(128, 63\) != model shape \(128, 64\)"
    ):
        K2ForCausalLM.from_pretrained(str(tmp_path))


# ------------------------------------------------------------------------------------ max logits
def _explicit_max_logits(model: K2ForCausalLM, ids: torch.Tensor, allowed_BSL: torch.Tensor) -> torch.Tensor:
    """Materialise every head's scaled q.k over the allowed pairs, from the weights, independently
    of the attention code path: rope written as an explicit 2x2 rotation per interleaved pair."""
    cfg = model.config
    P, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    B, S = ids.shape
    out = []
    h = model.model.embed_tokens(ids)
    pos = torch.arange(S, dtype=torch.float32)
    inv_freq = model.model.rope_inv_freq
    ang_SR2 = pos[:, None] * inv_freq[None, :]
    for layer in model.model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(B, S, -1, P + R)
        ckv = a.kv_a_proj_with_mqa(x)
        k_nope = a.kv_b_proj(a.kv_a_layernorm(ckv[..., : cfg.kv_lora_rank])).view(
            B, S, -1, P + cfg.v_head_dim
        )[..., :P]
        k_rope = ckv[..., cfg.kv_lora_rank :]

        def rot(v: torch.Tensor) -> torch.Tensor:  # v [..., S, (h,) R] interleaved pairs
            c, s = torch.cos(ang_SR2), torch.sin(ang_SR2)
            if v.dim() == 4:
                c, s = c[:, None, :], s[:, None, :]
            x0, x1 = v[..., 0::2], v[..., 1::2]
            return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

        qr, kr = rot(q[..., P:]), rot(k_rope)
        logits = torch.einsum("bshp,bthp->bhst", q[..., :P], k_nope) + torch.einsum("bshr,btr->bhst", qr, kr)
        logits = logits * cfg.softmax_scale
        out.append(logits.masked_fill(~allowed_BSL[:, None], -math.inf).amax(dim=(0, 2, 3)))
        h = _layer_forward(model, layer, h, allowed_BSL)
    return torch.stack(out)


def _layer_forward(model: K2ForCausalLM, layer, h: torch.Tensor, allowed_BSL: torch.Tensor) -> torch.Tensor:
    from k2_model.rope import rope_cos_sin

    B, S, _ = h.shape
    cos, sin = rope_cos_sin(model.model.rope_inv_freq, torch.arange(S)[None].expand(B, S), 1.0)
    was = layer.training
    layer.eval()  # no recording from this helper
    impl, layer.self_attn.attn_impl = layer.self_attn.attn_impl, "sdpa"  # any masked path propagates h
    out = layer(h, cos, sin, allowed_BSL)
    layer.train(was)
    layer.self_attn.attn_impl = impl
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager", "fused"])
def test_max_logits_match_explicit_computation(impl: str) -> None:
    cfg = small_config()
    torch.manual_seed(1)
    model = K2ForCausalLM(cfg)
    with torch.no_grad():  # big weights so logits are far from zero and differ per head
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(20)
            layer.self_attn.kv_b_proj.weight.mul_(20)
    model.set_attention_impl(impl)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    model.eval()
    with torch.no_grad():
        model(ids)
    assert torch.isinf(model.attention_max_logits()).all()  # eval forwards do not record
    model.train()
    with torch.no_grad():
        model(ids[:1])
        model(ids[1:])  # two micro-batches: the running max covers both
        got = model.attention_max_logits()
        want = _explicit_max_logits(
            model, ids, torch.ones(24, 24, dtype=torch.bool).tril()[None].expand(2, 24, 24)
        )
    assert got.shape == (2, 2) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # document masking: a second document starting at position 10 (positions restart too)
    model.reset_attention_max_logits()
    doc = (torch.arange(24) >= 10).long()[None].expand(2, 24)
    with torch.no_grad():
        model(ids, document_ids=doc)
    allowed = torch.ones(24, 24, dtype=torch.bool).tril() & (doc[0][:, None] == doc[0][None, :])
    # positions are 0..23 here (not restarted), so the explicit reference uses the same rope angles
    want_doc = _explicit_max_logits(model, ids, allowed[None].expand(2, 24, 24))
    torch.testing.assert_close(model.attention_max_logits(), want_doc, rtol=1e-5, atol=1e-4)


def test_qk_clip_spans_scale_one_heads_logits_by_gamma() -> None:
    """Apply the protocol by hand for head 1 of layer 0 with gamma 0.5: its max logit halves,
    head 0 is unchanged (the shared rotary key and the values are not listed)."""
    cfg = small_config()
    torch.manual_seed(2)
    model = K2ForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        model(ids)
    before = model.attention_max_logits()[0].clone()
    entry = model.qk_clip_layers()[0]
    assert entry["num_heads"] == 2 and entry["name"] == "model.layers.0.self_attn"
    assert [(s["stride"], s["start"], s["length"], s["power"]) for s in entry["spans"]] == [
        (192, 0, 128, 0.5), (192, 128, 64, 1.0), (256, 0, 128, 0.5)
    ]  # fmt: skip
    gamma, h = 0.5, 1
    with torch.no_grad():
        for s in entry["spans"]:
            r0 = h * s["stride"] + s["start"]
            s["param"][r0 : r0 + s["length"]] *= gamma ** s["power"]
    model.reset_attention_max_logits()
    with torch.no_grad():
        model.model.layers[0].self_attn.train()
        model(ids)
    after = model.attention_max_logits()[0]
    torch.testing.assert_close(after[0], before[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after[1], before[1] * gamma, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ load balancing
def test_expert_load_counts_and_bias_update_direction() -> None:
    cfg = small_config()
    torch.manual_seed(3)
    model = K2ForCausalLM(cfg).train()
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():  # make expert 0 very popular, so the step must push its bias down
        router.weight[0] = 0.0
        router.e_score_correction_bias.copy_(torch.linspace(0.3, -0.3, cfg.n_routed_experts))
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    captured = {}

    def keep_first(module, inputs, output) -> None:
        captured.setdefault("logits", output.detach())

    hook = router.register_forward_hook(keep_first)
    model(ids)  # micro-batch 1
    model(ids[:1])  # micro-batch 2 (no hook capture needed: counts must add up)
    hook.remove()
    from k2_kernels import reference

    idx, _ = reference.moe_route(captured["logits"], router.e_score_correction_bias, cfg.num_experts_per_tok)
    first = torch.bincount(idx.flatten(), minlength=cfg.n_routed_experts).float()
    load = model.expert_load()[0]
    assert load.sum() == 3 * 32 * cfg.num_experts_per_tok  # 96 tokens, top-2
    assert torch.all(load >= first)
    bias_before = router.e_score_correction_bias.clone()
    step = 1e-3
    returned = model.update_expert_bias(step)
    torch.testing.assert_close(returned[0], load)
    delta = router.e_score_correction_bias - bias_before
    mean = load.mean()
    expected = step * torch.sign(mean - load)
    torch.testing.assert_close(delta, expected, rtol=0, atol=1e-7)
    assert delta[load.argmax()] < 0 and delta[load.argmin()] > 0  # toward under-loaded experts
    assert model.expert_load().sum() == 0  # counts reset
    # eval forwards do not count
    model.eval()
    with torch.no_grad():
        model(ids)
    assert model.expert_load().sum() == 0


def test_blockwise_eager_attention_equals_sdpa_with_masks() -> None:
    """The eager path computes causal query blocks (S=200: 4 blocks of 64 + a partial one); with
    document and padding masks it must equal SDPA in outputs, gradients and recorded max logits."""
    cfg = small_config()
    torch.manual_seed(4)
    model = K2ForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 200))
    doc = (torch.arange(200) >= 70).long()[None].expand(2, 200).clone()
    doc[1] = (torch.arange(200) >= 130).long()
    pad = torch.ones(2, 200, dtype=torch.long)
    pad[1, 190:] = 0
    results = {}
    for impl in ("sdpa", "eager"):
        model.set_attention_impl(impl)
        model.zero_grad()
        model.reset_attention_max_logits()
        out = model(ids, labels=ids, attention_mask=pad, document_ids=doc)
        out.loss.backward()
        grad = model.model.layers[0].self_attn.q_b_proj.weight.grad.clone()
        results[impl] = (out.logits.detach(), grad, model.attention_max_logits())
    (a_logits, a_grad, a_max), (b_logits, b_grad, b_max) = results["sdpa"], results["eager"]
    assert float((b_logits - a_logits).norm() / a_logits.norm()) < 1e-6
    assert float((b_grad - a_grad).norm() / a_grad.norm()) < 1e-5
    torch.testing.assert_close(b_max, a_max, rtol=1e-6, atol=1e-6)


def test_fused_attention_equals_sdpa_with_documents(monkeypatch) -> None:
    """The fused kernel path (packed documents as cu_seqlens) equals SDPA with the document mask
    in outputs, gradients and recorded max logits; a padding mask makes 'auto' leave it."""
    from k2_model.model import PackedSegments, fused_attention_available

    cfg = small_config()
    if not fused_attention_available(
        torch.device("cpu"), cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    ):
        pytest.skip("compiled k2_kernels attention not available")
    torch.manual_seed(5)
    model = K2ForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 150))
    doc = (torch.arange(150) >= 40).long()[None].expand(2, 150).clone()
    doc[1] = (torch.arange(150) >= 101).long() + (torch.arange(150) >= 120).long()
    seg = PackedSegments.from_document_ids(doc)
    assert (
        seg is not None and seg.cu_seqlens.tolist() == [0, 40, 150, 251, 270, 300] and seg.max_seqlen == 110
    )
    results = {}
    import k2_model.model as k2m

    build_mask = k2m.build_attention_mask
    for impl in ("sdpa", "fused"):
        model.set_attention_impl(impl)
        model.zero_grad()
        model.reset_attention_max_logits()
        if impl == "fused":  # packed documents need no [B, S, S] mask on the fused path
            monkeypatch.setattr(k2m, "build_attention_mask", lambda *a: pytest.fail("mask built"))
        out = model(ids, labels=ids, document_ids=doc)
        monkeypatch.setattr(k2m, "build_attention_mask", build_mask)
        out.loss.backward()
        grad = model.model.layers[0].self_attn.q_b_proj.weight.grad.clone()
        results[impl] = (out.logits.detach(), grad, model.attention_max_logits())
    (a_logits, a_grad, a_max), (b_logits, b_grad, b_max) = results["sdpa"], results["fused"]
    assert float((b_logits - a_logits).norm() / a_logits.norm()) < 1e-5
    assert float((b_grad - a_grad).norm() / a_grad.norm()) < 1e-5
    torch.testing.assert_close(b_max, a_max, rtol=1e-5, atol=1e-5)
    # an id that returns after another document is not a set of runs: no packed form
    assert PackedSegments.from_document_ids(torch.tensor([[0, 0, 1, 1, 0]])) is None
    model.set_attention_impl("fused")
    with pytest.raises(ValueError, match="padding mask"):
        model(ids, attention_mask=torch.ones_like(ids))


def test_cpu_kernels_are_chosen_only_with_openblas(monkeypatch) -> None:
    """On the built-in GEMM (no k2-kernels[blas]) 'auto' keeps the masked attention paths and
    new models keep torch._grouped_mm experts; an explicit 'fused' still runs the kernel."""
    from k2_kernels import _lib
    from k2_model.model import fused_attention_available

    cfg = small_config()
    monkeypatch.setattr(_lib, "BLAS", "builtin")
    assert not fused_attention_available(torch.device("cpu"), 192, 128)
    model = K2ForCausalLM(cfg)
    assert not any(getattr(m, "use_k2_kernel", False) for m in model.modules())
    attn = model.model.layers[0].self_attn
    assert attn._resolve_impl(torch.device("cpu"), None, None) in ("eager", "sdpa")
    model.set_attention_impl("fused")
    assert attn._resolve_impl(torch.device("cpu"), None, None) == "fused"


def _dist_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        model = K2ForCausalLM(small_config()).train()
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank))  # own data
        model(ids)
        local = model.expert_load().clone()
        load = model.update_expert_bias(1e-3)
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
        torch.save({"local": local, "load": load, "bias": bias}, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()
        gc.collect()  # gloo's threads joined now, not in static destructors at exit (docs/training.md)


@pytest.mark.dist
def test_bias_update_all_reduces_loads_over_ranks(tmp_path) -> None:
    """Two gloo ranks with different data: both see the summed load and make the same bias step."""
    import torch.multiprocessing as mp

    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    total = r0["local"] + r1["local"]
    assert not torch.equal(r0["local"], r1["local"])  # the ranks did see different tokens
    torch.testing.assert_close(r0["load"], total)
    torch.testing.assert_close(r1["load"], total)
    expected = 1e-3 * torch.sign(total[0].mean() - total[0])
    torch.testing.assert_close(r0["bias"], expected, rtol=0, atol=1e-9)
    torch.testing.assert_close(r1["bias"], expected, rtol=0, atol=1e-9)


def test_explicit_3d_attention_mask_equals_the_masks_it_spells_out() -> None:
    """A [B, S, S] "may attend" matrix is taken as given: spelling out causal-within-documents
    with padding gives the logits of `document_ids` + `attention_mask`; a wrong shape is refused."""
    cfg = small_config()
    torch.manual_seed(5)
    model = K2ForCausalLM(cfg).eval()
    S = 40
    ids = torch.randint(0, cfg.vocab_size, (2, S))
    doc = (torch.arange(S) >= 15).long()[None].expand(2, S).clone()
    pad = torch.ones(2, S, dtype=torch.long)
    pad[1, 35:] = 0
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & (doc.unsqueeze(2) == doc.unsqueeze(1))
    allowed &= pad.bool().unsqueeze(1)
    with torch.no_grad():
        want = model(ids, attention_mask=pad, document_ids=doc).logits
        got = model(ids, attention_mask=allowed).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="3-D attention_mask"):
        model(ids, attention_mask=allowed[:, :, :-1])
