"""`k2_rl.evaluate`: the held-out accuracy `k2 rl` logs, for any policy (a baseline's ruler)."""

from __future__ import annotations

import json

import pytest
import torch
from k2_data import load_tokenizer
from k2_model.testing import tiny_model
from k2_rl.evaluate import evaluate_policy, main


@pytest.fixture
def policy_dir(tmp_path):
    torch.manual_seed(0)
    model = tiny_model()
    d = tmp_path / "hf"
    model.save_pretrained(str(d))
    load_tokenizer().save(d)
    return d


def test_accuracy_counts_greedy_answers_the_reward_accepts(tmp_path, policy_dir):
    """Each task is scored by its own reward: instruction tasks whose constraint any short answer
    meets count, one no answer can meet does not, math on a random policy fails, and rubric tasks
    (no reference answer) are left out."""

    def task(content, **kw):
        return {"messages": [{"role": "user", "content": content}], **kw}

    rows = [
        task(
            "Say hi.", reward="instruction", answer=None, constraints=[{"type": "char_count", "max": 10000}]
        ),
        task(
            "Say yo.", reward="instruction", answer=None, constraints=[{"type": "char_count", "max": 10000}]
        ),
        task(
            "Write a lot.",
            reward="instruction",
            answer=None,
            constraints=[{"type": "char_count", "min": 10**6}],
        ),
        task("What is 12 + 30?", answer="42"),
        task("A haiku.", reward="rubric"),
    ]
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = evaluate_policy(policy_dir, heldout, max_response_tokens=4, reward_workers=1)
    assert out["heldout_n"] == 4  # the rubric task is left out
    assert out["heldout_accuracy"] == pytest.approx(2 / 4)
    assert 1 <= out["heldout_response_tokens"] <= 4


def test_cli_reports_json_and_names_a_missing_path(tmp_path, policy_dir, capsys):
    heldout = tmp_path / "h.jsonl"
    heldout.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}) + "\n"
    )
    assert main(["--init", str(policy_dir), "--heldout", str(heldout), "--max-response-tokens", "3",
                 "--reward-workers", "1"]) == 0  # fmt: skip
    assert set(json.loads(capsys.readouterr().out)) == {
        "heldout_accuracy",
        "heldout_response_tokens",
        "heldout_n",
    }
    assert main(["--init", str(tmp_path / "nope"), "--heldout", str(heldout)]) == 2
    assert "--init" in capsys.readouterr().err
