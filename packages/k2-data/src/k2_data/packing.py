"""Pack tokenized documents into fixed-length training sequences.

Legend: S = seq_len, N = number of documents, T = tokens in the corpus.

Every epoch, documents are put in a seeded random order and concatenated with EOS after each
one; the stream is cut into windows of S + 1 tokens at stride S (`input_ids` = window[:-1],
`shift_labels` = window[1:]), so every token of the epoch is a label exactly once. The windows of
an epoch are then visited in a second seeded order. Sample `g` of the infinite sequence is window
`order_e[g mod n]` of epoch `e = g // n`, a pure function of (corpus, S, seed, split, g): this is
what lets the loader resume at exactly the next sample and be independent of worker counts.

The label convention (one for k2-data, k2-model and k2-train): `shift_labels[t]` is the target of
position t, already the next token, as transformers' `shift_labels` loss argument. A sample's keys
are the keyword arguments of `K2ForCausalLM.forward`, so `model(**sample).loss` is the training
loss; there is no `labels` key, which the model (like HF) would shift a second time.

With `document_mask=True`, each sample also carries `position_ids` that restart at 0 where a
document starts and `document_ids` (segment numbers inside the sample, for a same-document
attention mask), and the label of each EOS that is followed by another document is ignored
(-100): across the boundary there is nothing to predict from the masked context.

Chat (SFT) datasets, written by `k2 data sft` (manifest `"kind": "chat"`), carry a `loss_mask` per
token: `shift_labels[t]` is -100 wherever the target token (t + 1 in the stream) has mask 0, so
only assistant turns are learned. The EOS the stream appends after a document has mask 0.

`packing="whole"` keeps documents whole instead: per epoch, documents in the same seeded order go
next-fit into bins of S tokens (a document that does not fit in the current bin opens the next
one), and sample k of the epoch is bin k, padded to S with the pad id (labels -100). No EOS is
appended; the last token of each document has label -100 (it has no next token in the sample);
`position_ids` restart per document and `document_ids` number the documents (the padding is one
more segment), whatever `document_mask` says. A document longer than S is cut to its first S
tokens (`num_truncated` counts them). Bins vary in number between epochs, so sample g's epoch is
found from the cumulative bin counts, computed once per epoch: still a pure function of
(corpus, S, seed, split, g). Every label of the epoch's kept tokens occurs exactly once.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from k2_data.ingest import MANIFEST, TOKENIZER_SUBDIR, load_manifest

IGNORE_INDEX = -100


def _splitmix64(x_N: np.ndarray) -> np.ndarray:
    """A fixed integer hash (splitmix64) used to assign documents to train/validation."""
    with np.errstate(over="ignore"):
        z = x_N.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _numpy(arr: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A zero-copy numpy view of a null-free primitive Arrow array (its .to_numpy() imports pandas)."""
    if arr.null_count:
        raise ValueError(f"unexpected nulls in a {arr.type} column")
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(
        arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize
    )


@dataclass
class DocIndex:
    """Where every document's tokens are: chunk arrays (memory-mapped views for Arrow shards, so
    the corpus is not copied into RAM) and per-document (chunk, start, length, doc_id)."""

    chunks: list[np.ndarray]
    chunk_N: np.ndarray
    start_N: np.ndarray
    length_N: np.ndarray
    doc_id_N: np.ndarray
    manifest: dict
    keepalive: list  # the Arrow tables (and their memory maps) the views point into
    mask_chunks: list[np.ndarray] | None = None  # chat data: the loss_mask values, parallel to `chunks`


def load_doc_index(directory: str | Path) -> DocIndex:
    directory = Path(directory)
    manifest = load_manifest(directory)
    chat = manifest.get("kind") == "chat"
    columns = ["input_ids", "doc_id"] + (["loss_mask"] if chat else [])
    chunks, chunk_ids, starts, lengths, doc_ids, tables, masks = [], [], [], [], [], [], []
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} listed in {directory / MANIFEST} is missing")
        if manifest["format"] == "arrow":
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()  # zero-copy
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(str(path), columns=columns)
        if table.num_rows != shard["rows"]:
            raise ValueError(f"{path}: {table.num_rows} rows, manifest says {shard['rows']}")
        if chat and "loss_mask" not in table.column_names:
            raise ValueError(f"{path}: a chat dataset's shard has no loss_mask column")
        tables.append(table)
        for batch in table.select(columns).to_batches():  # record batches: the columns chunked alike
            chunk = batch.column(0)
            offsets = _numpy(chunk.offsets, np.int32).astype(np.int64)
            chunk_ids.append(np.full(len(chunk), len(chunks), np.int64))
            chunks.append(_numpy(chunk.values, np.int32))
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets))
            doc_ids.append(_numpy(batch.column(1), np.int64))
            if chat:
                mask = batch.column(2)
                if not np.array_equal(_numpy(mask.offsets, np.int32), offsets):
                    raise ValueError(f"{path}: loss_mask and input_ids differ in length in some row")
                masks.append(_numpy(mask.values, np.uint8))

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    index = DocIndex(
        chunks,
        cat(chunk_ids, np.int64),
        cat(starts, np.int64),
        cat(lengths, np.int64),
        cat(doc_ids, np.int64),
        manifest,
        tables,
        masks if chat else None,
    )
    if int(index.length_N.sum()) != manifest["num_tokens"]:
        raise ValueError(
            f"{directory}: {index.length_N.sum()} tokens in shards, manifest says {manifest['num_tokens']}"
        )
    return index


def load_token_arrays(directory: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """All documents in one copy: (tokens_T int32, offsets_N+1 int64, doc_ids_N, manifest)."""
    ix = load_doc_index(directory)
    docs = [ix.chunks[c][s : s + n] for c, s, n in zip(ix.chunk_N, ix.start_N, ix.length_N)]
    tokens_T = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
    offsets_N1 = np.zeros(len(docs) + 1, np.int64)
    np.cumsum(ix.length_N, out=offsets_N1[1:])
    return tokens_T, offsets_N1, ix.doc_id_N, ix.manifest


@dataclass
class _Epoch:
    doc_order_N: np.ndarray  # documents in stream (or packing) order
    stream_starts_N1: np.ndarray | None = None  # stream: where each document (plus its EOS) starts
    window_order: np.ndarray | None = None  # stream: visiting order of the windows
    bin_starts_K1: np.ndarray | None = None  # whole: bin k holds doc_order_N[bin_starts[k]:bin_starts[k+1]]


def next_fit(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Bin boundaries (K + 1 indexes into `lengths`) of next-fit packing into bins of `seq_len`:
    items go in order; one that does not fit in the current bin closes it and opens the next."""
    starts = [0]
    fill = 0
    for i, n in enumerate(np.minimum(lengths, seq_len).tolist()):
        if fill + n > seq_len:
            starts.append(i)
            fill = 0
        fill += n
    starts.append(len(lengths))
    return np.asarray(starts, np.int64)


class PackedDataset:
    """Fixed-length samples from a tokenized dataset directory (one written by `k2 data tokenize` or
    `k2 data sft`).

    `split="train"|"val"` holds out about `val_fraction` of the documents, chosen by a fixed hash
    of their doc_id (independent of `seed`). `len()` is the number of samples per epoch (with
    `packing="whole"`: of epoch 0; see `epoch_bounds`); indices beyond it continue into the next
    epoch, so `dataset[g]` is defined for every g >= 0. `packing` is "stream" (documents + EOS cut
    into windows) or "whole" (whole documents per sample, padded with `pad_id`, default the
    tokenizer's pad id); see the module docstring.
    """

    def __init__(
        self,
        source: str | Path,
        seq_len: int,
        seed: int = 0,
        split: str = "train",
        val_fraction: float = 0.0,
        document_mask: bool = False,
        shuffle: bool = True,
        eos_id: int | None = None,
        packing: str = "stream",
        pad_id: int | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if packing not in ("stream", "whole"):
            raise ValueError(f"packing must be 'stream' or 'whole', got {packing!r}")
        self.packing = packing
        self.source = Path(source)
        self.seq_len, self.seed, self.split = seq_len, seed, split
        self.val_fraction, self.document_mask, self.shuffle = val_fraction, document_mask, shuffle
        index = load_doc_index(self.source)
        manifest, doc_ids_N = index.manifest, index.doc_id_N
        self.manifest = manifest
        self.eos_id = int(manifest["tokenizer"]["eos_id"] if eos_id is None else eos_id)
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        if pad_id is None:
            pad_id = manifest["tokenizer"].get("pad_id")
        self.pad_id = int(self.eos_id if pad_id is None else pad_id)
        self.has_loss_mask = index.mask_chunks is not None

        in_val_N = (_splitmix64(doc_ids_N) % np.uint64(1_000_000)) < np.uint64(
            int(round(val_fraction * 1_000_000))
        )
        keep_N = {"train": ~in_val_N, "val": in_val_N, "all": np.ones_like(in_val_N)}[split]
        self._index = index
        self._doc_chunk_N = index.chunk_N[keep_N]
        self._doc_start_N = index.start_N[keep_N]
        self._doc_len_N = index.length_N[keep_N]
        self.doc_ids = doc_ids_N[keep_N]
        self.num_docs = int(keep_N.sum())
        self.num_stream_tokens = int(self._doc_len_N.sum()) + self.num_docs  # + one EOS per document
        self._epochs: dict[int, _Epoch] = {}
        self._lock = threading.Lock()  # loader threads may ask for a new epoch at the same time
        if packing == "whole":
            self.num_truncated = int((self._doc_len_N > seq_len).sum())  # documents cut to seq_len tokens
            if int(self._doc_len_N.sum()) == 0:
                raise ValueError(f"{self.source}: split {split!r} has no tokens")
            self._epoch_first = [0]  # first sample index of each epoch computed so far
            self._len = self.epoch_bounds(0)[1]
        else:
            self.num_truncated = 0
            self._len = max(0, (self.num_stream_tokens - 1) // seq_len)
            if self._len == 0:
                raise ValueError(
                    f"{self.source}: split {split!r} has {self.num_stream_tokens} tokens (with EOS), "
                    f"too few for one sample of seq_len={seq_len}"
                )

    def __getstate__(self) -> dict:
        # memory maps do not pickle: ship the path, reopen on the other side
        state = self.__dict__.copy()
        for key in ("_lock", "_index"):
            state.pop(key)
        state["_epochs"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._index = load_doc_index(self.source)
        if self._index.manifest["plan_sha256"] != self.manifest["plan_sha256"]:
            raise ValueError(f"{self.source} changed since this dataset was opened")

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens of each document of this split (EOS not counted), in corpus order."""
        return self._doc_len_N

    def __len__(self) -> int:
        return self._len

    @property
    def tokenizer_dir(self) -> Path:
        return self.source / TOKENIZER_SUBDIR

    def fingerprint(self) -> str:
        """Identifies the sample sequence: a loader state is only valid for an equal fingerprint.
        Keyed on the data's content (`content_sha256`), so a run resumes on the same corpus at
        another path or on another machine."""
        return self._fingerprint(self.manifest.get("content_sha256") or self.manifest["plan_sha256"])

    def fingerprints(self) -> set[str]:
        """Every fingerprint a loader state of this data may carry: the content-keyed one, and the
        one keyed on the tokenization plan (paths and file times) that earlier versions wrote."""
        return {self.fingerprint(), self._fingerprint(self.manifest["plan_sha256"])}

    def _fingerprint(self, data_key: str) -> str:
        key = [
            data_key,
            self.seq_len,
            self.seed,
            self.split,
            self.val_fraction,
            self.document_mask,
            self.shuffle,
            self.eos_id,
        ]
        if self.packing != "stream":  # stream keeps the key it had before packing modes existed
            key += [self.packing, self.pad_id]
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]

    def _epoch(self, e: int) -> _Epoch:
        with self._lock:
            return self._epochs[e] if e in self._epochs else self._new_epoch(e)

    def _new_epoch(self, e: int) -> _Epoch:
        if e not in self._epochs:
            if len(self._epochs) > 2:  # keep the current and next epoch
                self._epochs.pop(min(self._epochs))
            if self.shuffle:
                doc_order_N = np.random.default_rng([self.seed, e]).permutation(self.num_docs)
            else:
                doc_order_N = np.arange(self.num_docs)
            if self.packing == "whole":
                self._epochs[e] = _Epoch(
                    doc_order_N, bin_starts_K1=next_fit(self._doc_len_N[doc_order_N], self.seq_len)
                )
                return self._epochs[e]
            if self.shuffle:
                window_order = np.random.default_rng([self.seed, e, 1]).permutation(self._len)
            else:
                window_order = np.arange(self._len)
            starts_N1 = np.zeros(self.num_docs + 1, np.int64)
            np.cumsum(self._doc_len_N[doc_order_N] + 1, out=starts_N1[1:])
            self._epochs[e] = _Epoch(doc_order_N, starts_N1, window_order)
        return self._epochs[e]

    def epoch_bounds(self, e: int) -> tuple[int, int]:
        """`(first sample index, number of samples)` of epoch e (with "stream" packing: `(e * len, len)`)."""
        if self.packing == "stream":
            return e * self._len, self._len
        with self._lock:
            while len(self._epoch_first) <= e + 1:
                k = len(self._epoch_first) - 1
                bins = len(self._new_epoch(k).bin_starts_K1) - 1
                self._epoch_first.append(self._epoch_first[-1] + bins)
            return self._epoch_first[e], self._epoch_first[e + 1] - self._epoch_first[e]

    def _locate(self, g: int) -> tuple[int, int]:
        """(epoch, index inside the epoch) of sample g."""
        if g < 0:
            raise IndexError(f"sample index must be >= 0, got {g}")
        if self.packing == "stream":
            return divmod(g, self._len)
        e = max(0, bisect.bisect_right(self._epoch_first, g) - 1)
        while True:
            first, n = self.epoch_bounds(e)
            if g < first + n:
                return e, g - first
            e += 1

    def window(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample g's S + 1 stream tokens and the stream position where each token's document starts
        ("stream" packing only)."""
        tokens, seg_start, _ = self._window(g, with_mask=False)
        return tokens, seg_start

    def _window(self, g: int, with_mask: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if self.packing != "stream":
            raise ValueError("window() is defined for packing='stream' only")
        e, k = self._locate(g)
        ep = self._epoch(e)
        start = int(ep.window_order[k]) * self.seq_len
        end = start + self.seq_len + 1
        tokens = np.empty(self.seq_len + 1, np.int64)
        seg_start = np.empty(self.seq_len + 1, np.int64)
        mask = np.zeros(self.seq_len + 1, np.uint8) if with_mask else None  # EOS keeps mask 0
        i = int(np.searchsorted(ep.stream_starts_N1, start, side="right")) - 1
        pos = start
        while pos < end:
            d = int(ep.doc_order_N[i])
            doc_begin = int(ep.stream_starts_N1[i])
            doc_len = int(self._doc_len_N[d])
            lo, hi = pos - doc_begin, min(end - doc_begin, doc_len + 1)
            n_text = max(0, min(hi, doc_len) - lo)
            a = pos - start
            if n_text:
                s0 = int(self._doc_start_N[d]) + lo
                tokens[a : a + n_text] = self._index.chunks[int(self._doc_chunk_N[d])][s0 : s0 + n_text]
                if mask is not None:
                    mask[a : a + n_text] = self._index.mask_chunks[int(self._doc_chunk_N[d])][
                        s0 : s0 + n_text
                    ]
            if hi == doc_len + 1:
                tokens[a + n_text] = self.eos_id
            seg_start[a : a + hi - lo] = doc_begin
            pos += hi - lo
            i += 1
        return tokens, seg_start, mask

    def _whole_sample(self, g: int) -> dict[str, np.ndarray]:
        e, k = self._locate(g)
        ep = self._epoch(e)
        S = self.seq_len
        input_ids = np.full(S, self.pad_id, np.int64)
        labels = np.full(S, IGNORE_INDEX, np.int64)
        position_ids = np.zeros(S, np.int64)
        document_ids = np.zeros(S, np.int64)
        a = seg = 0
        for d in ep.doc_order_N[ep.bin_starts_K1[k] : ep.bin_starts_K1[k + 1]].tolist():
            n = min(int(self._doc_len_N[d]), S)
            if n == 0:
                continue
            c, s0 = int(self._doc_chunk_N[d]), int(self._doc_start_N[d])
            toks = self._index.chunks[c][s0 : s0 + n]
            input_ids[a : a + n] = toks
            target = toks[1:].astype(np.int64)
            if self.has_loss_mask:
                target[self._index.mask_chunks[c][s0 + 1 : s0 + n] == 0] = IGNORE_INDEX
            labels[a : a + n - 1] = target  # the document's last token keeps -100
            position_ids[a : a + n] = np.arange(n)
            document_ids[a : a + n] = seg
            a, seg = a + n, seg + 1
        position_ids[a:] = np.arange(S - a)  # the padding is one more segment
        document_ids[a:] = seg
        return {
            "input_ids": input_ids,
            "shift_labels": labels,
            "position_ids": position_ids,
            "document_ids": document_ids,
        }

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        if self.packing == "whole":
            return self._whole_sample(g)
        tokens, seg_start, mask = self._window(g, with_mask=self.has_loss_mask)
        sample = {"input_ids": tokens[:-1], "shift_labels": tokens[1:].copy()}
        if mask is not None:
            sample["shift_labels"][mask[1:] == 0] = IGNORE_INDEX  # the target is not an assistant token
        if self.document_mask:
            seg_S = seg_start[:-1]
            new_doc_S = np.empty(self.seq_len, bool)
            new_doc_S[0] = True
            new_doc_S[1:] = seg_S[1:] != seg_S[:-1]
            doc_ids_S = np.cumsum(new_doc_S) - 1
            first_S = np.maximum.accumulate(np.where(new_doc_S, np.arange(self.seq_len), 0))
            sample["position_ids"] = np.arange(self.seq_len) - first_S
            sample["document_ids"] = doc_ids_S
            # the label of an input token is in another document when the next input starts one
            crosses_S = np.zeros(self.seq_len, bool)
            crosses_S[:-1] = new_doc_S[1:]
            crosses_S[-1] = seg_start[-1] != seg_start[-2]
            sample["shift_labels"][crosses_S] = IGNORE_INDEX
        return sample
