"""StatefulLoader: rank sharding, exact resume, independence from the worker count."""

from __future__ import annotations

import pytest
import torch
from k2_data import PackedDataset, StatefulLoader


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def ds(small_dataset):
    return PackedDataset(small_dataset, seq_len=48, seed=7, document_mask=True)


def test_batches_are_the_dataset_samples(ds):
    loader = StatefulLoader(ds, batch_size=3)
    batches = _take(loader, 4)
    for t, batch in enumerate(batches):
        assert batch["input_ids"].shape == (3, 48) and batch["input_ids"].dtype == torch.long
        for b in range(3):
            ref = ds[t * 3 + b]
            for k in ("input_ids", "shift_labels", "position_ids", "document_ids"):
                assert batch[k][b].tolist() == ref[k].tolist()


def test_ranks_partition_the_global_batch(ds):
    world, B = 3, 2
    single = StatefulLoader(ds, batch_size=world * B)
    ranks = [StatefulLoader(ds, batch_size=B, rank=r, world_size=world) for r in range(world)]
    for _ in range(len(ds) // (world * B) + 2):  # past an epoch boundary
        whole = next(single)
        parts = [next(r) for r in ranks]
        for k in whole:
            assert torch.equal(torch.cat([p[k] for p in parts]), whole[k])


@pytest.mark.parametrize("workers", [0, 3])
def test_resume_gives_exactly_the_next_batches(ds, workers):
    ref = StatefulLoader(ds, batch_size=4, num_workers=0)
    expected = _take(ref, 12)
    first = StatefulLoader(ds, batch_size=4, num_workers=workers, prefetch=3)
    got = _take(first, 5)
    state = first.state_dict()
    _take(first, 2)  # batches after the save (and prefetched ones) must not leak into the resume
    first.close()
    resumed = StatefulLoader(ds, batch_size=4, num_workers=workers)
    resumed.load_state_dict(state)
    got += _take(resumed, 7)
    assert all(_equal(a, b) for a, b in zip(got, expected))
    resumed.close()


def test_worker_count_does_not_change_order(ds):
    runs = []
    for workers in (0, 1, 4):
        loader = StatefulLoader(ds, batch_size=5, num_workers=workers, num_steps=9)
        runs.append(list(loader))
        assert loader.stats()["batches"] == 9 and loader.stats()["wait_s"] >= 0
        loader.close()
    assert len(runs[0]) == 9
    assert all(_equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))


def test_state_mismatch_is_refused(ds, small_dataset):
    state = StatefulLoader(ds, batch_size=4).state_dict()
    other = PackedDataset(small_dataset, seq_len=48, seed=8, document_mask=True)
    with pytest.raises(ValueError, match="different data, seq_len, seed or split"):
        StatefulLoader(other, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="global batch"):
        StatefulLoader(ds, batch_size=3).load_state_dict(state)
    # same global batch over a different world size resumes at the same global sample
    two = StatefulLoader(ds, batch_size=2, rank=1, world_size=2)
    two.load_state_dict(state | {"step": 3})
    assert list(two.sample_indices(two.step)) == [3 * 4 + 2, 3 * 4 + 3]
    with pytest.raises(ValueError, match="rank"):
        StatefulLoader(ds, batch_size=2, rank=2, world_size=2)


def test_a_moved_corpus_keeps_its_identity_and_old_states_still_load(tmp_path):
    """The same documents at another path (new file times) tokenize to the same content identity,
    so a loader state written against one copy resumes against the other; a state keyed the way
    earlier versions keyed it (the tokenization plan: paths and times) still loads too."""
    import json
    import os
    import shutil

    from k2_data import TokenizeConfig, tokenize_corpus

    a = tmp_path / "a"
    a.mkdir()
    (a / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " * (i + 3)}) + "\n" for i in range(30))
    )
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    os.utime(b / "docs.jsonl", (1_000_000, 1_000_000))
    cfg = TokenizeConfig(shard_bytes=400)
    ma = tokenize_corpus([a / "docs.jsonl"], tmp_path / "tok_a", config=cfg)
    mb = tokenize_corpus([b / "docs.jsonl"], tmp_path / "tok_b", config=cfg)
    assert ma["plan_sha256"] != mb["plan_sha256"]  # the plan sees paths and times
    assert ma["content_sha256"] == mb["content_sha256"] is not None
    da, db = (PackedDataset(tmp_path / t, seq_len=16, seed=3) for t in ("tok_a", "tok_b"))
    assert da.fingerprint() == db.fingerprint()
    la = StatefulLoader(da, batch_size=2)
    _take(la, 3)
    state = la.state_dict()
    lb = StatefulLoader(db, batch_size=2)
    lb.load_state_dict(state)
    assert _equal(next(la), next(lb))
    legacy = dict(state, dataset=db._fingerprint(mb["plan_sha256"]))
    StatefulLoader(db, batch_size=2).load_state_dict(legacy)  # what earlier versions stored
    other = PackedDataset(tmp_path / "tok_b", seq_len=16, seed=4)  # another sample order: refused
    with pytest.raises(ValueError, match="loader state is for dataset"):
        StatefulLoader(other, batch_size=2).load_state_dict(state)
