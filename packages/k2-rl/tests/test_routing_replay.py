"""MoE routing replay in k2 rl: the rollout engine's routing reaches the trainer's batch (in-process,
through the worker's HTTP API, through the shared-prompt packing), the mismatch is logged every
iteration, and `--routing-replay` makes the trainer's log-probs the engine's.

Tolerance (fp32): log-probs of the sampled tokens, trainer vs engine, 1e-4 absolute.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from k2_model.testing import SMALL_OVERRIDES, tiny_model
from k2_rl.loop import build_batch
from k2_rl.loss import token_logprobs
from k2_rl.rollout import Rollout, RolloutClient, Sample, _sample_from_json, _sample_json
from k2_rl.routing import decode_routes, encode_routes, mismatch_metrics, routes_batch


def test_routes_travel_as_vllm_s_npy_base64_and_lay_out_by_row():
    r = torch.randint(0, 64, (7, 3, 8), dtype=torch.int16)
    assert torch.equal(decode_routes(encode_routes(r)), r)
    s = Sample([1, 2], [-0.5, -0.25], "stop", r)
    back = _sample_from_json(json.loads(json.dumps(_sample_json(s))))
    assert back.token_ids == [1, 2] and torch.equal(back.routed_experts, r)
    assert (
        _sample_from_json(json.loads(json.dumps(_sample_json(Sample([1], [0.0], "stop"))))).routed_experts
        is None
    )
    b = routes_batch([r[:5], None, r], 6)
    assert b.shape == (3, 6, 3, 8)
    assert torch.equal(b[0, :5], r[:5]) and bool((b[0, 5:] == -1).all()) and bool((b[1] == -1).all())
    assert torch.equal(b[2], r[:6])
    assert routes_batch([None, None], 4) is None
    m = mismatch_metrics(torch.tensor([[1.0, 4.0], [0.0, 4.0]]))
    assert m == {"routing_mismatch": 0.125, "routing_mismatch_layer0": 0.25, "routing_mismatch_layer1": 0.0}


def _policy(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # experts far apart: another choice moves the log-probs visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.train()


@pytest.mark.parametrize("sharing", [True, False], ids=["shared-prompt", "rows"])
def test_replay_gives_the_trainer_the_engine_s_logprobs(sharing):
    """The engine samples; then the trainer's router bias moves (an aux-loss-free update the engine
    has not seen), so the trainer's own routing differs. Replayed, it scores the engine's network."""
    model = _policy()
    engine = Rollout(copy.deepcopy(model), eos_token_ids=[model.config.eos_token_id], max_batch_size=16)
    try:
        prompts = [[5, 17, 33, 2, 90], [200, 3, 8]]
        samples = engine.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=4)
    finally:
        engine.close()
    with torch.no_grad():
        for r in model.moe_routers():
            r.e_score_correction_bias.copy_(torch.linspace(-0.6, 0.6, r.e_score_correction_bias.numel()))
    batch = build_batch(prompts, samples, [0.0] * 6, pad_id=0)
    assert batch["routed_experts"].shape[:2] == batch["input_ids"].shape
    if not sharing:
        del batch["prompt_lens"]
    engine_lp = torch.zeros(batch["shift_labels"].shape)
    mask = batch["shift_labels"] != -100
    engine_lp[mask] = torch.tensor([lp for g in samples for s in g for lp in s.logprobs])
    gaps = {}
    for replay in (False, True):
        model.set_routing_replay(replay)
        model.reset_routing_mismatch()
        with torch.no_grad():
            lp = token_logprobs(model, batch)
        gaps[replay] = float((lp - engine_lp)[mask].abs().max())
        row = mismatch_metrics(model.routing_mismatch())
        assert row["routing_mismatch"] > 0.1, row
    assert gaps[False] > 1e-2 and gaps[True] < 1e-4, gaps


def test_rollout_worker_returns_the_routing(tmp_path):
    """The worker process records and sends the routes: they are the ones an in-process engine
    records for the same samples."""
    from k2_data import load_tokenizer
    from k2_rl.rollout import RolloutWorker

    model = _policy(seed=1)
    model.save_pretrained(str(tmp_path / "m"))
    load_tokenizer().save(tmp_path / "m")
    worker = RolloutWorker(tmp_path / "m", threads=1)
    try:
        client: RolloutClient = worker.start()
        remote = client.generate([[5, 6, 7, 8]], n=2, temperature=1.0, max_tokens=6, seed=1)
    finally:
        worker.close()
    tok = load_tokenizer()
    stops = sorted({tok.eos_id, tok.token_to_id("<|im_end|>")})  # the worker's (load_for_rollout)
    local_engine = Rollout(model.eval(), eos_token_ids=stops)
    try:
        local = local_engine.generate([[5, 6, 7, 8]], n=2, temperature=1.0, max_tokens=6, seed=1)
    finally:
        local_engine.close()
    for a, b in zip(remote[0], local[0]):
        assert a.token_ids == b.token_ids
        n = 4 + len(a.token_ids) - 1
        assert a.routed_experts.shape == (n, 1, SMALL_OVERRIDES["num_experts_per_tok"])
        assert torch.equal(a.routed_experts, b.routed_experts)


@pytest.mark.slow
def test_rl_run_logs_the_routing_mismatch_every_iteration_and_replays(tmp_path):
    """A short `k2 rl --routing-replay` (rollout worker in its own process): every iteration row
    has the mismatch, overall and per MoE layer; fp32 engine and trainer at the same weights
    route alike, so it is 0 (the induced case is the test above)."""
    from k2_rl.config import RLConfig
    from k2_rl.loop import run_rl

    cfg = RLConfig.flat(
        model_overrides=SMALL_OVERRIDES, iterations=2, prompts_per_iteration=2, samples_per_prompt=2,
        max_response_tokens=6, eval_every=0, save_every=0, reward_workers=1, threads=1,
        rollout_threads=1, routing_replay=True, out=str(tmp_path / "rl"),
    )  # fmt: skip
    run_rl(cfg, log=lambda _m: None)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if "reward_mean" in r]
    assert len(its) == 2
    for r in its:
        assert r["routing_mismatch"] == 0.0 and r["routing_mismatch_layer0"] == 0.0
    assert json.loads((tmp_path / "rl" / "config.json").read_text())["routing_replay"] is True
