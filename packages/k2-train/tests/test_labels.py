"""One label convention across k2-data, k2-model and k2-train.

The loader yields `shift_labels` (already the next tokens) and keys that are the model's forward
arguments, so a real loader batch through `model(**batch).loss`, with no Trainer in between, is
the loss the Trainer trains on. Before, the loader's `labels` were shifted once by the loader and
again by the model: t+2 targets.
"""

from __future__ import annotations

import pytest
import torch
from k2_data import PackedDataset, StatefulLoader
from k2_model import K2Config, K2ForCausalLM
from k2_train import NextTokenLoss, Trainer, TrainerConfig


def _model(small: dict, seed: int = 0) -> K2ForCausalLM:
    torch.manual_seed(seed)
    return K2ForCausalLM(K2Config.preset("tiny", **small)).train()


@pytest.mark.parametrize("document_mask", [False, True])
def test_loader_batch_through_model_equals_trainer_loss(tokenized, small, document_mask):
    ds = PackedDataset(tokenized, seq_len=48, seed=3, document_mask=document_mask)
    batch = next(StatefulLoader(ds, batch_size=4))
    assert "labels" not in batch and "shift_labels" in batch
    assert set(batch) <= {"input_ids", "shift_labels", "position_ids", "document_ids"}

    model = _model(small)
    direct = float(model(**batch).loss.detach())  # the model alone, on the loader's batch as it comes
    model.reset_attention_max_logits()
    for r in model.moe_routers():
        r.expert_load.zero_()

    # the reference, written out: cross-entropy of the logits at t against the token at t + 1
    with torch.no_grad():
        kwargs = {k: v for k, v in batch.items() if k != "shift_labels"}
        logits = model(**kwargs).logits
    want = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100
    )
    assert direct == pytest.approx(float(want), rel=1e-6)
    if not document_mask:  # without a mask, shift_labels are exactly input_ids moved by one
        assert torch.equal(batch["shift_labels"][:, :-1], batch["input_ids"][:, 1:])

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = Trainer(model, opt, NextTokenLoss(), config=TrainerConfig(steps=1, micro_batch=2))
    m = trainer.train_step(batch)
    assert m.loss == pytest.approx(direct, rel=1e-6)


def test_same_meaning_as_transformers_shift_labels(tokenized, small):
    """transformers' loss takes the same `shift_labels` argument with the same meaning."""
    transformers = pytest.importorskip("transformers")
    import tempfile

    ds = PackedDataset(tokenized, seq_len=32, seed=1)
    batch = next(StatefulLoader(ds, batch_size=2))
    ours = _model(small).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours(**batch).loss
        # HF computes a loss only when `labels` is given; `shift_labels` then replaces the shift
        b = theirs(
            input_ids=batch["input_ids"], labels=batch["input_ids"], shift_labels=batch["shift_labels"]
        ).loss
    assert float(a) == pytest.approx(float(b), rel=1e-5)


def test_both_conventions_at_once_is_an_error(small):
    model = _model(small)
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match="either labels"):
        model(ids, labels=ids, shift_labels=ids)
    # HF labels are shifted by the model: equal to passing the shifted targets directly
    with torch.no_grad():
        a = model(ids, labels=ids).loss
        b = model(ids, shift_labels=torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)).loss
    assert float(a) == pytest.approx(float(b), rel=1e-6)


def test_trainer_refuses_a_labels_batch(small):
    model = _model(small)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), config=TrainerConfig(steps=1))
    ids = torch.randint(0, 100, (2, 8))
    with pytest.raises(ValueError, match="shift_labels"):
        trainer.train_step({"input_ids": ids, "labels": ids})


def test_logits_mask_gives_the_full_heads_rows_and_gradients(small):
    """`logits_mask` (the head only at trained positions, what NextTokenLoss passes) changes the
    compute, not the numbers: its logits are the full logits' rows, and the loss and gradients of
    a masked SFT-like batch equal those through the full [B, S, N] logits."""
    ids = torch.randint(0, 500, (2, 24))
    labels = torch.full_like(ids, -100)
    labels[0, 5:9] = ids[0, 6:10]  # a few trained tokens, as an SFT loss mask leaves
    labels[1, 15:20] = ids[1, 16:21]
    keep = labels != -100

    full, part = _model(small), _model(small)
    with torch.no_grad():
        rows = part(ids, logits_mask=keep).logits
        assert rows.shape == (int(keep.sum()), full.config.vocab_size)
        torch.testing.assert_close(rows, full(ids).logits[keep], rtol=1e-5, atol=1e-5)

    want = torch.nn.functional.cross_entropy(
        full(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    got = NextTokenLoss()(part, {"input_ids": ids, "shift_labels": labels})
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    want.backward()
    got.backward()
    for (name, a), b in zip(full.named_parameters(), part.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad(), pytest.raises(ValueError, match="logits_mask"):
        part(ids, logits_mask=keep.long())
