"""`k2 data rephrase` (contract: INPUT... --out DIR --base-url URL --model NAME [--rounds N]) end to end
against a scripted OpenAI-protocol server on loopback, on the shipped corpus, in both modes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")

from k2_data.loopback import LoopbackServer, Reply
from k2_data.rephrase import prompts as P
from k2_data.rephrase import read_rows

from k2_stack.cli import main


def copy_model(request: dict) -> Reply:
    """Returns the passage unchanged: faithful by construction, whatever the instruction."""
    passage = P.passage_of(request["messages"])
    return Reply(content=passage)


def test_help_lists_rephrase(capsys):
    with pytest.raises(SystemExit):
        main(["data", "--help"])
    assert "rephrase" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["data", "rephrase", "--help"])
    text = capsys.readouterr().out
    for flag in ("--out", "--base-url", "--model", "--rounds", "--mode", "--math-notes", "--judge-model"):
        assert flag in text


def test_rephrase_default_corpus_two_rounds(tmp_path, capsys):
    out = tmp_path / "reph"
    with LoopbackServer(copy_model) as server:
        rc = main(
            ["data", "rephrase", "--out", str(out), "--base-url", server.base_url, "--model", "copy"]
            + ["--rounds", "2", "--min-similarity", "0", "--no-progress"]
        )
        n_requests = len(server.requests)
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "accepted first try / final: 100.0% / 100.0%" in printed
    rows = read_rows(out)
    corpus = [
        json.loads(line) for line in open(P.resources.files("k2_data.rephrase") / "corpus" / "default.jsonl")
    ]
    knowledge = [d["text"] for d in corpus if d["kind"] == "knowledge"]
    assert len(rows) == 2 * len(knowledge) and n_requests == sum(len(r["chunk_spans"]) for r in rows)
    for r in rows:  # a copying model: the stitched output is the document, whitespace normalised
        assert r["text"].split() == knowledge[r["doc_id"]].split() and r["model"] == "copy"
    assert {"source", "prompt_id", "chunk_spans", "fidelity", "round"} <= set(rows[0])
    # rerun: everything is already written, nothing is requested
    with LoopbackServer(copy_model) as server:
        assert (
            main(
                ["data", "rephrase", "--out", str(out), "--base-url", server.base_url, "--model", "copy"]
                + ["--rounds", "2", "--min-similarity", "0", "--no-progress"]
            )
            == 0
        )
        assert server.requests == []


def test_rephrase_math_notes_mode(tmp_path):
    out = tmp_path / "math"
    with LoopbackServer(copy_model) as server:
        rc = main(
            ["data", "rephrase", "--out", str(out), "--base-url", server.base_url, "--model", "copy"]
            + ["--math-notes", "--min-similarity", "0", "--no-progress", "--json"]
        )
    assert rc == 0
    rows = read_rows(out)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"math", "translate"}
    # a copy is not a translation: numbers and formulas survive, so only the judge (off here) could object
    assert all(r["prompt_id"] == "translate_en" for r in rows if r["kind"] == "translate")


def test_rephrase_bad_arguments(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "rephrase",
                "--out",
                str(tmp_path),
                "--base-url",
                "http://127.0.0.1:1/v1",
                "--model",
                "m",
                "--rounds",
                "3",
            ]
        )
        == 2
    )
    assert "rounds must be 1..2" in capsys.readouterr().err
    assert (
        main(
            [
                "data",
                "rephrase",
                str(tmp_path / "missing.jsonl"),
                "--out",
                str(tmp_path / "o"),
                "--base-url",
                "http://127.0.0.1:1/v1",
                "--model",
                "m",
                "--min-similarity",
                "0",
            ]
        )
        == 2
    )
    assert "missing.jsonl" in capsys.readouterr().err
