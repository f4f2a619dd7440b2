"""The paged engine: parallel samples, prefix caching, eviction, weight-update flush, logits processors,
admission under a KV budget. References: full recomputation with the model's forward (fp32, tiny
random models); greedy tokens equal token for token, logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, EngineThread, SamplingParams, sample_seed

B = 4  # small blocks: short prompts span many of them


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models run on one intra-op thread


def make_model(seed: int = 0) -> K2ForCausalLM:
    cfg = K2Config.preset(
        "tiny", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
        intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = K2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the init, so argmax margins are wide
        for p in model.parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if p.dim() == 1
                else 0.1 * torch.randn(p.shape, generator=g)
            )
    return model


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def greedy_recompute(model: K2ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def raw_logprobs(model: K2ForCausalLM, prompt: list[int], out: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return F.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_n_samples_prefill_once_and_equal_single_requests_with_derived_seeds() -> None:
    model = make_model()
    prompt = rand_ids(13, 1)
    engine = Engine(model, block_size=B)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4)
    samples = engine.generate([prompt], params)
    assert engine.stats.prefilled_tokens == len(prompt)  # one prefill for the four streams
    assert [c.index for c in samples] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in samples}) == 4  # seeded samples differ
    for i, c in enumerate(samples):
        alone = Engine(model, block_size=B).generate(
            [prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=sample_seed(7, i))
        )[0]
        assert c.token_ids == alone.token_ids, f"sample {i}"
        assert torch.allclose(torch.tensor(c.logprobs), raw_logprobs(model, prompt, c.token_ids), atol=1e-4)
    # greedy samples are all the greedy continuation; blocks are all returned
    outs = engine.generate([prompt], greedy(6, n=3))
    assert [c.token_ids for c in outs] == [greedy_recompute(model, prompt, 6)] * 3
    assert engine.cache.num_used() == 0


def test_prefix_extension_prefills_only_new_tokens_and_equals_recomputation() -> None:
    model = make_model()
    engine = Engine(model, block_size=B)
    system = rand_ids(22, 2)
    first = engine.generate([system], greedy(8))[0]
    assert first.token_ids == greedy_recompute(model, system, 8)
    assert engine.stats.prefilled_tokens == 22
    # a follow-up turn: the history (prompt + reply) plus new tokens; blocks filled during decode count too
    follow = system + first.token_ids + rand_ids(5, 3)
    before = engine.stats.prefilled_tokens
    c = engine.generate([follow], greedy(8))[0]
    cached = (22 + 8 - 1) // B * B  # full blocks of the 29 cached rows (the last reply token was never fed)
    assert c.num_cached_tokens == cached
    assert engine.stats.prefilled_tokens - before == len(follow) - cached
    assert c.token_ids == greedy_recompute(model, follow, 8)
    assert torch.allclose(torch.tensor(c.logprobs), raw_logprobs(model, follow, c.token_ids), atol=1e-4)
    # a prompt equal to a cached one still prefills its last token (its logits start the decode)
    again = engine.generate([follow], greedy(3))[0]
    assert again.num_cached_tokens == (len(follow) - 1) // B * B
    assert again.token_ids == c.token_ids[:3]
    # prefix caching off: everything prefilled, same tokens
    off = Engine(model, block_size=B, enable_prefix_caching=False)
    off.generate([system], greedy(8))
    assert off.generate([follow], greedy(8))[0].token_ids == c.token_ids
    assert off.stats.prefilled_tokens == 22 + len(follow)


def test_eviction_under_pressure_stays_exact() -> None:
    model = make_model()
    engine = Engine(model, block_size=B, kv_cache_tokens=12 * B, max_batch_size=4)
    shared = rand_ids(9, 4)
    prompts = [shared + rand_ids(3 + i, 10 + i) for i in range(6)] + [
        rand_ids(17, 30),
        shared + rand_ids(2, 31),
    ]
    for round_ in range(2):  # the second round finds some prefixes cached, some evicted
        outs = engine.generate(prompts, greedy(6))
        for p, c in zip(prompts, outs):
            assert c.token_ids == greedy_recompute(model, p, 6), f"round {round_}"
    assert engine.cache.evictions > 0
    assert engine.stats.cached_tokens > 0
    assert engine.cache.num_used() == 0 and engine.cache.num_blocks <= 12


def test_weight_update_between_steps_flushes_the_prefix_cache() -> None:
    model = make_model()
    runner = EngineThread(Engine(model, block_size=B))
    engine = runner.engine
    prompt = rand_ids(21, 5)
    try:

        def run(p: list[int], n: int) -> list[int]:
            _, q = runner.submit(p, greedy(n))
            toks = []
            while True:
                out = q.get(timeout=30)
                assert not isinstance(out, BaseException)
                toks += out.token_ids
                if out.finished:
                    return toks

        run(prompt, 4)
        assert engine.cache.num_cached() > 0
        new = make_model(seed=1)
        runner.call_between_steps(lambda: model.load_state_dict(new.state_dict())).result(timeout=30)
        assert engine.cache.num_cached() == 0
        before = engine.stats.prefilled_tokens
        got = run(prompt, 6)
        assert engine.stats.prefilled_tokens - before == len(prompt)  # nothing reused from the old weights
        assert got == greedy_recompute(new, prompt, 6)
    finally:
        runner.close()


class AllowOnly:
    """A stateless mask: only these token ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, token_ids: list[int], logits_N: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(logits_N, float("-inf"))
        mask[self.ids] = 0.0
        return logits_N + mask


class NoRepeat:
    """A stateful processor (counts its calls): bans the tokens already generated; fork() copies the state."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, token_ids: list[int], logits_N: torch.Tensor) -> torch.Tensor:
        assert self.calls == len(token_ids), "one call per step of this sample"
        self.calls += 1
        out = logits_N.clone()
        out[token_ids] = float("-inf")
        return out

    def fork(self) -> NoRepeat:
        other = NoRepeat()
        other.calls = self.calls
        return other


@torch.no_grad()
def masked_greedy(model: K2ForCausalLM, prompt: list[int], n: int, allowed: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(allowed[int(logits[allowed].argmax())])
    return ids[len(prompt) :]


def test_logits_processors_apply_per_request_inside_the_batch() -> None:
    model = make_model()
    engine = Engine(model, block_size=B)
    prompts = [rand_ids(7, 6), rand_ids(12, 7), rand_ids(5, 8)]
    allowed = [3, 50, 77, 200, 311]
    params = [
        greedy(8),
        greedy(8, logits_processors=[AllowOnly(allowed)]),
        greedy(8, logits_processors=[NoRepeat()], n=2),
    ]
    outs = engine.generate(prompts, params)
    assert outs[0].token_ids == greedy_recompute(model, prompts[0], 8)  # its neighbours' masks do not leak
    assert outs[1].token_ids == masked_greedy(model, prompts[1], 8, allowed)
    for c in outs[2:]:  # both samples ran their own forked state
        assert len(set(c.token_ids)) == 8
        masked = torch.tensor(c.logprobs)
        assert torch.all(
            masked >= raw_logprobs(model, prompts[2], c.token_ids) - 1e-5
        )  # renormalised over fewer


def test_admission_queues_a_burst_under_the_kv_budget() -> None:
    model = make_model()
    engine = Engine(model, block_size=B, kv_cache_tokens=16 * B, max_batch_size=8)
    prompts = [rand_ids(20, 40 + i) for i in range(5)]  # 20 + 8 tokens: 7 blocks each, two fit at a time
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    done, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.completion
        most = max(most, engine.num_running)
        assert engine.cache.num_used() <= 16
    assert most == 2
    for rid, p in zip(ids, prompts):
        assert done[rid].token_ids == greedy_recompute(model, p, 8)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine.add_request(rand_ids(60, 1), greedy(8))  # could never fit
