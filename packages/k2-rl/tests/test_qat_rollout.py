"""`k2 rl --qat int4`: the rollout worker samples from the INT4 experts the trainer's forward sees.

Tolerance (fp32): log-probs of the sampled tokens, trainer vs engine, 1e-4 absolute (both run the
same fake-quantised weights; the engine's paged decode sums in another order). Without the worker's
QAT the engine samples from the full-precision experts, and the gap is the INT4 error itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from k2_model.testing import SMALL_OVERRIDES, tiny_model
from k2_rl.config import RLConfig
from k2_rl.loop import build_batch
from k2_rl.loss import token_logprobs
from k2_rl.rollout import Rollout, RolloutClient, RolloutWorker

GROUP = 32


def _policy():
    torch.manual_seed(0)
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights wide enough that INT4 rounding moves the log-probs visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


def _gap(model, prompts, samples) -> float:
    batch = build_batch(prompts, samples, [0.0] * sum(len(g) for g in samples), pad_id=0)
    mask = batch["shift_labels"] != -100
    engine_lp = torch.zeros(batch["shift_labels"].shape)
    engine_lp[mask] = torch.tensor([lp for g in samples for s in g for lp in s.logprobs])
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    return float((lp - engine_lp)[mask].abs().max())


def test_engine_with_qat_scores_like_the_qat_trainer():
    trainer = _policy().train()
    trainer.set_expert_qat(GROUP)
    prompts = [[5, 17, 33, 2, 90], [200, 3, 8]]
    gaps = {}
    for qat in (False, True):
        sampler = copy.deepcopy(trainer).eval()
        sampler.set_expert_qat(GROUP if qat else 0)
        engine = Rollout(sampler, eos_token_ids=[trainer.config.eos_token_id], max_batch_size=16)
        try:
            samples = engine.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=4)
        finally:
            engine.close()
        gaps[qat] = _gap(trainer, prompts, samples)
    assert gaps[True] < 1e-4 and gaps[False] > 1e-3, gaps


@pytest.mark.slow
def test_rollout_worker_process_takes_the_qat_group_size(tmp_path):
    """The worker CLI (`--qat-group-size`, what k2 rl passes for --qat int4) samples from INT4 experts."""
    from k2_data import load_tokenizer

    trainer = _policy()
    trainer.save_pretrained(str(tmp_path / "m"))
    load_tokenizer().save(tmp_path / "m")
    trainer.set_expert_qat(GROUP)
    worker = RolloutWorker(tmp_path / "m", threads=1, qat_group_size=GROUP)
    try:
        client: RolloutClient = worker.start()
        prompts = [[5, 6, 7, 8]]
        samples = client.generate(prompts, n=2, temperature=1.0, max_tokens=6, seed=1)
    finally:
        worker.close()
    assert _gap(trainer.train(), prompts, samples) < 1e-4


def test_qat_with_a_vllm_rollout_is_refused(tmp_path):
    cfg = RLConfig.flat(model_overrides=SMALL_OVERRIDES, qat="int4", rollout="vllm", out=str(tmp_path / "r"))
    with pytest.raises(ValueError, match="qat='int4' with rollout='vllm'"):
        cfg.validate()
