"""Several packed datasets mixed by weight: raw and rephrased text, code and prose, any sources.

`MixedDataset([a, b], weights=[0.5, 0.5], seed=0)` is a dataset like `PackedDataset` (global
sample index, `len`, `fingerprint`, samples as dicts of arrays), so `StatefulLoader` and the
Trainer take it as they are and a resumed run continues the same sequence. Sample g comes from
the source a seeded weighted draw picks for g, and is that source's next sample (in the
source's own order, through its own epochs): the mixture never reorders a source, only
interleaves them, and each source's documents are seen as often as its weight says.

The draws are made in blocks of `BLOCK` samples, each block from its own seeded generator, so
sample g is found without drawing everything before it again (per-block counts are kept).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 4096


def parse_mixture(spec: str, what: str = "--data") -> list[tuple[str, float]]:
    """`"dirA:0.7,dirB:0.3"` -> [("dirA", 0.7), ("dirB", 0.3)]; the weight after the last ':'.

    A single source without a weight (`"dirA"`) is [("dirA", 1.0)]."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 1 and ":" not in parts[0]:
        return [(parts[0], 1.0)]
    out = []
    for part in parts:
        path, sep, weight = part.rpartition(":")
        if not sep or not path:
            raise ValueError(f"{what} {spec!r}: {part!r} is not PATH:WEIGHT (mix sources as a:0.5,b:0.5)")
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"{what} {spec!r}: weight {weight!r} of {path!r} is not a number") from None
        if not w > 0:
            raise ValueError(f"{what} {spec!r}: weight of {path!r} must be > 0, got {w:g}")
        out.append((path, w))
    if len({p for p, _ in out}) != len(out):
        raise ValueError(f"{what} {spec!r}: a source is listed twice")
    return out


class MixedDataset:
    """Samples from `sources` in proportion to `weights` (normalised), deterministically by `seed`."""

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], seed: int = 0) -> None:
        if len(sources) < 1 or len(sources) != len(weights):
            raise ValueError(f"MixedDataset: {len(sources)} sources and {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"MixedDataset: weights must be > 0, got {list(weights)}")
        first = sources[0]
        for s in sources[1:]:
            for attr in ("seq_len", "vocab_size", "eos_id", "packing"):
                if getattr(s, attr, None) != getattr(first, attr, None):
                    raise ValueError(
                        f"MixedDataset: {_name(s)} has {attr}={getattr(s, attr, None)!r} but "
                        f"{_name(first)} has {getattr(first, attr, None)!r}; mix datasets tokenized "
                        "with one tokenizer and packed alike"
                    )
        self.sources = list(sources)
        self.weights = np.asarray(weights, np.float64) / float(np.sum(weights))
        self.seed = seed
        self.seq_len, self.vocab_size, self.eos_id = first.seq_len, first.vocab_size, first.eos_id
        self.packing = getattr(first, "packing", None)
        self.has_loss_mask = any(getattr(s, "has_loss_mask", False) for s in self.sources)
        self._counts: list[np.ndarray] = [np.zeros(len(self.sources), np.int64)]  # draws before block b
        self._blocks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # loader threads ask for samples concurrently

    def __len__(self) -> int:
        """One nominal epoch: as many samples as the sources hold together."""
        return sum(len(s) for s in self.sources)

    @property
    def source(self) -> Path:
        return Path(getattr(self.sources[0], "source", "."))

    @property
    def tokenizer_dir(self) -> Path:
        return self.sources[0].tokenizer_dir

    def fingerprint(self) -> str:
        return self._fingerprint([s.fingerprint() for s in self.sources])

    def fingerprints(self) -> set[str]:
        """The content-keyed fingerprint and the plan-keyed one earlier versions wrote."""
        legacy = [min(s.fingerprints() - {s.fingerprint()} or {s.fingerprint()}) for s in self.sources]
        return {self.fingerprint(), self._fingerprint(legacy)}

    def _fingerprint(self, source_keys: list[str]) -> str:
        key = [*source_keys, self.weights.round(12).tolist(), self.seed, BLOCK]
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]

    def _block(self, b: int) -> np.ndarray:
        """The source of each sample of block b (cached: the current and the next block)."""
        with self._lock:
            if b not in self._blocks:
                if len(self._blocks) > 2:
                    self._blocks.pop(min(self._blocks))
                rng = np.random.default_rng([self.seed, b])
                self._blocks[b] = rng.choice(len(self.sources), size=BLOCK, p=self.weights)
            return self._blocks[b]

    def _count_before(self, b: int) -> np.ndarray:
        while len(self._counts) <= b:
            k = len(self._counts) - 1
            drawn = np.bincount(self._block(k), minlength=len(self.sources))
            with self._lock:
                if len(self._counts) == k + 1:
                    self._counts.append(self._counts[k] + drawn)
        return self._counts[b]

    def locate(self, g: int) -> tuple[int, int]:
        """(source, that source's sample index) of mixture sample g."""
        if g < 0:
            raise IndexError(f"sample index must be >= 0, got {g}")
        b, o = divmod(g, BLOCK)
        block = self._block(b)
        s = int(block[o])
        return s, int(self._count_before(b)[s]) + int(np.count_nonzero(block[:o] == s))

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        s, i = self.locate(g)
        return self.sources[s][i]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_lock")
        state["_blocks"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _name(ds: Any) -> str:
    return str(getattr(ds, "source", type(ds).__name__))


__all__ = ["MixedDataset", "parse_mixture"]
