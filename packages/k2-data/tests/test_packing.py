"""Packing against a plain-Python reference: concatenate (docs in seeded order + EOS), cut windows."""

from __future__ import annotations

import numpy as np
import pytest
from k2_data import IGNORE_INDEX, PackedDataset, load_manifest
from k2_data.packing import load_token_arrays


def _reference_epoch(ds: PackedDataset, epoch: int):
    """(windows in visiting order, per-window document index of each token) by the definition."""
    tokens, offsets, doc_ids, _ = load_token_arrays(ds.source)
    docs = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(doc_ids)) if doc_ids[i] in set(ds.doc_ids)]
    order = np.random.default_rng([ds.seed, epoch]).permutation(len(docs)) if ds.shuffle else range(len(docs))
    stream, owner = [], []
    for j, d in enumerate(order):
        stream += docs[d] + [ds.eos_id]
        owner += [j] * (len(docs[d]) + 1)
    S = ds.seq_len
    n = (len(stream) - 1) // S
    visit = np.random.default_rng([ds.seed, epoch, 1]).permutation(n) if ds.shuffle else range(n)
    return [(stream[k * S : k * S + S + 1], owner[k * S : k * S + S + 1]) for k in visit], stream


@pytest.mark.parametrize("seq_len,seed", [(64, 0), (97, 5), (1000, 1)])
def test_samples_equal_reference(small_dataset, seq_len, seed):
    ds = PackedDataset(small_dataset, seq_len=seq_len, seed=seed)
    windows, stream = _reference_epoch(ds, 0)
    windows1, _ = _reference_epoch(ds, 1)
    assert len(ds) == len(windows) == (len(stream) - 1) // seq_len
    assert ds.num_stream_tokens == len(stream) == load_manifest(small_dataset)["num_tokens"] + ds.num_docs
    for g in range(len(ds)):
        sample = ds[g]
        assert sample["input_ids"].tolist() == windows[g][0][:-1]
        assert sample["labels"].tolist() == windows[g][0][1:]
    for g in range(min(len(ds), 5)):  # the next epoch has its own order
        assert ds[len(ds) + g]["input_ids"].tolist() == windows1[g][0][:-1]
    # every stream token after the first is a label exactly once per epoch
    labels = np.concatenate([ds[g]["labels"] for g in range(len(ds))])
    assert sorted(labels.tolist()) == sorted(stream[1 : len(ds) * seq_len + 1])


def test_document_mask_positions_and_labels(small_dataset):
    ds = PackedDataset(small_dataset, seq_len=128, seed=3, document_mask=True)
    windows, _ = _reference_epoch(ds, 0)
    crossed = 0
    for g in range(len(ds)):
        toks, owner = windows[g]
        s = ds[g]
        pos, seg = [], []
        for t in range(128):
            new = t == 0 or owner[t] != owner[t - 1]
            pos.append(0 if new else pos[-1] + 1)
            seg.append((seg[-1] + 1 if seg else 0) if new else seg[-1])
        assert s["position_ids"].tolist() == pos
        assert s["doc_ids"].tolist() == seg
        want = [toks[t + 1] if owner[t + 1] == owner[t] else IGNORE_INDEX for t in range(128)]
        assert s["labels"].tolist() == want
        crossed += want.count(IGNORE_INDEX)
        # an ignored label sits exactly on an EOS input
        assert all(s["input_ids"][t] == ds.eos_id for t in range(128) if want[t] == IGNORE_INDEX)
    assert crossed > 0


def test_val_split_is_disjoint_and_fixed(small_dataset):
    train = PackedDataset(small_dataset, seq_len=32, val_fraction=0.3, seed=0)
    val = PackedDataset(small_dataset, seq_len=32, val_fraction=0.3, seed=9, split="val")
    allds = PackedDataset(small_dataset, seq_len=32, split="all")
    assert set(train.doc_ids).isdisjoint(val.doc_ids)
    assert sorted(set(train.doc_ids) | set(val.doc_ids)) == sorted(allds.doc_ids)
    assert 0 < val.num_docs < allds.num_docs
    again = PackedDataset(small_dataset, seq_len=32, val_fraction=0.3, seed=1)
    assert list(again.doc_ids) == list(train.doc_ids)  # the split does not depend on the seed


def test_determinism_and_seed(small_dataset):
    a, b = PackedDataset(small_dataset, 64, seed=1), PackedDataset(small_dataset, 64, seed=1)
    c = PackedDataset(small_dataset, 64, seed=2)
    assert all(np.array_equal(a[g]["input_ids"], b[g]["input_ids"]) for g in range(20))
    assert not all(np.array_equal(a[g]["input_ids"], c[g]["input_ids"]) for g in range(20))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    plain = PackedDataset(small_dataset, 64, shuffle=False)
    tokens, offsets, _, _ = load_token_arrays(small_dataset)
    assert plain[0]["input_ids"].tolist() == tokens[:64].tolist()


def test_errors_name_the_problem(small_dataset, tmp_path):
    with pytest.raises(ValueError, match="too few for one sample of seq_len=10000000"):
        PackedDataset(small_dataset, seq_len=10_000_000)
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        PackedDataset(tmp_path, seq_len=8)
    with pytest.raises(ValueError, match="split must be"):
        PackedDataset(small_dataset, seq_len=8, split="test")


def test_pickles_for_worker_processes(small_dataset):
    import pickle

    ds = PackedDataset(small_dataset, 64, seed=4, document_mask=True)
    ds[len(ds) + 3]  # populate the epoch cache; it is rebuilt, not shipped
    copy = pickle.loads(pickle.dumps(ds))
    for g in (0, 5, len(ds) + 3):
        assert all(np.array_equal(ds[g][k], copy[g][k]) for k in ds[g])
