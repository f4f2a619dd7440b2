"""MixedDataset: sources interleaved by weight, each in its own order, resumable like one dataset."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from k2_data import PackedDataset, StatefulLoader, TokenizeConfig, tokenize_corpus
from k2_data.mixture import BLOCK, MixedDataset, parse_mixture


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, word in (("raw", "alpha beta gamma"), ("reph", "delta epsilon zeta eta")):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f"{word} {i} " * 8}) + "\n" for i in range(60)))
        tokenize_corpus([src], root / name, config=TokenizeConfig(workers=1))
        out.append(PackedDataset(root / name, seq_len=32, seed=1))
    return out


def _rows(ds, n):
    return [ds[g]["input_ids"].tobytes() for g in range(n)]


def test_weights_are_realised_and_each_source_keeps_its_order(two_sources):
    raw, reph = two_sources
    mix = MixedDataset([raw, reph], [0.75, 0.25], seed=3)
    n = 2 * BLOCK + 100  # across block boundaries
    where = [mix.locate(g) for g in range(n)]
    share = np.bincount([s for s, _ in where], minlength=2) / n
    assert share[0] == pytest.approx(0.75, abs=0.02)
    for s in (0, 1):  # every source is read in its own order: 0, 1, 2, ... with no gap or repeat
        idx = [i for src, i in where if src == s]
        assert idx == list(range(len(idx)))
    for g in (0, 1, BLOCK - 1, BLOCK, n - 1):
        s, i = where[g]
        assert np.array_equal(mix[g]["input_ids"], (raw, reph)[s][i]["input_ids"])


def test_deterministic_by_seed_and_picklable(two_sources):
    a = MixedDataset(two_sources, [1, 1], seed=0)
    b = pickle.loads(pickle.dumps(MixedDataset(two_sources, [1, 1], seed=0)))
    assert _rows(a, 50) == _rows(b, 50) and a.fingerprint() == b.fingerprint()
    c = MixedDataset(two_sources, [1, 1], seed=1)
    assert _rows(a, 50) != _rows(c, 50) and a.fingerprint() != c.fingerprint()
    assert MixedDataset(two_sources, [1, 2], seed=0).fingerprint() != a.fingerprint()


def test_loader_resumes_the_mixture(two_sources):
    mix = MixedDataset(two_sources, [0.5, 0.5], seed=2)
    full = StatefulLoader(mix, batch_size=4)
    want = [next(full)["input_ids"] for _ in range(6)]
    first = StatefulLoader(mix, batch_size=4)
    for _ in range(3):
        next(first)
    resumed = StatefulLoader(MixedDataset(two_sources, [0.5, 0.5], seed=2), batch_size=4)
    resumed.load_state_dict(first.state_dict())
    got = [next(resumed)["input_ids"] for _ in range(3)]
    assert all(np.array_equal(w, g) for w, g in zip(want[3:], got))
    other = StatefulLoader(MixedDataset(two_sources, [0.4, 0.6], seed=2), batch_size=4)
    with pytest.raises(ValueError, match="loader state is for dataset"):
        other.load_state_dict(first.state_dict())


def test_mismatched_sources_are_refused(two_sources, tmp_path):
    raw, _ = two_sources
    other = PackedDataset(raw.source, seq_len=16, seed=1)
    with pytest.raises(ValueError, match="seq_len=16"):
        MixedDataset([raw, other], [1, 1])
    with pytest.raises(ValueError, match="weights must be > 0"):
        MixedDataset([raw, raw], [1, 0])


def test_parse_mixture():
    assert parse_mixture("data/tok") == [("data/tok", 1.0)]
    assert parse_mixture("raw:0.5, reph:0.5") == [("raw", 0.5), ("reph", 0.5)]
    assert parse_mixture("/a/b:c:2") == [("/a/b:c", 2.0)]
    for bad, msg in (
        ("raw:x", "not a number"),
        ("raw:0", "must be > 0"),
        ("raw:1,raw:2", "twice"),
        (":1", "PATH:WEIGHT"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_mixture(bad)
