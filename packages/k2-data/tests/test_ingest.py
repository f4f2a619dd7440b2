"""`tokenize_corpus`: every row equals the tokenizer's own encoding of its source document."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from k2_data import BadRecordError, TokenizeConfig, load_manifest, load_tokenizer, tokenize_corpus
from k2_data.ingest import PLAN, SHARD_SCHEMA


def _rows(out: Path, manifest: dict) -> list[dict]:
    rows = []
    for shard in manifest["shards"]:
        path = out / shard["file"]
        if manifest["format"] == "arrow":
            with pa.memory_map(str(path)) as src:
                table = pa.ipc.open_file(src).read_all()
        else:
            table = pq.read_table(path)
        assert table.schema.remove_metadata() == SHARD_SCHEMA
        assert table.num_rows == shard["rows"]
        assert sum(len(x) for x in table.column("input_ids").to_pylist()) == shard["tokens"]
        rows.extend(table.to_pylist())
    return rows


@pytest.mark.parametrize("fmt,workers", [("arrow", 1), ("parquet", 2)])
def test_text_and_jsonl_rows_equal_reference_encoding(mixed_corpus, tmp_path, fmt, workers):
    root = mixed_corpus["dir"]
    out = tmp_path / "tok"
    cfg = TokenizeConfig(format=fmt, workers=workers, on_error="skip", shard_bytes=4000)
    manifest = tokenize_corpus([root / "txt", root / "records.jsonl"], out, config=cfg)
    tok = load_tokenizer()
    docs = mixed_corpus["docs"]
    rows = _rows(out, manifest)
    assert {r["source"]: r["input_ids"] for r in rows} == {s: tok.encode(t) for s, t in docs.items()}
    # doc ids: one per input record in input order, bad records keep their (unused) id
    assert [r["doc_id"] for r in rows] == [0, 1, 2, 3, 4, 6]
    assert manifest["num_docs"] == 6 and manifest["num_tokens"] == sum(
        len(tok.encode(t)) for t in docs.values()
    )
    assert len(manifest["shards"]) > 1
    assert manifest["tokenizer"]["sha256"] == tok.fingerprint() and manifest["tokenizer"]["eos_id"] == 7937
    # bad records are reported with file and line, never silently dropped
    assert manifest["num_skipped"] == 2
    assert [(s["file"], s["where"]) for s in manifest["skipped"]] == mixed_corpus["bad"]
    assert "invalid JSON" in manifest["skipped"][0]["reason"] and "'text'" in manifest["skipped"][1]["reason"]
    assert load_tokenizer(out / "tokenizer").fingerprint() == tok.fingerprint()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_same_shards_for_any_worker_count(mixed_corpus, tmp_path):
    root = mixed_corpus["dir"]
    outs = []
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        tokenize_corpus(
            [root / "txt", root / "records.jsonl"],
            out,
            config=TokenizeConfig(workers=w, on_error="skip", shard_bytes=3000),
        )
        outs.append(out)
    m1, m2 = load_manifest(outs[0]), load_manifest(outs[1])
    assert m1["shards"] == m2["shards"] and _rows(outs[0], m1) == _rows(outs[1], m2)


def test_bad_record_fails_with_file_and_line(mixed_corpus, tmp_path):
    jl = mixed_corpus["dir"] / "records.jsonl"
    with pytest.raises(BadRecordError, match=rf"{jl}:3: invalid JSON"):
        tokenize_corpus([jl], tmp_path / "o", config=TokenizeConfig(on_error="fail"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"line one\nline two \xff\xfe\n")
    with pytest.raises(BadRecordError, match=rf"{bad}:2: not valid UTF-8"):
        tokenize_corpus([bad], tmp_path / "o2")


def test_parquet_and_arrow_stream_with_text_field(mixed_corpus, tmp_path):
    root = mixed_corpus["dir"]
    manifest = tokenize_corpus(
        [root / "table.parquet", root / "hf.arrow"],
        tmp_path / "t",
        config=TokenizeConfig(text_field="content", shard_bytes=1500, workers=2),
    )
    tok = load_tokenizer()
    rows = _rows(tmp_path / "t", manifest)
    assert {r["source"]: r["input_ids"] for r in rows} == {
        s: tok.encode(t) for s, t in mixed_corpus["table_docs"].items()
    }
    assert [r["doc_id"] for r in rows] == list(range(5))
    with pytest.raises(ValueError, match=r"table.parquet: no column 'text' \(columns: content\)"):
        tokenize_corpus([root / "table.parquet"], tmp_path / "t2")


def test_resume_skips_completed_shards(mixed_corpus, tmp_path):
    root = mixed_corpus["dir"]
    out = tmp_path / "r"
    cfg = TokenizeConfig(on_error="skip", shard_bytes=3000)
    first = tokenize_corpus([root / "txt", root / "records.jsonl"], out, config=cfg)
    shard_files = sorted(out.glob("shard-*.arrow"))
    assert len(shard_files) >= 3
    mtimes = {p: p.stat().st_mtime_ns for p in shard_files}
    victim = shard_files[1]
    victim.unlink()  # as if the run had been killed before this shard was renamed into place
    (out / f".{victim.name}.abc.tmp").write_bytes(b"partial")  # leftovers of a kill are ignored
    second = tokenize_corpus([root / "txt", root / "records.jsonl"], out, config=cfg)
    assert second["resumed_shards"] == len(shard_files) - 1
    assert {k: v for k, v in second.items() if k not in ("seconds", "resumed_shards")} == {
        k: v for k, v in first.items() if k not in ("seconds", "resumed_shards")
    }
    for p in shard_files:
        if p != victim:
            assert p.stat().st_mtime_ns == mtimes[p]
    # a different input set in the same directory is refused, not mixed in
    with pytest.raises(ValueError, match="different run"):
        tokenize_corpus([root / "txt"], out, config=cfg)
    assert json.loads((out / PLAN).read_text())["plan_sha256"] == first["plan_sha256"]


def test_kill_mid_write_leaves_no_shard(mixed_corpus, tmp_path, monkeypatch):
    import k2_data.ingest as ingest

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ingest.pa.ipc, "new_file", boom)
    out = tmp_path / "k"
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus([mixed_corpus["dir"] / "txt"], out)
    assert not list(out.glob("shard-*")) and not [p for p in os.listdir(out) if p.endswith(".tmp")]
    assert not (out / "manifest.json").exists()


def test_fast_engine_is_checked_against_hf(mixed_corpus, tmp_path, monkeypatch, stdlib_texts):
    tok = load_tokenizer()
    assert tok.has_fast_engine
    texts = [
        *stdlib_texts().values(),
        "你好，世界。中文English混合123 naïve café 🙂",
        "<|im_end|> [EOS] x\r\n\t  y",
        "a" * 30000,
        " " * 5000 + "\n\n",
        "",
    ]
    assert tok.encode_batch_fast(texts) == tok.encode_batch(texts)
    from k2_data.tokenizer import BPETokenizer

    real = BPETokenizer.encode_batch_fast
    monkeypatch.setattr(BPETokenizer, "encode_batch_fast", lambda self, t: [x[:-1] for x in real(self, t)])
    with pytest.raises(
        ingest_mod().EngineMismatchError, match=r"txt/abc.py: the tiktoken engine and HF tokenizers disagree"
    ):
        tokenize_corpus([mixed_corpus["dir"] / "txt"], tmp_path / "x", config=TokenizeConfig(check_every=1))
    m = tokenize_corpus([mixed_corpus["dir"] / "txt"], tmp_path / "y", config=TokenizeConfig(engine="hf"))
    assert m["encoder"] == "hf-bpe" and m["num_tokens"] == sum(len(tok.encode(t)) for t in texts[:3])


def ingest_mod():
    import k2_data.ingest

    return k2_data.ingest


@pytest.mark.slow
def test_default_corpus_whole_stdlib(tmp_path):
    """The default corpus end to end, every document equal to HF tokenizers' encoding of its file."""
    from k2_data.corpus import default_corpus_files

    manifest = tokenize_corpus(None, tmp_path / "std", config=TokenizeConfig(workers=2))
    files = default_corpus_files()
    tok = load_tokenizer()
    expected = tok.encode_batch([p.read_text(encoding="utf-8") for p in files])  # the HF engine
    rows = _rows(tmp_path / "std", manifest)
    assert [r["source"] for r in rows] == [str(p) for p in files]
    assert manifest["num_docs"] == len(files) > 500
    assert [r["input_ids"] for r in rows] == expected
    assert manifest["num_tokens"] == sum(map(len, expected)) and manifest["num_skipped"] == 0
