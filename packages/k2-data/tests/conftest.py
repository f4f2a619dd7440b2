"""Shared fixtures for k2-data tests: a small mixed-format corpus in a temp directory."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from k2_data.corpus import default_corpus_files

# a handful of real stdlib files: real code, small enough for fast tests
SMALL_STDLIB = ["abc.py", "bisect.py", "colorsys.py", "keyword.py", "this.py", "json/scanner.py"]


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    return tuple(default_corpus_files())


def stdlib_texts(names=SMALL_STDLIB) -> dict[str, str]:
    by_rel = {p.as_posix(): p for p in _stdlib_files()}
    out = {}
    for name in names:
        match = [p for rel, p in by_rel.items() if rel.endswith("/" + name)]
        assert match, f"stdlib file {name} not found"
        out[name] = match[0].read_text(encoding="utf-8")
    return out


@pytest.fixture(name="stdlib_texts", scope="session")
def _stdlib_texts_fixture():
    """The `stdlib_texts(names=...)` helper, as a fixture (conftest modules are not importable)."""
    return stdlib_texts


@pytest.fixture()
def mixed_corpus(tmp_path: Path) -> dict:
    """Text files, a JSONL with one bad line, a Parquet and an Arrow-stream file.

    Returns {"dir": Path, "docs": {source: text}, "bad": [(file, line)]}.
    """
    root = tmp_path / "corpus"
    (root / "txt").mkdir(parents=True)
    texts = stdlib_texts()
    docs: dict[str, str] = {}
    for name, text in list(texts.items())[:3]:
        p = root / "txt" / name.replace("/", "_")
        p.write_text(text, encoding="utf-8")
        docs[str(p)] = text
    jl = root / "records.jsonl"
    lines = [
        json.dumps({"text": "def f(x):\n    return x + 1\n"}),
        json.dumps({"text": "Hello, world! 你好，世界。 naïve café"}),
        "{not json",
        json.dumps({"text": texts["keyword.py"]}),
        json.dumps({"body": "no text field"}),
    ]
    jl.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a trailing blank line is not a record
    docs[f"{jl}:1"] = json.loads(lines[0])["text"]
    docs[f"{jl}:2"] = json.loads(lines[1])["text"]
    docs[f"{jl}:4"] = texts["keyword.py"]
    pqf = root / "table.parquet"
    pq.write_table(pa.table({"content": [texts["this.py"], "x = 1\n", texts["json/scanner.py"]]}), pqf)
    arf = root / "hf.arrow"
    table = pa.table({"content": ["import os\nprint(os.getcwd())\n", texts["bisect.py"]]})
    with pa.OSFile(str(arf), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:  # HF datasets style
        w.write_table(table)
    return {
        "dir": root,
        "docs": docs,
        "bad": [(str(jl), "3"), (str(jl), "5")],
        "table_docs": {
            f"{pqf}#0": texts["this.py"],
            f"{pqf}#1": "x = 1\n",
            f"{pqf}#2": texts["json/scanner.py"],
            f"{arf}#0": "import os\nprint(os.getcwd())\n",
            f"{arf}#1": texts["bisect.py"],
        },
    }


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """A tokenized dataset of 14 documents of very different lengths (3 to ~3000 tokens)."""
    root = tmp_path_factory.mktemp("small_corpus")
    texts = list(stdlib_texts().values())
    texts += ["x", "", "def f():\n    pass\n", "a b c d e f g", "print('hello')\n" * 20]
    texts += [t[: len(t) // 3] for t in texts[:3]]
    with open(root / "docs.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    from k2_data import TokenizeConfig, tokenize_corpus

    out = tmp_path_factory.mktemp("small_tok")
    tokenize_corpus([root / "docs.jsonl"], out, config=TokenizeConfig(shard_bytes=5000))
    return out
