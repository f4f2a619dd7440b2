"""A rank's registered checkpoint in host memory.

- `named_tensors` are copied once into one contiguous arena (pinned when CUDA is present, so
  the H2D copy is a DMA), which also detaches them from the trainer's live parameters. On
  CPU the arena is a shared `/dev/shm` file laid out exactly like the buckets (same 256-byte
  alignment, same order), so the owner broadcasts straight from it and its own receiver reads
  it in place: no host -> slot copy (the CPU analogue of skipping H2D).
- safetensors files are memory-mapped (`torch.from_file`), not read: files in `/dev/shm` cost
  no copy at all, files on disk are paged in by the first update. On CUDA machines they are
  copied into pinned memory once at registration so every update is a full-speed H2D copy.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping

import torch

from k2_ckpt.buffer import SlotBuffer
from k2_ckpt.dtypes import as_bytes, dtype_from_name, dtype_name, nbytes_of
from k2_ckpt.errors import BadCheckpoint, FileMissing
from k2_ckpt.planner import ALIGN
from k2_ckpt.types import BucketItem, TensorMeta

# safetensors dtype codes -> torch dtype names
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class HostCheckpoint:
    """Bytes of every tensor a rank owns, as flat uint8 host views, plus their metadata."""

    def __init__(self, name: str, rank: int, shared_arena: bool = False):
        self.name = name
        self.rank = rank
        self.uid = int.from_bytes(os.urandom(7), "little") + 1  # identifies this registration (> 0)
        self.shared_arena = shared_arena
        self.arenas: list[SlotBuffer] = []  # shared arenas (CPU), in registration order
        self.location: dict[str, tuple[int, int]] = {}  # name -> (arena index, byte offset)
        self.metas: list[TensorMeta] = []
        self.bytes_by_name: dict[str, torch.Tensor] = {}
        self._keepalive: list[torch.Tensor] = []  # arenas and mmaps the views point into

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def _add(
        self, name: str, dtype: torch.dtype, shape: list[int], offset: int, data: torch.Tensor, source: str
    ) -> None:
        if name in self.bytes_by_name:
            raise BadCheckpoint(f"tensor {name!r} registered twice in checkpoint {self.name!r} ({source})")
        self.metas.append(
            TensorMeta(
                name=name,
                dtype=dtype_name(dtype),
                shape=list(shape),
                owner=self.rank,
                offset=offset,
                nbytes=data.numel(),
            )
        )
        self.bytes_by_name[name] = data

    def add_named_tensors(
        self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        pairs = list(named.items() if isinstance(named, Mapping) else named)
        offsets, total = [], 0
        for name, t in pairs:
            if not isinstance(t, torch.Tensor):
                raise BadCheckpoint(f"named_tensors[{name!r}] is {type(t).__name__}, expected a torch.Tensor")
            dtype_name(t.dtype)
            offsets.append(total)
            total += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        if self.shared_arena:
            shm = SlotBuffer(max(total, ALIGN), 1, torch.device("cpu"))
            self.arenas.append(shm)
            arena = shm.data
        else:
            arena = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._keepalive.append(arena)
        for (name, t), off in zip(pairs, offsets):
            n = t.numel() * t.element_size()
            dst = arena[off : off + n]
            dst.copy_(as_bytes(t.detach().to("cpu").contiguous()))
            self._add(name, t.dtype, list(t.shape), off, dst, "named_tensors")
            if self.shared_arena:
                self.location[name] = (len(self.arenas) - 1, off)

    def in_place_source(self, items: list[BucketItem]) -> tuple[int, int] | None:
        """(arena index, base offset) when a bucket's bytes already sit in one shared arena in
        bucket layout (item k at base + item.buf_offset); None when they must be copied."""
        first = self.location.get(items[0].name)
        if first is None:
            return None
        arena, off0 = first
        base = off0 + items[0].chunk_start - items[0].buf_offset
        for it in items:
            loc = self.location.get(it.name)
            if loc is None or loc[0] != arena or loc[1] + it.chunk_start != base + it.buf_offset:
                return None
        return arena, base

    def close(self) -> None:
        """Drop every reference and remove shared arena files."""
        for a in self.arenas:
            a.close()
        self.arenas.clear()
        self._keepalive.clear()
        self.bytes_by_name.clear()

    def add_safetensors(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileMissing(f"checkpoint file not found: {path}")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise BadCheckpoint(f"{path}: too short to be a safetensors file")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8:
                raise BadCheckpoint(f"{path}: header length {hlen} exceeds the file size {size}")
            try:
                header = json.loads(f.read(hlen))
            except ValueError as e:
                raise BadCheckpoint(f"{path}: header is not JSON ({e})") from None
        data_start = 8 + hlen
        # private mmap: zero-copy, and never writes back to the file
        whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
        if torch.cuda.is_available():
            whole = whole.pin_memory()
        self._keepalive.append(whole)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dt = dtype_from_name(_ST_DTYPES[info["dtype"]])
                begin, end = info["data_offsets"]
                shape = [int(s) for s in info["shape"]]
            except (KeyError, TypeError, ValueError) as e:
                raise BadCheckpoint(
                    f"{path}: tensor {name!r} has a bad header entry {info!r} ({e})"
                ) from None
            lo, hi = data_start + begin, data_start + end
            if not 0 <= begin <= end:
                raise BadCheckpoint(
                    f"{path}: tensor {name!r} has data_offsets {[begin, end]} (need 0 <= begin <= end)"
                )
            if hi > size:
                raise BadCheckpoint(f"{path}: tensor {name!r} ends at byte {hi}, past the file end {size}")
            want = nbytes_of(dt, shape)
            if end - begin != want:
                raise BadCheckpoint(
                    f"{path}: tensor {name!r} spans {end - begin} bytes, but {info['dtype']} "
                    f"{shape} needs {want}"
                )
            self._add(name, dt, shape, lo, whole[lo:hi], path)
