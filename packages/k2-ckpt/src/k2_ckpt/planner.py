"""Bucket planning: pack every rank's tensors into fixed-size buckets, one owner per bucket.

Buckets are ordered by owner rank, then by registration order. A tensor larger than the
bucket is split into byte ranges (it starts a fresh bucket, and its last chunk shares a bucket
with what follows); the receiver reassembles the bytes before loading. Offsets inside a bucket
are aligned so every whole tensor can be viewed in place with its dtype.
"""

from __future__ import annotations

from k2_ckpt.types import Bucket, BucketItem, TensorMeta

ALIGN = 256  # bytes; >= any element size and friendly to vectorised copies


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Plan buckets of at most `bucket_bytes` bytes over all ranks' tensors."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be at least {ALIGN}")
    bucket_bytes = bucket_bytes // ALIGN * ALIGN
    buckets: list[Bucket] = []
    items: list[BucketItem] = []
    used = 0
    owner = None

    def close() -> None:
        nonlocal items, used
        if items:
            buckets.append(Bucket(index=len(buckets), owner=owner, nbytes=used, items=items))
        items, used = [], 0

    for m in sorted(metas, key=lambda m: m.owner):  # stable: keeps registration order per rank
        if m.owner != owner:
            close()
            owner = m.owner
        start = 0
        if m.nbytes > bucket_bytes and used:
            close()  # a split tensor starts a fresh bucket
        while True:
            off = _align(used)
            room = bucket_bytes - off
            chunk = min(room, m.nbytes - start)
            if chunk < m.nbytes - start and start == 0 and m.nbytes <= bucket_bytes:
                close()  # whole tensor fits in a fresh bucket: do not split it
                continue
            if room <= 0:
                close()
                continue
            items.append(
                BucketItem(
                    name=m.name,
                    dtype=m.dtype,
                    shape=m.shape,
                    tensor_nbytes=m.nbytes,
                    chunk_start=start,
                    nbytes=chunk,
                    buf_offset=off,
                )
            )
            used = off + chunk
            start += chunk
            if start >= m.nbytes:
                break
            close()
    close()
    return buckets
