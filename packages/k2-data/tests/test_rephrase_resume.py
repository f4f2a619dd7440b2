"""Kill the rephrasing pipeline mid-run (SIGKILL, a subprocess), restart it, and check from the server's
request log that no completed chunk is requested again and from the shards that every (document, round)
appears exactly once with the right text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from k2_data.loopback import LoopbackServer, Reply
from k2_data.rephrase import chunk_text, read_rows
from k2_data.rephrase import prompts as P
from k2_data.rephrase.pipeline import STATE_DIR, iter_journal

N_DOCS, ROUNDS, CHUNK_TOKENS = 24, 2, 32


def faithful(passage: str) -> str:
    return passage.replace("The ", "This ")


def respond(request: dict) -> Reply:
    return Reply(content=faithful(P.passage_of(request["messages"])))


def key(request: dict) -> tuple[str, str]:
    """A chunk request: (style instruction, passage); rounds of one document differ in the instruction."""
    return request["messages"][0]["content"], P.passage_of(request["messages"])


def make_docs() -> list[str]:
    return [
        " ".join(
            f"The note {d}.{i} records that crate {d * 100 + i} left dock {i} on day {d + i}."
            for i in range(9)
        )
        for d in range(N_DOCS)
    ]


def start(path: Path, out: Path, base_url: str, cache: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k2_data.rephrase", str(path), "--out", str(out), "--base-url", base_url]
    cmd += [
        "--model",
        "m",
        "--rounds",
        str(ROUNDS),
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        "--min-similarity",
        "0",
    ]
    cmd += ["--concurrency", "4", "--shard-docs", "6", "--no-progress", "--cache", str(cache)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def completed_chunks(
    out: Path, docs: list[str], system_of: dict[tuple[int, int], str]
) -> set[tuple[str, str]]:
    """(instruction, passage) of every chunk finished before the kill: journal lines and written shards."""
    done = set()
    for j in (out / STATE_DIR / "journal").glob("*.jsonl"):
        for e in iter_journal(j):
            done.add((system_of[e["doc_id"], e["round"]], docs[e["doc_id"]][e["start"] : e["end"]]))
    for row in read_rows(out):
        for span in row["chunk_spans"]:
            done.add(
                (system_of[row["doc_id"], row["round"]], docs[row["doc_id"]][span["start"] : span["end"]])
            )
    return done


@pytest.mark.slow  # kills and restarts a k2 data rephrase process
def test_kill_and_resume_loses_and_repeats_nothing(tmp_path):
    docs = make_docs()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    n_chunks = len(chunk_text(docs[0], CHUNK_TOKENS))
    assert n_chunks >= 3
    total = N_DOCS * ROUNDS * n_chunks
    out, cache = tmp_path / "out", tmp_path / "cache.sqlite"
    with LoopbackServer(respond, latency_s=0.03) as server:
        proc = start(path, out, server.base_url, cache)
        deadline = time.time() + 60
        while len(server.requests) < total // 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        first = list(server.requests)
        # the prompt of (doc, round) is deterministic: recompute it as the pipeline does
        lib = P.of_kind(P.load_prompts(), "knowledge")
        system_of = {
            (d, r): P.messages(P.choose(lib, 0, f"{path}:{d + 1}", r), "x")[0]["content"]
            for d in range(N_DOCS)
            for r in range(ROUNDS)
        }
        done = completed_chunks(out, docs, system_of)
        assert 0 < len(done) < total, "the kill must land mid-run"
        assert {key(r) for r in first} >= done
        # a torn journal line, as a kill mid-write leaves it
        journals = sorted((out / STATE_DIR / "journal").glob("*.jsonl"))
        assert journals, "some shard must be in progress at the kill"
        with open(journals[-1], "ab") as f:
            f.write(b'{"doc_id": 3, "round": 0, "chu')
        cache.unlink()  # prove the journal, not the cache, prevents the repeats
        for extra in ("-wal", "-shm"):
            Path(str(cache) + extra).unlink(missing_ok=True)

        n_before = len(server.requests)
        proc = start(path, out, server.base_url, cache)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        second = server.requests[n_before:]
    again = [key(r) for r in second]
    assert not set(again) & done, "a chunk completed before the kill was requested again"
    assert len(again) == len(set(again))
    assert len(done) + len(again) >= total  # everything not finished before was requested after
    rows = read_rows(out)
    assert sorted((r["doc_id"], r["round"]) for r in rows) == [
        (d, r) for d in range(N_DOCS) for r in range(ROUNDS)
    ]
    for row in rows:
        assert row["text"] == faithful(docs[row["doc_id"]]) and row["all_accepted"]
    assert not list((out / STATE_DIR / "journal").glob("*.jsonl"))  # journals go once their shard is written
    manifest = json.loads((out / STATE_DIR / "manifest.json").read_text())
    assert manifest["chunks_resumed"] > 0 and manifest["documents"] == N_DOCS * ROUNDS
