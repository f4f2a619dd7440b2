"""MoE routing replay: the engine records each token's routed experts, the training forward counts
where its own top-k differs from the record and, with replay on, routes by it (fp32, tiny models).

Tolerances (fp32): the replayed MoE output against a per-token reference sum 1e-5 relative; the
trainer's log-probs of the engine's greedy tokens against the engine's 1e-4 absolute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, SamplingParams
from k2_model.moe import MoE

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models run on one intra-op thread


def make_model(seed: int = 0) -> K2ForCausalLM:
    cfg = K2Config.preset(
        "tiny", vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = K2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # experts far apart, so a different choice moves the log-probs visibly
        for p in model.parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if p.dim() == 1
                else 0.15 * torch.randn(p.shape, generator=g)
            )
    return model


def rollout(model: K2ForCausalLM, prompts: list[list[int]], max_tokens: int = 12):
    engine = Engine(model, max_batch_size=8, record_routes=True, block_size=4)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def trainer_logprobs(model: K2ForCausalLM, c, replay: bool | None) -> torch.Tensor:
    """The model's log-probs of the completion's tokens, with the record passed (replay on/off) or not."""
    ids = torch.tensor([c.prompt_token_ids + c.token_ids])
    kw = {}
    if replay is not None:
        n = ids.shape[1]
        rec = torch.full((1, n, *c.routed_experts.shape[1:]), -1, dtype=torch.long)
        rec[0, : c.routed_experts.shape[0]] = c.routed_experts.long()
        kw["routed_experts"] = rec
        model.set_routing_replay(replay)
    with torch.no_grad():
        logp = F.log_softmax(model(ids, **kw).logits[0].float(), dim=-1)
    model.set_routing_replay(False)
    P = len(c.prompt_token_ids)
    return logp[P - 1 : -1].gather(-1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)


PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [5, 17, 33, 2, 90, 41, 7, 8, 100], [200, 3]]


def test_engine_records_every_forwarded_position_and_the_trainer_agrees():
    model = make_model()
    outs = rollout(model, PROMPTS)
    for c in outs:
        n_pos = len(c.prompt_token_ids) + len(c.token_ids) - 1  # the last sampled token is never fed
        assert c.routed_experts.shape == (n_pos, 2, 2)  # 2 MoE layers (first_k_dense_replace=1), top-2
        assert int(c.routed_experts.min()) >= 0 and int(c.routed_experts.max()) < 8
        model.reset_routing_mismatch()
        logp = trainer_logprobs(model, c, replay=False)
        mism = model.routing_mismatch()
        assert mism[:, 1].tolist() == [n_pos, n_pos]  # every recorded position compared
        assert mism[:, 0].tolist() == [0, 0]  # same weights, fp32: the same top-k everywhere
        assert torch.allclose(logp, torch.tensor(c.logprobs), atol=1e-4)
    # the second prompt extends the first: its first block came from the prefix cache, routes too
    a, b = outs[0].routed_experts, outs[1].routed_experts
    assert torch.equal(a[:7], b[:7])


def test_replay_removes_an_induced_mismatch():
    """The rollout engine ran before an aux-loss-free bias update (a real source of mismatch: the bias
    changes the choice, not the weights): without replay the trainer routes differently and its
    log-probs part from the engine's; with replay they are the engine's."""
    model = make_model(seed=1)
    outs = rollout(model, PROMPTS)
    with torch.no_grad():
        for r in model.moe_routers():
            r.e_score_correction_bias.copy_(torch.linspace(-0.6, 0.6, 8))
    gaps = {}
    for replay in (False, True):
        model.reset_routing_mismatch()
        gap = max(
            float((trainer_logprobs(model, c, replay) - torch.tensor(c.logprobs)).abs().max()) for c in outs
        )
        gaps[replay] = gap
        mism = model.routing_mismatch()
        assert float(mism[:, 0].sum()) > 0.2 * float(mism[:, 1].sum())  # counted against its own choice
    assert gaps[False] > 1e-2, gaps
    assert gaps[True] < 1e-4, gaps


def reference_moe(moe: MoE, x_TD: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """Token by token: sum_k w_k * expert_{e_k}(x) + shared(x), the weights from the unbiased scores."""
    cfg = moe.config
    scores_TE = F.linear(x_TD, moe.gate.weight).sigmoid()
    out = []
    for t in range(x_TD.shape[0]):
        w = scores_TE[t, idx_TK[t]]
        w = w / w.sum() * cfg.routed_scaling_factor
        y = sum(
            w[k]
            * (F.silu(x_TD[t] @ moe.experts.gate_proj[e].T) * (x_TD[t] @ moe.experts.up_proj[e].T))
            @ moe.experts.down_proj[e].T
            for k, e in enumerate(idx_TK[t].tolist())
        )
        out.append(y + moe.shared_experts(x_TD[t]))
    return torch.stack(out)


def test_replayed_layer_equals_the_per_token_reference_and_trains_the_gate():
    moe = make_model(seed=2).model.layers[1].mlp
    x_TD = torch.randn(10, 64)
    rec_TK = torch.stack([torch.randperm(8)[:2] for _ in range(10)])
    rec_TK[3] = -1  # no record: the layer's own choice
    moe.replay_routing = True
    y = moe(x_TD.unsqueeze(0), rec_TK).squeeze(0)
    _, own_TK = moe(x_TD.unsqueeze(0), return_routes=True)
    used = torch.where((rec_TK >= 0).all(-1, keepdim=True), rec_TK, own_TK)
    ref = reference_moe(moe, x_TD, used)
    assert torch.linalg.norm(y - ref) / torch.linalg.norm(ref) < 1e-5
    y.square().sum().backward()
    ref_grad = torch.autograd.grad(reference_moe(moe, x_TD, used).square().sum(), moe.gate.weight)[0]
    err = float((moe.gate.weight.grad - ref_grad).abs().max() / ref_grad.abs().max())
    assert err < 1e-5, err


def test_routed_experts_shape_is_checked():
    model = make_model()
    with pytest.raises(ValueError, match="routed_experts must be"):
        model(torch.tensor([[1, 2, 3]]), routed_experts=torch.zeros(1, 3, 3, 2, dtype=torch.long))
