"""Packing against a plain-Python reference: concatenate (docs in seeded order + EOS), cut windows."""

from __future__ import annotations

import numpy as np
import pytest
from k2_data import IGNORE_INDEX, PackedDataset, load_manifest
from k2_data.packing import load_token_arrays


def _reference_epoch(ds: PackedDataset, epoch: int):
    """(windows in visiting order, per-window document index of each token) by the definition."""
    tokens, offsets, doc_ids, _ = load_token_arrays(ds.source)
    docs = [
        tokens[offsets[i] : offsets[i + 1]].tolist()
        for i in range(len(doc_ids))
        if doc_ids[i] in set(ds.doc_ids)
    ]
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
        assert sample["shift_labels"].tolist() == windows[g][0][1:]
    for g in range(min(len(ds), 5)):  # the next epoch has its own order
        assert ds[len(ds) + g]["input_ids"].tolist() == windows1[g][0][:-1]
    # every stream token after the first is a label exactly once per epoch
    labels = np.concatenate([ds[g]["shift_labels"] for g in range(len(ds))])
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
        assert s["document_ids"].tolist() == seg
        want = [toks[t + 1] if owner[t + 1] == owner[t] else IGNORE_INDEX for t in range(128)]
        assert s["shift_labels"].tolist() == want
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


# ----------------------------------------------------------------------------- whole-document packing


def _docs_and_masks(directory, ds):
    """The split's documents (token lists) and loss masks (all 1 for text data), read with pyarrow directly."""
    import pyarrow as pa

    m = load_manifest(directory)
    docs, masks = {}, {}
    for shard in m["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(directory / shard["file"]))).read_all()
        for row in table.to_pylist():
            docs[row["doc_id"]] = row["input_ids"]
            masks[row["doc_id"]] = row.get("loss_mask", [1] * len(row["input_ids"]))
    keep = [int(d) for d in ds.doc_ids]
    return [docs[d] for d in keep], [masks[d] for d in keep]


def _reference_whole(ds, docs, masks, epoch):
    """Samples of one epoch by the definition: seeded order, next-fit bins of S, pad, per-document labels."""
    S = ds.seq_len
    order = np.random.default_rng([ds.seed, epoch]).permutation(len(docs)) if ds.shuffle else range(len(docs))
    bins, cur, fill = [], [], 0
    for d in order:
        n = min(len(docs[d]), S)
        if fill + n > S:
            bins.append(cur)
            cur, fill = [], 0
        cur.append(d)
        fill += n
    bins.append(cur)
    out = []
    for b in bins:
        ids, labels, pos, seg = [], [], [], []
        for d in b:
            t, m = docs[d][:S], masks[d][:S]
            if not t:
                continue
            labels += [t[i + 1] if m[i + 1] else IGNORE_INDEX for i in range(len(t) - 1)] + [IGNORE_INDEX]
            seg += [seg[-1] + 1 if seg else 0] * len(t)
            ids += t
            pos += list(range(len(t)))
        pad = S - len(ids)
        seg_pad = (seg[-1] + 1) if seg else 0
        out.append(
            {
                "input_ids": ids + [ds.pad_id] * pad,
                "shift_labels": labels + [IGNORE_INDEX] * pad,
                "position_ids": pos + list(range(pad)),
                "document_ids": seg + [seg_pad] * pad,
            }
        )
    return out


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    """Tool-use conversations (443-553 tokens each) and short chit-chat (20-80 tokens) tokenized for SFT."""
    import json

    from k2_data.examples.tooluse import generate_tooluse
    from k2_data.sft import ChatTokenizeConfig, tokenize_chat

    root = tmp_path_factory.mktemp("chat_src")
    train, _ = generate_tooluse(16, 0, seed=5)
    short = [
        {
            "messages": [
                {"role": "user", "content": "hi " * k},
                {"role": "assistant", "content": "hello " * (k + 2)},
            ]
        }
        for k in range(1, 25)
    ]
    with open(root / "chat.jsonl", "w") as f:
        for rec in train + short:
            f.write(json.dumps(rec) + "\n")
    out = tmp_path_factory.mktemp("chat_tok")
    tokenize_chat([root / "chat.jsonl"], out, config=ChatTokenizeConfig(shard_bytes=6000))
    return out


@pytest.mark.parametrize(
    "which,seq_len,seed", [("text", 256, 0), ("text", 1000, 3), ("chat", 512, 1), ("chat", 1200, 2)]
)
def test_whole_packing_equals_reference(small_dataset, chat_dataset, which, seq_len, seed):
    directory = small_dataset if which == "text" else chat_dataset
    ds = PackedDataset(directory, seq_len=seq_len, seed=seed, packing="whole")
    docs, masks = _docs_and_masks(directory, ds)
    ref0, ref1 = _reference_whole(ds, docs, masks, 0), _reference_whole(ds, docs, masks, 1)
    assert len(ds) == len(ref0) and ds.epoch_bounds(1) == (len(ref0), len(ref1))
    assert ds.num_truncated == sum(len(d) > seq_len for d in docs)
    # the stdlib files reach ~3000 tokens, the tool-use conversations 443-553: only chat at 1200 cuts none
    assert (ds.num_truncated > 0) == (which == "text" or seq_len == 512)
    assert ds.pad_id == load_manifest(directory)["tokenizer"]["pad_id"]
    for g in range(len(ds)):
        assert {k: v.tolist() for k, v in ds[g].items()} == ref0[g]
    for k in range(min(len(ref1), 4)):  # the next epoch: its own order and its own number of bins
        assert {k2: v.tolist() for k2, v in ds[len(ds) + k].items()} == ref1[k]
    # every trained token of the epoch is a label exactly once: the targets of each (truncated) document
    labels = [t for g in range(len(ds)) for t in ds[g]["shift_labels"].tolist() if t != IGNORE_INDEX]
    want = [t for d, m in zip(docs, masks) for t, keep in zip(d[1:seq_len], m[1:seq_len]) if keep]
    assert sorted(labels) == sorted(want) and len(labels) == len(want) > 0
    if which == "chat":
        assert ds.has_loss_mask and len(want) < sum(min(len(d), seq_len) - 1 for d in docs)


def test_whole_packing_samples_hold_whole_documents(chat_dataset):
    ds = PackedDataset(chat_dataset, seq_len=1200, seed=0, packing="whole")
    docs, _ = _docs_and_masks(chat_dataset, ds)
    starts = {tuple(d[:8]) for d in docs}
    seen = 0
    for g in range(len(ds)):
        s = ds[g]
        for seg in np.unique(s["document_ids"]):
            sel = s["document_ids"] == seg
            piece = s["input_ids"][sel].tolist()
            if s["position_ids"][sel][0] == 0 and piece[0] != ds.pad_id:
                assert piece in docs  # a whole document, never a part (none is longer than 1200)
                assert tuple(piece[:8]) in starts
                seen += 1
        assert (s["position_ids"] >= 0).all() and s["input_ids"].shape == (1200,)
    assert seen == len(docs) and ds.num_truncated == 0


def test_whole_packing_determinism_fingerprint_and_errors(small_dataset):
    a = PackedDataset(small_dataset, 256, seed=1, packing="whole")
    b = PackedDataset(small_dataset, 256, seed=1, packing="whole")
    c = PackedDataset(small_dataset, 256, seed=2, packing="whole")
    stream = PackedDataset(small_dataset, 256, seed=1)
    g_all = range(len(a) + 5)
    assert all(np.array_equal(a[g]["input_ids"], b[g]["input_ids"]) for g in g_all)
    assert not all(np.array_equal(a[g]["input_ids"], c[g]["input_ids"]) for g in range(len(a)))
    assert (
        a.fingerprint() == b.fingerprint()
        and len({a.fingerprint(), c.fingerprint(), stream.fingerprint()}) == 3
    )
    # saved loader states stay valid: the fingerprint stream packing had before packing modes and
    # content identities existed (keyed on the tokenization plan) is still accepted
    import hashlib

    key = [stream.manifest["plan_sha256"], 256, 1, "train", 0.0, False, True, stream.eos_id]
    assert hashlib.sha256(repr(key).encode()).hexdigest()[:16] in stream.fingerprints()
    key[0] = stream.manifest["content_sha256"]  # today's: the same key over the data's content
    assert stream.fingerprint() == hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    # samples do not depend on which indices were asked for before (a fresh dataset, jumping ahead)
    late = len(a) + a.epoch_bounds(1)[1] + 2  # inside epoch 2
    assert np.array_equal(
        PackedDataset(small_dataset, 256, seed=1, packing="whole")[late]["input_ids"], a[late]["input_ids"]
    )
    with pytest.raises(ValueError, match="packing must be 'stream' or 'whole'"):
        PackedDataset(small_dataset, 256, packing="greedy")
    with pytest.raises(ValueError, match="window\\(\\) is defined for packing='stream' only"):
        a.window(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_whole_packing_loader_resume_is_exact(chat_dataset, workers):
    import torch
    from k2_data import StatefulLoader

    ds = PackedDataset(chat_dataset, seq_len=512, seed=4, packing="whole")
    steps = (2 * len(ds)) // 3 + 2  # batch 3: past the end of epoch 0
    ref = StatefulLoader(ds, batch_size=3)
    expected = [next(ref) for _ in range(steps)]
    first = StatefulLoader(ds, batch_size=3, num_workers=workers)
    got = [next(first) for _ in range(5)]
    state = first.state_dict()
    first.close()
    again = PackedDataset(chat_dataset, seq_len=512, seed=4, packing="whole")  # a fresh process, in effect
    resumed = StatefulLoader(again, batch_size=3, num_workers=workers)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(steps - 5)]
    resumed.close()
    assert all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(got, expected)
    )
    assert set(expected[0]) == {"input_ids", "shift_labels", "position_ids", "document_ids"}
    with pytest.raises(ValueError, match="different data, seq_len, seed or split"):
        StatefulLoader(PackedDataset(chat_dataset, seq_len=512, seed=4), batch_size=3).load_state_dict(state)


def test_whole_packing_pickles(small_dataset):
    import pickle

    ds = PackedDataset(small_dataset, 300, seed=4, packing="whole", pad_id=0)
    g = len(ds) + 3
    copy = pickle.loads(pickle.dumps(ds))
    assert ds.pad_id == copy.pad_id == 0
    for i in (0, 5, g):
        assert all(np.array_equal(ds[i][k], copy[i][k]) for k in ds[i])
