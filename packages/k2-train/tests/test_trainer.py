"""The Trainer's step against references written out directly, and the train state's rules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from k2_model import K2Config, K2ForCausalLM
from k2_optim import MuonClip
from k2_train import ModelState, OptimizerState, RNGState, Trainer, TrainerConfig, TrainState
from k2_train.distributed import DistInfo
from torch import nn


def _masked_batch(B: int = 4, S: int = 12, V: int = 100, seed: int = 0) -> dict[str, torch.Tensor]:
    """Targets masked unevenly: row b trains on its last 2 + 2b positions (SFT-like)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.full((B, S), -100)
    for b in range(B):
        n = 2 + 2 * b
        labels[b, S - n :] = torch.randint(0, V, (n,), generator=g)
    return {"input_ids": ids, "shift_labels": labels}


def _k2(small: dict, seed: int = 0) -> K2ForCausalLM:
    torch.manual_seed(seed)
    return K2ForCausalLM(K2Config.preset("tiny", **dict(small, vocab_size=100))).train()


def test_step_loss_and_gradient_are_per_token_whatever_the_micro_batches(small):
    """Micro-batches of 1, 2 and 4 rows with uneven trained-token counts: the step's loss is the
    mean over all trained tokens (not a mean of micro-batch means) and so are the gradients."""
    batch = _masked_batch()
    base = _k2(small)
    with torch.no_grad():
        logits = base(batch["input_ids"]).logits
    want = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100)
    n_trained = int((batch["shift_labels"] != -100).sum())
    assert n_trained == 2 + 4 + 6 + 8

    grads = []
    for micro in (1, 2, 4):
        model = copy.deepcopy(base)
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            config=TrainerConfig(steps=1, micro_batch=micro, grad_clip=0.0),
        )
        # keep the gradients: an SGD step at lr 0 leaves them, zero_grad would drop them
        trainer.optimizer.zero_grad = lambda set_to_none=True: None  # type: ignore[method-assign]
        m = trainer.train_step(batch)
        assert m.loss == pytest.approx(float(want), rel=1e-5), micro
        assert m.loss_tokens == n_trained
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for g in grads[1:]:
        for name, value in g.items():
            torch.testing.assert_close(value, grads[0][name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_plain_module_trains_without_the_k2_hooks():
    """Any nn.Module whose forward returns `.logits` trains: the K2 hooks (max logits, expert
    bias) are optional. A bigram model learns a deterministic successor map."""

    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Bigram(nn.Module):
        def __init__(self, V: int) -> None:
            super().__init__()
            self.table = nn.Embedding(V, V)

        def forward(self, input_ids, **_):
            return Out(self.table(input_ids))

    V = 16
    ids = torch.arange(64).reshape(4, 16) % V
    batch = {"input_ids": ids, "shift_labels": (ids + 1) % V}
    model = Bigram(V)
    with torch.no_grad():
        want = F.cross_entropy(model.table(ids).flatten(0, 1), batch["shift_labels"].flatten())
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.3), config=TrainerConfig(steps=60))
    first = trainer.train_step(batch)
    assert first.max_logit is None and first.clipped_heads == 0 and first.expert_maxvio == 0.0
    assert first.loss == pytest.approx(float(want), rel=1e-6)
    result = trainer.fit(iter([batch] * 60))
    assert result.steps_done == 60 and not result.interrupted
    assert result.last.loss < 0.05 < float(want)


def test_muonclip_step_reports_clips_and_resets_the_record(small):
    model = _k2(small)
    opt = MuonClip(model, lr=1e-2, weight_decay=0.0, tau=1e-3)  # a tau every head passes
    trainer = Trainer(model, opt, config=TrainerConfig(steps=1))
    m = trainer.train_step(_masked_batch())
    H = small["num_hidden_layers"] * small["num_attention_heads"]
    assert m.clipped_heads == H and m.max_logit > 1e-3
    assert torch.isinf(model.attention_max_logits()).all()  # reset for the next step
    assert float(model.expert_load().sum()) == 0.0  # counted, used for the bias, reset


def test_train_state_roundtrip_and_refusals(tmp_path, small):
    model = _k2(small)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, opt, config=TrainerConfig(steps=3))
    trainer.train_step(_masked_batch())
    comps = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, opt),
        "rng": RNGState(),
        "trainer": trainer,
    }
    state = TrainState(tmp_path / "run", comps, meta={"note": "x"})
    path = state.save(1)
    assert path.name == "step_000001" and state.latest() == path
    # no temporary leftovers, the pointer names the complete directory
    assert sorted(p.name for p in (tmp_path / "run" / "state").iterdir()) == ["latest", "step_000001"]
    expected_next = torch.rand(3)

    fresh = _k2(small, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_trainer = Trainer(fresh, fresh_opt, config=TrainerConfig(steps=3))
    comps2 = {
        "model": ModelState(fresh),
        "optimizer": OptimizerState(fresh, fresh_opt),
        "rng": RNGState(),
        "trainer": fresh_trainer,
    }
    assert TrainState(tmp_path / "run", comps2).load() == 1
    assert fresh_trainer.step == 1
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(torch.rand(3), expected_next)  # the RNG continues where the save was

    with pytest.raises(ValueError, match="has no scheduler"):
        TrainState(
            tmp_path / "run",
            {**comps2, "scheduler": torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0)},
        ).load()
    with pytest.raises(ValueError, match="same number"):
        TrainState(tmp_path / "run", comps2, info=DistInfo(rank=0, world_size=2)).load()
    with pytest.raises(FileNotFoundError, match="no complete train state"):
        TrainState(tmp_path / "other", comps2).load()
