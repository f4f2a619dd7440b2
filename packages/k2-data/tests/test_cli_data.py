"""`k2 data ...` from outside: tokenize (with a bad record both ways), train-tokenizer, inspect."""

from __future__ import annotations

import json

import pytest
from k2_data import load_manifest, load_tokenizer

cli = pytest.importorskip("k2_stack.cli")


def _run(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_subcommands(capsys):
    code, out, _ = _run(["data", "--help"], capsys)
    assert code == 0 and all(s in out for s in ("tokenize", "train-tokenizer", "inspect"))
    for s in ("tokenize", "train-tokenizer", "inspect"):
        assert _run(["data", s, "--help"], capsys)[0] == 0


def test_tokenize_skip_and_fail(mixed_corpus, tmp_path, capsys):
    jl = mixed_corpus["dir"] / "records.jsonl"
    code, out, err = _run(
        ["data", "tokenize", str(jl), "--out", str(tmp_path / "a"), "--on-error", "skip", "--workers", "1"],
        capsys,
    )
    assert code == 0 and f"wrote {tmp_path / 'a'}" in out
    assert f"{jl}:3" in err and f"{jl}:5" in err  # each skipped record is named
    m = load_manifest(tmp_path / "a")
    tok = load_tokenizer()
    docs = [t for s, t in mixed_corpus["docs"].items() if s.startswith(str(jl))]
    assert m["num_docs"] == 3 and m["num_tokens"] == sum(len(tok.encode(t)) for t in docs)
    assert f"{m['num_tokens']} tokens" in out
    code, out, err = _run(["data", "tokenize", str(jl), "--out", str(tmp_path / "b")], capsys)
    assert code == 1 and f"{jl}:3: invalid JSON" in err


def test_train_tokenizer_then_use_it(mixed_corpus, tmp_path, capsys):
    code, out, _ = _run(
        [
            "data",
            "train-tokenizer",
            str(mixed_corpus["dir"] / "txt"),
            "--out",
            str(tmp_path / "t"),
            "--vocab-size",
            "700",
        ],
        capsys,
    )
    assert code == 0 and "EOS = 445" in out
    tok = load_tokenizer(tmp_path / "t")
    assert tok.vocab_size == 700 and tok.token_to_id("<|im_end|>") == 444 + 2
    code, _, _ = _run(
        [
            "data",
            "tokenize",
            str(mixed_corpus["dir"] / "txt"),
            "--out",
            str(tmp_path / "d"),
            "--tokenizer",
            str(tmp_path / "t"),
            "--format",
            "parquet",
        ],
        capsys,
    )
    assert code == 0
    m = load_manifest(tmp_path / "d")
    assert m["tokenizer"]["vocab_size"] == 700 and m["format"] == "parquet"
    code, out, _ = _run(["data", "inspect", str(tmp_path / "d"), "--json", "--seq-len", "64"], capsys)
    summary = json.loads(out)
    assert (
        code == 0
        and summary["tokens"] == m["num_tokens"]
        and summary["samples_of_64"] == (m["num_tokens"] + 3 - 1) // 64
    )
