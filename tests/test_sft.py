"""`k2 sft` end to end: masked loss on chat data, exact resume, --init, export and serving, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from k2_data.examples.tooluse import write_tooluse_dataset
from k2_model.testing import SMALL_OVERRIDES

from k2_stack.cli import main

SMALL = SMALL_OVERRIDES  # K2's structure at test size (k2_model.testing)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K2_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chats")
    write_tooluse_dataset(d, n_train=48, n_heldout=8, seed=0)
    return d


def _config(tmp_path: Path, chats: Path, name: str, **kw) -> Path:
    cfg = dict(
        model_overrides=SMALL,
        data=str(chats / "train.jsonl"),
        steps=6,
        batch=4,
        micro_batch=2,
        seq_len=640,
        lr=1e-2,
        adamw_lr=1e-2,
        warmup_steps=2,
        eval_every=3,
        eval_batches=1,
        save_every=0,
        threads=1,
        val_fraction=0.1,
        out=str(tmp_path / name),
    )
    cfg.update(kw)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_on_assistant_tokens_only_and_resumes_exactly(tmp_path, chats, capsys):
    assert main(["sft", "--config", str(_config(tmp_path, chats, "full")), "--json"]) == 0
    full = _rows(tmp_path / "full")
    assert [r["step"] for r in full] == list(range(1, 7))
    for r in full:
        assert {"step", "loss", "max_logit", "loss_tokens", "lr", "grad_norm"} <= set(r)
    assert [r["step"] for r in full if "val_loss" in r] == [3, 6]
    assert full[-1]["loss"] < full[0]["loss"]

    # The loss covers the assistant turns only: the step's loss_tokens equal the trained
    # tokens of the conversations in its samples, counted from the rendered data directly.
    from k2_data import PackedDataset
    from k2_train.config import SFTConfig
    from k2_train.data import build_datasets

    cfg = SFTConfig.from_file(_config(tmp_path, chats, "probe"))
    tokenized = next((tmp_path / "cache" / "tokenized-chat").iterdir())
    train, _ = build_datasets(cfg, tokenized)
    assert isinstance(train, PackedDataset) and train.has_loss_mask
    first_step = [train[g] for g in range(4)]
    trained = sum(int((s["shift_labels"] != -100).sum()) for s in first_step)
    total = sum(int((s["input_ids"] != train.pad_id).sum()) for s in first_step)
    assert full[0]["loss_tokens"] == trained
    assert 0 < trained < 0.25 * total  # tool declarations, system and user turns are context only

    assert main(["sft", "--config", str(_config(tmp_path, chats, "part")), "--stop-at", "3", "--json"]) == 0
    assert len(_rows(tmp_path / "part")) == 3
    assert main(["sft", "--resume", str(tmp_path / "part"), "--json"]) == 0
    assert [r["loss"] for r in _rows(tmp_path / "part")] == [r["loss"] for r in full]  # bit-identical

    # a resumed run keeps its configuration: a changed flag is refused by name
    capsys.readouterr()
    assert main(["sft", "--resume", str(tmp_path / "part"), "--lr", "0.5"]) == 2
    err = capsys.readouterr().out
    assert "--lr 0.5" in err and "0.01" in err
    # and a pretrain run cannot be resumed as SFT
    assert main(["pretrain", "--resume", str(tmp_path / "part")]) == 2


def test_init_from_a_run_export_and_serve(tmp_path, chats):
    """--init takes another run's weights; the SFT run exports to HF format and k2 serve's app
    answers a held-out prompt through the chat endpoint with tools."""
    from fastapi.testclient import TestClient
    from k2_train.builders import build_model
    from k2_train.config import SFTConfig
    from k2_train.state import read_state

    assert (
        main(["sft", "--config", str(_config(tmp_path, chats, "base", steps=2, eval_every=0)), "--json"]) == 0
    )
    cfg = SFTConfig.from_file(
        _config(tmp_path, chats, "ft", steps=2, eval_every=0, init=str(tmp_path / "base"))
    )
    model = build_model(cfg.model, 0, torch.device("cpu"), cfg.seed)
    saved = read_state(tmp_path / "base")["components"]["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name

    assert (
        main(
            [
                "sft",
                "--config",
                str(_config(tmp_path, chats, "ft", steps=2, eval_every=0, init=str(tmp_path / "base"))),
                "--json",
            ]
        )
        == 0
    )
    assert main(["export", str(tmp_path / "ft"), "--out", str(tmp_path / "hf")]) == 0
    from k2_model import K2ForCausalLM

    exported = K2ForCausalLM.from_pretrained(str(tmp_path / "hf"))
    final = read_state(tmp_path / "ft")["components"]["model"]
    for name, value in exported.state_dict().items():
        assert torch.equal(value, final[name]), name

    from k2_stack.serve import build_bridge, create_app

    bridge = build_bridge(str(tmp_path / "hf"), None, max_batch_size=2)
    try:
        heldout = json.loads((chats / "heldout.jsonl").read_text().splitlines()[0])
        with TestClient(create_app(bridge)) as client:
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": "hf",
                    "messages": heldout["messages"],
                    "tools": heldout["tools"],
                    "tool_choice": "auto",
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
    finally:
        bridge.close()


def test_bad_data_and_init_are_one_line_errors(tmp_path, chats, capsys):
    assert main(["sft", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.jsonl" in capsys.readouterr().out
    assert (
        main(["sft", "--config", str(_config(tmp_path, chats, "y", init=str(tmp_path / "nope"))), "--json"])
        == 2
    )
    assert "--init" in capsys.readouterr().out
    # bad records are reported with file and line, and skipped
    bad = tmp_path / "bad.jsonl"
    lines = (chats / "train.jsonl").read_text().splitlines()[:20]
    lines[3] = json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})
    bad.write_text("\n".join(lines) + "\n")
    assert (
        main(
            [
                "sft",
                "--config",
                str(_config(tmp_path, chats, "z", data=str(bad), steps=1, eval_every=0, val_fraction=0.05)),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "skipped 1 bad record" in out and "bad.jsonl:4" in out and "wizard" in out


def test_conversations_longer_than_seq_len_are_named_with_lengths_and_flag(tmp_path, chats, capsys):
    """Conversations cut by --seq-len are reported at start with their lengths and the flag to
    change; a batch left with nothing to train on says why instead of only "nothing to train on"."""
    cfg = _config(tmp_path, chats, "short", seq_len=24, steps=1, eval_every=0)
    code = main(["sft", "--config", str(cfg)])
    text = capsys.readouterr()
    text = " ".join((text.out + text.err).split())
    assert "documents are longer than --seq-len 24" in text, text
    assert "median" in text and "longest" in text and "keeps them whole" in text
    if code != 0:  # every trained turn lay past the cut
        assert code == 2 and "raise --seq-len" in text


def test_export_writes_the_chat_template_the_model_was_trained_with(tmp_path, chats, capsys):
    """Data rendered with a released template -> k2 sft -> k2 export: the export's chat template is
    that template's file (not k2's own variant), so transformers and vLLM prompt it as it was trained."""
    from k2_data.chat.template import CHAT_TEMPLATE
    from k2_data.chat.templates import released_template_text
    from k2_data.sft import ChatTokenizeConfig, tokenize_chat

    data = tmp_path / "0905-data"
    tokenize_chat([chats / "train.jsonl"], data, config=ChatTokenizeConfig(template="kimi-k2-instruct-0905"))
    cfg = _config(tmp_path, chats, "tmpl", data=str(data), steps=1, eval_every=0)
    assert main(["sft", "--config", str(cfg)]) == 0
    assert main(["export", str(tmp_path / "tmpl"), "--out", str(tmp_path / "hf")]) == 0
    written = (tmp_path / "hf" / "chat_template.jinja").read_text(encoding="utf-8")
    assert written == released_template_text("kimi-k2-instruct-0905") != CHAT_TEMPLATE
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == written
    # a run on k2's own rendering exports k2's template
    cfg = _config(tmp_path, chats, "k2tmpl", steps=1, eval_every=0)
    assert main(["sft", "--config", str(cfg)]) == 0
    assert main(["export", str(tmp_path / "k2tmpl"), "--out", str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "chat_template.jinja").read_text(encoding="utf-8") == CHAT_TEMPLATE
    capsys.readouterr()


def test_qat_int4_trains_on_the_int4_forward_and_exports_int4(tmp_path, chats):
    """`k2 sft --qat int4`: the losses differ from the full-precision run's from step 1 (the
    forward uses INT4 experts), and `k2 export --quantize int4` of it loads in k2."""
    from k2_model import K2ForCausalLM

    plain = _config(tmp_path, chats, "plain", steps=2, eval_every=0)
    qat = _config(tmp_path, chats, "qat", steps=2, eval_every=0, qat="int4")
    assert main(["sft", "--config", str(plain)]) == 0
    assert main(["sft", "--config", str(qat)]) == 0
    a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "qat")
    assert a[0]["loss"] != b[0]["loss"] and abs(a[0]["loss"] - b[0]["loss"]) < 0.5  # close, not equal
    assert main(["export", str(tmp_path / "qat"), "--out", str(tmp_path / "hf"), "--quantize", "int4"]) == 0
    assert K2ForCausalLM.from_pretrained(str(tmp_path / "hf")).config.extra["quantization_config"]
