"""k2_model.engine against full recomputation with the model's forward (fp32, tiny random models).

Tolerances: decode logits (absorbed vs expanded, and vs the full forward) relative Frobenius
error <= 1e-5; logprobs absolute 1e-4 (fp32 log_softmax over 512 tokens); greedy tokens equal
token for token.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, MLACache, SamplingParams, decode, prefill, process_logits, sample

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,  # prompts + generation run past it
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,  # != mscale: cos/sin and the softmax scale both change
}


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models run on one intra-op thread


def make_model(yarn: bool = False, q_lora: bool = True, seed: int = 0) -> K2ForCausalLM:
    cfg = K2Config.preset(
        "tiny", vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
        q_lora_rank=32 if q_lora else None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=24, moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256, rope_scaling=YARN if yarn else None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = K2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the init, so every path matters and argmax margins are wide
        for p in model.parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if p.dim() == 1
                else 0.1 * torch.randn(p.shape, generator=g)
            )
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn(b.shape, generator=g))
    return model


def prompts_of(lengths: list[int], vocab: int = 512, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy_recompute(model: K2ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=model.lm_head.weight.device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("yarn,q_lora", [(False, True), (True, True), (True, False)])
def test_greedy_with_cache_equals_full_recomputation(yarn: bool, q_lora: bool) -> None:
    model = make_model(yarn, q_lora)
    engine = Engine(model, max_batch_size=8)
    prompts = prompts_of([3, 9, 17, 30, 5])
    max_tokens = [12, 20, 8, 15, 10]
    greedy = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    ids = [engine.add_request(prompts[i], greedy[i]) for i in range(2)]
    done = {}
    for step in range(60):
        if step == 3:  # two requests join mid-way; later, short ones leave first (slot compaction)
            ids += [engine.add_request(prompts[i], greedy[i]) for i in (2, 3)]
        if step == 6:
            ids.append(engine.add_request(prompts[4], greedy[4]))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.completion
        if len(done) == len(prompts):
            break
    assert len(done) == len(prompts)
    for i, rid in enumerate(ids):
        c = done[rid]
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens[i]
        assert c.token_ids == greedy_recompute(model, prompts[i], max_tokens[i]), f"prompt {i}"


@pytest.mark.parametrize("yarn", [False, True])
def test_absorbed_decode_equals_expanded_and_full_forward(yarn: bool) -> None:
    model = make_model(yarn)
    cfg = model.config
    prompts = prompts_of([7, 19, 26])
    nxt = [11, 3, 500]
    caches = []
    tables = [[0, 1], [2, 3], [4, 5]]  # 16-token blocks: each prompt plus its next token fits in two
    for _ in range(2):
        cache = MLACache(
            cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, max_blocks=8, initial_blocks=8
        )
        prefill(model, cache, prompts, [0, 0, 0], tables)
        caches.append(cache)
    pos = torch.tensor([len(p) for p in prompts])
    absorbed = decode(model, caches[0], torch.tensor(nxt), pos, tables, attention="absorbed")
    expanded = decode(model, caches[1], torch.tensor(nxt), pos, tables, attention="expanded")
    assert rel_err(absorbed, expanded) <= 1e-5
    # the rows written: equal in layer 0 (same input), equal to fp32 rounding in later layers
    assert torch.equal(caches[0].kv_LyBbK[0], caches[1].kv_LyBbK[0])
    assert rel_err(caches[0].kv_LyBbK, caches[1].kv_LyBbK) <= 1e-6
    with torch.no_grad():
        for i, p in enumerate(prompts):
            full = model(torch.tensor([p + [nxt[i]]])).logits[0, -1]
            assert rel_err(absorbed[i], full) <= 1e-5
            assert rel_err(expanded[i], full) <= 1e-5


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (7, 1.0), (0, 0.8), (20, 0.9)])
def test_logprobs_equal_forward_log_softmax(top_k: int, top_p: float) -> None:
    model = make_model(yarn=True)
    engine = Engine(model)
    prompts = prompts_of([6, 13])
    T = 0.7
    params = SamplingParams(max_tokens=10, temperature=T, top_k=top_k, top_p=top_p, seed=5, top_logprobs=3)
    outs = engine.generate(prompts, params)
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1]  # predicts each token
            tok = torch.tensor(c.token_ids)
            raw = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), raw, atol=1e-4)
            # the sampled distribution: temperature, then top-k, then top-p (explicit reference below)
            ref = torch.stack([ref_processed_logp(row / T, top_k, top_p) for row in logits])
            sampled = ref.gather(1, tok[:, None])[:, 0]
            assert torch.isfinite(sampled).all()
            assert torch.allclose(torch.tensor(c.sampled_logprobs), sampled, atol=1e-4)
            top_vals, top_ids = torch.log_softmax(logits, -1).topk(3, dim=-1)
            for t, d in enumerate(c.top_logprobs):  # the 3 most likely tokens under the raw distribution
                assert list(d) == top_ids[t].tolist()
                assert torch.allclose(torch.tensor(list(d.values())), top_vals[t], atol=1e-4)


def ref_processed_logp(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Plain-Python top-k then top-p, then log-renormalise (the reference for `process_logits`)."""
    vals = sorted(x.tolist(), reverse=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < len(vals):
        keep &= x >= vals[top_k - 1]
    if top_p < 1.0:
        kept = torch.where(keep, x, torch.tensor(-math.inf))
        probs = torch.softmax(kept, -1)
        order = sorted(range(len(x)), key=lambda i: -float(kept[i]))
        mass, allowed = 0.0, torch.zeros_like(keep)
        for i in order:
            if mass >= top_p:
                break
            allowed[i] = True
            mass += float(probs[i])
        keep &= allowed
    return torch.log_softmax(torch.where(keep, x, torch.tensor(-math.inf)), -1)


def test_top_k_top_p_masks_match_reference() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[5, :4] = 10.0  # a tie at the top-k threshold: all tied tokens are kept
    top_k = torch.tensor([0, 5, 0, 12, 1, 2])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 1.0])
    temp = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.8, 1.0])
    out = process_logits(logits, temp, top_k, top_p)
    for i in range(6):
        ref = ref_processed_logp(logits[i] / temp[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(ref)), f"row {i}"
        assert torch.allclose(
            torch.log_softmax(out[i], -1)[torch.isfinite(ref)], ref[torch.isfinite(ref)], atol=1e-5
        )
    assert int(torch.isfinite(out[5]).sum()) == 4 and int(torch.isfinite(out[4]).sum()) == 1


def test_gumbel_sampling_follows_the_processed_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 6000
    params = [SamplingParams(temperature=0.9, top_k=4)] * n
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    res = sample(logits.expand(n, -1), params, gens)
    freq = torch.bincount(res.tokens_n, minlength=6).float() / n
    want = torch.softmax(
        process_logits(logits[None], torch.tensor([0.9]), torch.tensor([4]), torch.tensor([1.0]))[0], -1
    )
    assert freq[4:].sum() == 0
    assert torch.allclose(freq, want, atol=0.02)  # 6000 draws: 3 sigma ~ 0.019 at p = 0.5


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    model = make_model()
    prompt = prompts_of([10])[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    alone = Engine(model).generate([prompt], params)[0].token_ids
    engine = Engine(model)
    others = prompts_of([4, 22, 8], seed=9)
    engine.add_request(others[0], SamplingParams(max_tokens=30, temperature=1.3, seed=1))
    engine.add_request(others[1], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    engine.step()  # our request joins a batch already in flight, in another slot
    rid = engine.add_request(prompt, params)
    engine.add_request(others[2], SamplingParams(max_tokens=5, temperature=0.5, seed=2))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                got = out.completion.token_ids
    assert got == alone
    other_seed = Engine(model).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99)
    )
    assert other_seed[0].token_ids != alone


def detok(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_token_ids_strings_max_tokens_and_finish_reasons() -> None:
    model = make_model()
    prompt = prompts_of([8])[0]
    ref = greedy_recompute(model, prompt, 24)
    engine = Engine(model, detokenize=detok, eos_token_ids=[ref[9]])

    # eos (engine-level): stops at its first occurrence, kept in token_ids, not in text
    c = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    k = ref.index(ref[9])
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", ref[9], ref[: k + 1])
    assert c.text == detok(ref[:k]) and len(c.logprobs) == len(c.sampled_logprobs) == k + 1

    # ignore_eos + a request-level stop token id
    c = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[ref[14]])
    )[0]
    k = ref.index(ref[14])
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", ref[14], ref[: k + 1])

    # a stop string: cut from the text (or kept with include_stop_str_in_output)
    text = detok(ref)
    stop = text[5:8]
    j = text.find(stop)
    for include in (False, True):
        p = SamplingParams(
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            stop=[stop, "@@"],
            include_stop_str_in_output=include,
        )
        c = engine.generate([prompt], p)[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        assert c.text == (text[: j + len(stop)] if include else text[:j])
        assert c.token_ids == ref[: j + len(stop)]  # generation ends at the token completing it

    # max_tokens, and the context limit
    c = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert (c.finish_reason, c.token_ids) == ("length", ref[:6])
    short = Engine(model, max_model_len=12)
    c = short.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert (c.finish_reason, c.token_ids) == ("length", ref[:4])  # 8 prompt + 4 = 12 positions


# A byte-level toy vocabulary: ASCII letters, and the UTF-8 bytes of multi-byte characters cut
# into single-byte and two-byte tokens, so replies split characters across tokens.
_PIECES = [bytes([b]) for b in range(ord("a"), ord("z") + 1)] + [
    part for ch in "é中🙂ß" for enc in [ch.encode()] for part in (enc[:1], enc[1:], enc[:2], enc[2:]) if part
]


def byte_detok(ids: list[int]) -> str:
    return b"".join(_PIECES[t % len(_PIECES)] for t in ids).decode("utf-8", errors="replace")


def test_incremental_text_equals_detokenizing_everything() -> None:
    """The engine detokenises only each step's pending tokens: its text, and the deltas it streams,
    equal one detokenisation of all the tokens, though replies cut characters across tokens."""
    model = make_model()
    engine = Engine(model, detokenize=byte_detok)
    prompts = prompts_of([3, 9, 14, 6], seed=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True))
           for i, p in enumerate(prompts)]  # fmt: skip
    streamed = dict.fromkeys(ids, "")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.text_delta
            if out.finished:
                done[out.request_id] = out.completion
    split = 0
    for rid in ids:
        c = done[rid]
        assert len(c.token_ids) == 40 and c.text == byte_detok(c.token_ids) == streamed[rid]
        split += sum(byte_detok([t]).endswith("\ufffd") for t in c.token_ids)
    assert split > 10  # the replies did cut characters


def test_streamed_text_deltas_and_abort() -> None:
    model = make_model()
    engine = Engine(model, detokenize=detok)
    prompt = prompts_of([5])[0]
    ref = greedy_recompute(model, prompt, 16)
    stop = detok(ref)[10:12]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))
    victim = engine.add_request(prompts_of([7])[0], SamplingParams(max_tokens=50, temperature=0))
    streamed, final, aborted = "", None, None
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            engine.abort(victim)
        for out in engine.step():
            if out.request_id == rid:
                streamed += out.text_delta
                final = out.completion if out.finished else final
            elif out.finished:
                aborted = out.completion
    assert final is not None and streamed == final.text == detok(ref)[: detok(ref).find(stop)]
    assert aborted is not None and aborted.finish_reason == "abort" and len(aborted.token_ids) == 2


def test_cache_bytes_per_token() -> None:
    model = make_model()
    cfg = model.config
    assert (
        Engine(model).cache_bytes_per_token()
        == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4
    )
    k2 = K2Config.preset("kimi-k2")
    cache = MLACache(
        k2.num_hidden_layers, k2.kv_lora_rank, k2.qk_rope_head_dim, dtype=torch.bfloat16, device="meta"
    )
    assert cache.bytes_per_token() == (512 + 64) * 61 * 2 == 70_272
    # expanded per-head keys and values would take H * (qk_head_dim + v_head_dim) per layer
    expanded = k2.num_attention_heads * (k2.qk_head_dim + k2.v_head_dim) * 61 * 2
    assert expanded / cache.bytes_per_token() == pytest.approx(20480 / 576)  # 35.6x


def test_cache_grows_and_keeps_contents() -> None:
    cache = MLACache(2, 4, 2, block_size=4, max_blocks=6, initial_blocks=1)
    rows = torch.randn(3, 6)
    b = cache.allocate()
    cache.write(1, torch.tensor([b] * 3), torch.arange(3), rows)
    more = [cache.allocate() for _ in range(5)]
    assert cache.num_blocks == 6 and cache.num_available() == 0  # doubled, capped at the maximum
    assert torch.equal(cache.gather(1, torch.tensor([[b]]))[0, :3], rows)
    with pytest.raises(RuntimeError, match="in use"):
        cache.allocate()
    cache.release_all([b, *more])
    assert cache.num_available() == 6 and cache.num_used() == 0


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    engine = Engine(make_model(), max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(10)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([1, 512])
    with pytest.raises(ValueError, match="detokenize"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))


def test_weights_updated_in_place_take_effect_next_step() -> None:
    model = make_model()
    engine = Engine(model)
    prompt = prompts_of([6])[0]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    with torch.no_grad():  # e.g. k2-ckpt loading new weights between steps
        model.model.layers[-1].self_attn.kv_b_proj.weight.mul_(-1.5)
    out = engine.step()[0]
    assert out.request_id == rid
    c = out.completion
    with torch.no_grad():  # the last layer's cache rows do not depend on its kv_b_proj: exact reference
        logits = model(torch.tensor([prompt + c.token_ids[:1]])).logits[0, -1]
    assert out.token_ids[0] == int(logits.argmax())
    assert abs(c.logprobs[1] - float(F.log_softmax(logits, -1)[out.token_ids[0]])) < 1e-4


@pytest.mark.cuda
def test_greedy_with_cache_equals_full_recomputation_on_cuda() -> None:
    model = make_model(yarn=True).cuda()
    prompts = prompts_of([5, 21, 12])
    outs = Engine(model).generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, c in zip(prompts, outs):
        assert c.token_ids == greedy_recompute(model, p, 10)
    sampled = Engine(model).generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.8, seed=3))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + sampled.token_ids], device="cuda")).logits[0, 4:-1]
    raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled.token_ids, device="cuda")[:, None])[
        :, 0
    ]
    assert torch.allclose(torch.tensor(sampled.logprobs), raw.cpu(), atol=1e-4)


def test_bf16_model_gets_a_bf16_cache() -> None:
    model = make_model().to(torch.bfloat16)
    cfg = model.config
    engine = Engine(model)
    assert engine.cache.kv_LyBbK.dtype == torch.bfloat16
    assert (
        engine.cache_bytes_per_token()
        == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 2
    )
    prompt = prompts_of([9])[0]
    c = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    with torch.no_grad():  # bf16 rounding differs between the paths: compare distributions, not bits
        logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), raw, atol=0.1)


def test_engine_thread_streams_and_applies_weight_updates_between_steps() -> None:
    from k2_model.engine import EngineThread

    model = make_model()
    prompts = prompts_of([4, 11, 7])
    want = Engine(model).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    runner = EngineThread(Engine(model))
    try:
        subs = [runner.submit(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in prompts]
        for (_rid, q), ref in zip(subs, want):
            toks = []
            while True:
                out = q.get(timeout=30)
                assert not isinstance(out, BaseException)
                toks += out.token_ids
                if out.finished:
                    break
            assert toks == ref.token_ids and out.finish_reason == "length"
        # a weight update runs on the stepping thread, between steps; its result comes back
        fut = runner.call_between_steps(lambda: model.lm_head.weight.mul_(2.0).shape)
        assert fut.result(timeout=30) == model.lm_head.weight.shape
        _rid, q = runner.submit(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
        first = q.get(timeout=30)
        with torch.no_grad():
            assert first.token_ids[0] == int(model(torch.tensor([prompts[0]])).logits[0, -1].argmax())
            assert (
                abs(
                    first.logprobs[0]
                    - float(F.log_softmax(model(torch.tensor([prompts[0]])).logits[0, -1], -1).max())
                )
                < 1e-4
            )
    finally:
        runner.close()


def test_queue_beyond_max_batch_size_and_prefill_budget() -> None:
    model = make_model(yarn=True)
    engine = Engine(model, max_batch_size=2, max_prefill_tokens=10)
    prompts = prompts_of([8, 6, 12, 3, 9])
    max_tokens = [5, 9, 4, 7, 3]
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0))
        for p, m in zip(prompts, max_tokens)
    ]
    done, most_running = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.completion
        most_running = max(most_running, engine.num_running)
    assert most_running == 2  # never more than max_batch_size in the cache
    for i, rid in enumerate(ids):
        assert done[rid].token_ids == greedy_recompute(model, prompts[i], max_tokens[i])


def test_chunked_prefill_keeps_decoding_and_equals_one_prefill() -> None:
    """A prompt longer than max_prefill_tokens is prefilled over several steps while a running
    sequence keeps getting a token every step; its greedy tokens equal full recomputation, its n
    samples fork once the last chunk is in, and an abort mid-prefill finishes every sample."""
    model = make_model()
    engine = Engine(model, max_prefill_tokens=16)
    short, long_ = prompts_of([5, 50], seed=3)
    sid = engine.add_request(short, SamplingParams(max_tokens=12, temperature=0.0))
    engine.step()  # the short prompt is prefilled and running
    lid = engine.add_request(long_, SamplingParams(max_tokens=6, temperature=0.0, n=2))
    steps_until_first, started, done = 0, False, {}
    while engine.has_unfinished():
        outs = engine.step()
        got = {(o.request_id, o.index) for o in outs if o.token_ids}
        started = started or any(rid == lid for rid, _ in got)
        if not started:
            steps_until_first += 1
            assert (sid, 0) in got  # decode never stalls for the long prefill
        for o in outs:
            if o.finished:
                done[(o.request_id, o.index)] = o.completion
    assert steps_until_first == 3  # 50 tokens in chunks of 16: 16, 16, 16, then 2 and the first token
    assert done[(sid, 0)].token_ids == greedy_recompute(model, short, 12)
    want = greedy_recompute(model, long_, 6)
    assert done[(lid, 0)].token_ids == done[(lid, 1)].token_ids == want
    assert engine.stats.prefilled_tokens == 55 and engine.cache.num_used() == 0

    engine2 = Engine(model, max_prefill_tokens=16, enable_prefix_caching=False)
    victim = engine2.add_request(long_, SamplingParams(max_tokens=6, temperature=0.0, n=3))
    engine2.step()
    engine2.abort(victim)
    outs = engine2.step()
    assert sorted(o.index for o in outs if o.finished and o.finish_reason == "abort") == [0, 1, 2]
    assert not engine2.has_unfinished() and engine2.cache.num_used() == 0


def test_engine_thread_hands_a_step_s_outputs_to_batching_queues_in_one_call() -> None:
    """Queues with a `batch_key` get a step's outputs in one `put_batch` per key (an asyncio server's
    one wake-up per step); the streams are the same as through plain queues."""
    import queue

    from k2_model.engine import EngineThread

    class Batched:
        batch_key = "loop"
        calls: list[int] = []

        def __init__(self) -> None:
            self.q: queue.Queue = queue.Queue()

        def put(self, item) -> None:
            self.q.put(item)

        @classmethod
        def put_batch(cls, items) -> None:
            cls.calls.append(len(items))
            for q, item in items:
                q.q.put(item)

    model = make_model()
    prompts = prompts_of([4, 11, 7])
    want = Engine(model).generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    runner = EngineThread(Engine(model))
    try:
        with runner._wake:  # submitted together: they run in the same steps
            subs = [
                runner.submit(p, SamplingParams(max_tokens=6, temperature=0.0), out=Batched())
                for p in prompts
            ]
        for (_rid, b), ref in zip(subs, want):
            toks = []
            while True:
                out = b.q.get(timeout=30)
                toks += out.token_ids
                if out.finished:
                    break
            assert toks == ref.token_ids
    finally:
        runner.close()
    assert sum(Batched.calls) == 3 * 6 and max(Batched.calls) == 3  # one call per step for all three
