"""`k2 serve --dtype` and `--threads`: the auto rules, and greedy bf16 output against fp32.

Tolerance of bf16 against fp32 (tiny preset, random weights: near-flat distributions, so greedy
paths part at near ties within a few tokens): the fp32 model, teacher-forced on the bf16 engine's
greedy tokens, ranks every one of them within 0.06 nats of its own best token at that step, and
the bf16 engine's logprob of each is within 0.15 of fp32's (bf16 keeps 8 mantissa bits).
"""

from __future__ import annotations

import pytest
import torch
from k2_model.engine import SamplingParams

from k2_stack.cli import main
from k2_stack.serve import build_bridge
from k2_stack.serve.bridge import default_threads, describe_dtype, serve_dtype

GAP, LOGPROB = 0.06, 0.15


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models run on one intra-op thread


def test_the_startup_line_says_which_dtype_and_why(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("K2_NATIVE_BF16", "1")
    assert describe_dtype("auto", torch.bfloat16, cpu) == "bfloat16 (auto: native bf16 GEMMs)"
    monkeypatch.setenv("K2_NATIVE_BF16", "0")
    assert describe_dtype("auto", torch.float32, cpu) == "float32 (auto: bf16 GEMMs not native on this CPU)"
    assert describe_dtype("bfloat16", torch.bfloat16, cpu) == "bfloat16"
    assert (
        describe_dtype("auto", torch.bfloat16, torch.device("meta"))
        == "bfloat16 (auto: the checkpoint's dtype)"
    )


def test_auto_dtype_follows_the_native_bf16_probe(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("K2_NATIVE_BF16", "1")
    assert serve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setenv("K2_NATIVE_BF16", "0")
    assert serve_dtype("auto", cpu) == torch.float32
    assert serve_dtype("bfloat16", cpu) == torch.bfloat16  # as given, whatever the CPU
    assert serve_dtype("auto", torch.device("meta")) is None  # off the CPU: the checkpoint's dtype
    with pytest.raises(ValueError, match="--dtype: expected auto, float32 or bfloat16, got 'half'"):
        serve_dtype("half", cpu)


def test_default_threads_leave_one_core():
    import os

    assert default_threads() == max(1, len(os.sched_getaffinity(0)) - 1)


def test_threads_flag_is_checked_and_its_rule_is_in_help(capsys):
    assert main(["serve", "--preset", "tiny", "--threads", "0"]) == 2
    assert "argument --threads: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "usable cores - 1, at least 1" in text and "AVX512-BF16 or AMX" in text


def test_bf16_greedy_follows_fp32_within_tolerance():
    fp32 = build_bridge(None, "tiny", max_model_len=512, dtype="float32", log_stats_interval=0)
    bf16 = build_bridge(None, "tiny", max_model_len=512, dtype="bfloat16", log_stats_interval=0)
    try:
        assert bf16.model.lm_head.weight.dtype == bf16.engine.cache.kv_LyBbK.dtype == torch.bfloat16
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(100, 7900, (n,), generator=g).tolist() for n in (5, 40, 200)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for prompt, c in zip(prompts, bf16.engine.generate(prompts, params)):
            assert len(c.token_ids) == 24
            with torch.no_grad():
                logits = fp32.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1)
            chosen = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            gap = lp.max(-1).values - chosen
            assert gap.max() < GAP, (
                f"{len(prompt)}-token prompt: bf16 token {int(gap.argmax())} is {gap.max():.3f} below fp32's best"
            )
            err = (chosen - torch.tensor(c.logprobs)).abs()
            assert err.max() < LOGPROB, f"{len(prompt)}-token prompt: logprob off by {err.max():.3f}"
    finally:
        fp32.close()
        bf16.close()
