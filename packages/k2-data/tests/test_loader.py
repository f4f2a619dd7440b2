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
