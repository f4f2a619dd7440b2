"""One prompt pass for its K responses (k2_rl.shared_prompt) against the row-by-row forward."""

from __future__ import annotations

import pytest
import torch
from k2_model import K2ForCausalLM
from k2_model.testing import tiny_model
from k2_rl.loop import build_batch
from k2_rl.loss import token_logprobs
from k2_rl.rollout import Sample
from k2_rl.shared_prompt import MAX_PACKED_LEN, Packing, packable


def _batch(seed: int = 0, V: int = 200, K: int = 3) -> dict[str, torch.Tensor]:
    """Three prompts of different lengths, K responses each of different lengths, right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 9, 2)]
    samples = [
        [
            Sample(torch.randint(3, V, (int(n),), generator=g).tolist(), [0.0] * int(n), "stop")
            for n in torch.randint(1, 8, (K,), generator=g)
        ]  # fmt: skip
        for _ in prompts
    ]
    rewards = torch.rand(len(prompts) * K, generator=g).tolist()
    return build_batch(prompts, samples, rewards, pad_id=0)


def _model(train: bool) -> K2ForCausalLM:
    torch.manual_seed(0)
    model = tiny_model()
    return model.train(train)


def _rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "prompt_lens"}


@pytest.mark.parametrize("train", [False, True])
def test_packed_logprobs_and_gradients_equal_the_row_by_row_forward(train):
    model = _model(train)
    batch = _batch()
    assert packable(batch)
    packed = token_logprobs(model, batch)
    rows = token_logprobs(model, _rows(batch))
    assert packed.shape == rows.shape == batch["shift_labels"].shape
    torch.testing.assert_close(packed, rows, rtol=1e-5, atol=1e-5)
    assert (packed[batch["shift_labels"] == -100] == 0).all()
    # gradients of a loss that weighs every token differently reach every parameter alike
    w = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    g_packed = torch.autograd.grad((packed * w).sum(), params, allow_unused=True)
    g_rows = torch.autograd.grad((rows * w).sum(), params, allow_unused=True)
    checked = 0
    for (name, _), a, b in zip(model.named_parameters(), g_packed, g_rows):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
        checked += int(b.abs().max() > 0)
    assert checked > 10


def test_packing_layout():
    """Each group is one row: the prompt once, then its responses with positions continuing the
    prompt; a response sees the prompt and itself, never another response."""
    batch = _batch(K=2)
    pk = Packing(batch, pad_id=0)
    P = int(batch["prompt_lens"][0])
    n0, n1 = [int((batch["shift_labels"][r] != -100).sum()) for r in (0, 1)]
    ids = batch["input_ids"]
    assert pk.input_ids[0, :P].tolist() == ids[0, :P].tolist()
    assert pk.input_ids[0, P : P + n0].tolist() == ids[0, P : P + n0].tolist()
    assert pk.input_ids[0, P + n0 : P + n0 + n1].tolist() == ids[1, P : P + n1].tolist()
    assert pk.position_ids[0, P + n0 : P + n0 + n1].tolist() == list(range(P, P + n1))
    m = pk.attention_mask[0]
    second = P + n0  # the second response's first token
    assert m[second, :P].all() and not m[second, P:second].any() and m[second, second]
    assert pk.packed_len == max(
        int(batch["prompt_lens"][rs[0]]) + sum(int((batch["shift_labels"][r] != -100).sum()) for r in rs)
        for rs in pk.groups
    )


def test_not_packable_when_the_rows_do_not_share_their_prompt_or_are_too_long():
    batch = _batch()
    assert not packable(_rows(batch))
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][1, 0] += 1  # the group's second row has another prompt
    assert not packable(other)
    shifted = {k: v.clone() for k, v in batch.items()}
    shifted["prompt_lens"][0] += 1  # labels no longer start right after the prompt
    assert not packable(shifted)
    # the unpackable batch still gets the row-by-row numbers
    model = _model(False)
    torch.testing.assert_close(token_logprobs(model, other), token_logprobs(model, _rows(other)))
    long_prompt = [list(range(3, 3 + MAX_PACKED_LEN))]
    samples = [[Sample([5, 6], [0.0, 0.0], "stop"), Sample([7], [0.0], "stop")]]
    assert not packable(build_batch(long_prompt, samples, [1.0, 0.0], pad_id=0))


def test_an_empty_response_is_skipped_not_misaligned():
    """A row with no scored token (an empty response) packs to nothing; the others keep their values."""
    prompts = [[5, 6, 7]]
    samples = [[Sample([], [], "stop"), Sample([8, 9], [0.0, 0.0], "stop"), Sample([10], [0.0], "stop")]]
    batch = build_batch(prompts, samples, [0.0, 1.0, 0.5], pad_id=0)
    assert packable(batch)
    model = _model(False)
    packed = token_logprobs(model, batch)
    torch.testing.assert_close(packed, token_logprobs(model, _rows(batch)), rtol=1e-5, atol=1e-5)
    assert (packed[0] == 0).all()
