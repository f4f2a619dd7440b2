"""The RL objectives against the formulas written out directly, finite differences, and the
Trainer (group-aligned micro-batches, PTX term)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from k2_rl.loss import GRPOClippedLoss, KimiK15Loss, grpo_clipped_loss, kimi_k15_loss, sequence_logprobs
from k2_train import Trainer, TrainerConfig
from torch import nn


def _k15_by_hand(logp, logp_old, rewards, group_ids, tau) -> float:
    """mean over prompts of (1/K) sum_i (r_i - r_bar - tau (logp_i - logp_old_i))^2, in plain Python."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(int(g), []).append(i)
    per_prompt = []
    for idx in groups.values():
        r_bar = sum(float(rewards[i]) for i in idx) / len(idx)
        per_prompt.append(
            sum((float(rewards[i]) - r_bar - tau * (float(logp[i]) - float(logp_old[i]))) ** 2 for i in idx)
            / len(idx)
        )
    return sum(per_prompt) / len(per_prompt)


def _case(seed: int = 0, N: int = 11):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, generator=g, dtype=torch.float64) * 20
    logp_old = logp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    rewards = (torch.rand(N, generator=g) > 0.5).double()
    group_ids = torch.tensor([7, 3, 7, 9, 3, 3, 7, 9, 9, 9, 42])[:N]  # uneven K, any order, a K=1 group
    return logp, logp_old, rewards, group_ids


@pytest.mark.parametrize("tau", [0.1, 1.0])
def test_k15_equals_the_formula(tau):
    logp, logp_old, rewards, gid = _case()
    got = kimi_k15_loss(logp, logp_old, rewards, gid, tau)
    assert float(got) == pytest.approx(_k15_by_hand(logp, logp_old, rewards, gid, tau), rel=1e-12)
    perm = torch.randperm(len(gid), generator=torch.Generator().manual_seed(1))
    again = kimi_k15_loss(logp[perm], logp_old[perm], rewards[perm], gid[perm], tau)
    assert float(again) == pytest.approx(float(got), rel=1e-12)  # responses in any order


def test_k15_gradient_matches_finite_differences():
    logp, logp_old, rewards, gid = _case(seed=2)
    logp = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: kimi_k15_loss(lp, logp_old, rewards, gid, 0.5), (logp,))
    # at pi_theta = pi_old the gradient is the group-baselined policy gradient: -2 tau (r_i - r_bar) / (K G)
    x = logp_old.clone().requires_grad_(True)
    kimi_k15_loss(x, logp_old, rewards, gid, 0.5).backward()
    G = len(set(gid.tolist()))
    for i in range(len(gid)):
        same = gid == gid[i]
        r_bar = float(rewards[same].mean())
        want = -2 * 0.5 * (float(rewards[i]) - r_bar) / (int(same.sum()) * G)
        assert float(x.grad[i]) == pytest.approx(want, abs=1e-12)


def test_k15_shape_errors_name_the_arguments():
    with pytest.raises(ValueError, match="logp, logp_old, rewards and group_ids"):
        kimi_k15_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.zeros(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="tau"):
        kimi_k15_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long), 0.0)


def test_grpo_clipped_equals_the_formula():
    g = torch.Generator().manual_seed(3)
    N, S = 6, 5
    logp = -torch.rand(N, S, generator=g, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(N, S, generator=g, dtype=torch.float64)
    mask = torch.rand(N, S, generator=g) > 0.3
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    total, count = grpo_clipped_loss(logp, old, mask, rewards, gid, clip_eps=0.2)
    want, n = 0.0, 0
    for i in range(N):
        grp = [j for j in range(N) if gid[j] == gid[i]]
        rs = [float(rewards[j]) for j in grp]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        a = (float(rewards[i]) - mean) / (std + 1e-4)
        for t in range(S):
            if mask[i, t]:
                ratio = math.exp(float(logp[i, t]) - float(old[i, t]))
                want += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                n += 1
    assert float(total) == pytest.approx(want, rel=1e-10) and int(count) == n


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _TinyLM(nn.Module):
    """An LM small enough to check the losses against: logits = W[token] + b."""

    def __init__(self, V: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, V)

    def forward(self, input_ids, **_):
        return _Out(self.emb(input_ids))


def _rl_batch(V: int = 12, B: int = 8, S: int = 7):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.full((B, S), -100)
    labels[:, 3:-1] = ids[:, 4:]  # the response: tokens 4.. (the prompt is 0..3)
    return {
        "input_ids": ids,
        "shift_labels": labels,
        "logp_old": -torch.rand(B, generator=g) * 10,
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
    }


def test_k15_trainer_loss_is_the_mean_over_prompts_for_any_group_aligned_micro_batches():
    batch = _rl_batch()
    base = _TinyLM()
    with torch.no_grad():
        logp = sequence_logprobs(base, batch)
        # the sequence log-prob written out: sum of log_softmax at the response positions
        lsm = torch.log_softmax(base(batch["input_ids"]).logits, -1)
        by_hand = [sum(float(lsm[b, t, batch["shift_labels"][b, t]]) for t in range(3, 6)) for b in range(8)]
    assert logp.tolist() == pytest.approx(by_hand, rel=1e-6)
    want = _k15_by_hand(logp, batch["logp_old"], batch["rewards"], batch["group_ids"], 0.2)
    grads = []
    for micro in (2, 4, 8):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        opt.zero_grad = lambda set_to_none=True: None  # keep the gradients to compare
        m = Trainer(
            model, opt, KimiK15Loss(tau=0.2), config=TrainerConfig(steps=1, micro_batch=micro, grad_clip=0)
        ).train_step(batch)
        assert m.loss == pytest.approx(want, rel=1e-5)
        assert m.loss_tokens == 4  # prompts
        grads.append(model.emb.weight.grad.clone())
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)


def test_ptx_term_is_added_with_its_coefficient_and_own_normaliser():
    batch = _rl_batch()
    g = torch.Generator().manual_seed(9)
    ptx_ids = torch.randint(0, 12, (8, 7), generator=g)
    batch["ptx_input_ids"] = ptx_ids
    batch["ptx_shift_labels"] = torch.roll(ptx_ids, -1, 1)
    model = _TinyLM()
    with torch.no_grad():
        logp = sequence_logprobs(model, batch)
        rl = _k15_by_hand(logp, batch["logp_old"], batch["rewards"], batch["group_ids"], 0.2)
        ptx = F.cross_entropy(model(ptx_ids).logits.flatten(0, 1), batch["ptx_shift_labels"].flatten())
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        KimiK15Loss(tau=0.2, ptx_coef=0.5),
        config=TrainerConfig(steps=1, micro_batch=2),
    )
    m = trainer.train_step(batch)
    assert m.extra["loss/rl"] == pytest.approx(rl, rel=1e-5)
    assert m.extra["loss/ptx"] == pytest.approx(float(ptx), rel=1e-5)
    assert m.loss == pytest.approx(rl + 0.5 * float(ptx), rel=1e-5)


def test_grpo_trainer_loss_runs_and_is_zero_gradient_free_at_equal_rewards():
    batch = _rl_batch()
    batch["rewards"] = torch.ones(8)  # no advantage anywhere: the objective is flat
    model = _TinyLM()
    with torch.no_grad():
        from k2_rl.loss import token_logprobs

        batch["logp_old_tok"] = token_logprobs(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.zero_grad = lambda set_to_none=True: None
    m = Trainer(model, opt, GRPOClippedLoss(), config=TrainerConfig(steps=1, grad_clip=0)).train_step(batch)
    assert m.loss == pytest.approx(0.0, abs=1e-9)
    assert float(model.emb.weight.grad.abs().max()) == 0.0


@pytest.mark.parametrize("loss_name", ["k15", "grpo"])
def test_on_policy_step_equals_a_separate_old_policy_forward(loss_name):
    """Without logp_old in the batch (one update per rollout batch) the loss uses its own forward,
    detached, as pi_old's: the step's loss and gradients equal those with logp_old from a separate
    forward at the same weights, and the recorded values are that forward's."""
    from k2_rl.loss import token_logprobs

    batch = _rl_batch()
    del batch["logp_old"]
    base = _TinyLM()
    with torch.no_grad():
        old_seq, old_tok = sequence_logprobs(base, batch), token_logprobs(base, batch)
    results = []
    for given in (True, False):
        model = copy.deepcopy(base)
        b = dict(batch)
        if given:
            b["logp_old"], b["logp_old_tok"] = old_seq, old_tok
        loss = KimiK15Loss(tau=0.2) if loss_name == "k15" else GRPOClippedLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        opt.zero_grad = lambda set_to_none=True: None
        m = Trainer(model, opt, loss, config=TrainerConfig(steps=1, micro_batch=4, grad_clip=0)).train_step(b)
        results.append((m.loss, model.emb.weight.grad.clone(), loss.recorded_logp_old))
    (loss_sep, grad_sep, rec_sep), (loss_on, grad_on, rec_on) = results
    assert rec_sep == []  # given logp_old: nothing recorded
    torch.testing.assert_close(torch.cat(rec_on), old_seq, rtol=1e-6, atol=1e-6)
    assert loss_on == pytest.approx(loss_sep, rel=1e-6)
    torch.testing.assert_close(grad_on, grad_sep, rtol=1e-5, atol=1e-7)
    assert float(grad_on.abs().max()) > 0  # rewards differ within groups: a real gradient


def test_token_logprobs_with_the_head_on_response_positions_only():
    """K2ForCausalLM applies its head only where a response token is scored (logits_mask): the
    log-probs and their gradients equal those of the full [B, S, N] logits."""
    from k2_model.testing import tiny_model
    from k2_rl.loss import token_logprobs

    torch.manual_seed(0)
    model = tiny_model()
    batch = _rl_batch(V=200)
    got = token_logprobs(model, batch)
    full = torch.log_softmax(model(batch["input_ids"]).logits.float(), -1)
    want = full.gather(-1, batch["shift_labels"].clamp_min(0).unsqueeze(-1)).squeeze(-1)
    want = want * (batch["shift_labels"] != -100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[batch["shift_labels"] == -100] == 0).all()
    (g_got,) = torch.autograd.grad(got.sum(), model.lm_head.weight)
    (g_want,) = torch.autograd.grad(want.sum(), model.lm_head.weight)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)
