"""Pydantic models for everything that crosses a process boundary (ZMQ, HTTP, gather)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator


class TensorMeta(BaseModel):
    """One registered tensor: where it lives (owner rank, byte offset in its source) and what it is."""

    name: str
    dtype: str
    shape: list[int]
    owner: int
    offset: int  # byte offset inside the owner's host arena or safetensors file
    nbytes: int


class BucketItem(BaseModel):
    """A tensor, or a byte range of a tensor bigger than a bucket, placed in a bucket."""

    name: str
    dtype: str
    shape: list[int]
    tensor_nbytes: int  # the whole tensor's size
    chunk_start: int  # byte offset of this chunk inside the tensor (0 unless split)
    nbytes: int  # bytes of this chunk
    buf_offset: int  # where the chunk starts inside the bucket (aligned)

    @property
    def is_whole(self) -> bool:
        return self.chunk_start == 0 and self.nbytes == self.tensor_nbytes


class Bucket(BaseModel):
    index: int
    owner: int  # the rank that broadcasts it
    nbytes: int  # used bytes (<= bucket size)
    items: list[BucketItem]


# ---- server <-> receiver messages over the ZMQ PAIR socket ----


class BufferMsg(BaseModel):
    op: Literal["buffer"] = "buffer"
    handle: dict  # see buffer.SlotBuffer.handle()
    slot_bytes: int
    num_slots: int
    checkpoint: str
    num_buckets: int
    sources: list[dict] = []  # handles of this rank's shared arenas (CPU in-place path)
    # CPU receive arena: the transfer buffer holds the whole update (bucket k at its own offset,
    # a split tensor contiguous), so the receiver stages views, not copies
    zero_copy: bool = False


class BucketMsg(BaseModel):
    """Bucket k has arrived. Its items travel as columns (entry i of each list is one tensor or
    chunk, as in `BucketItem`): an update carries up to ~10^5 tensors, and validating columns of
    plain values costs about a tenth of validating one object per tensor (measured)."""

    op: Literal["bucket"] = "bucket"
    bucket: int
    offset: int  # where the bucket starts in the transfer buffer (a slot, or its place in the arena)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensor_nbytes: list[int]
    chunk_starts: list[int]
    nbytes: list[int]
    buf_offsets: list[int]
    # set on the owner's own receiver when the bytes are read in place from a shared arena:
    # index into BufferMsg.sources and the bucket's base offset there (else: read the slot)
    source: int | None = None
    source_offset: int = 0

    @model_validator(mode="after")
    def _columns_align(self) -> BucketMsg:
        n = len(self.names)
        if any(
            len(c) != n
            for c in (
                self.dtypes,
                self.shapes,
                self.tensor_nbytes,
                self.chunk_starts,
                self.nbytes,
                self.buf_offsets,
            )
        ):
            raise ValueError(f"bucket {self.bucket}: item columns of different lengths")
        return self

    @classmethod
    def of(cls, bucket: int, offset: int, items: list[BucketItem], **kw) -> BucketMsg:
        return cls(
            bucket=bucket,
            offset=offset,
            names=[it.name for it in items],
            dtypes=[it.dtype for it in items],
            shapes=[it.shape for it in items],
            tensor_nbytes=[it.tensor_nbytes for it in items],
            chunk_starts=[it.chunk_start for it in items],
            nbytes=[it.nbytes for it in items],
            buf_offsets=[it.buf_offset for it in items],
            **kw,
        )

    def columns(self):
        """(name, dtype, shape, tensor_nbytes, chunk_start, nbytes, buf_offset) per item."""
        return zip(
            self.names,
            self.dtypes,
            self.shapes,
            self.tensor_nbytes,
            self.chunk_starts,
            self.nbytes,
            self.buf_offsets,
        )


class CommitMsg(BaseModel):
    op: Literal["commit"] = "commit"


class AbortMsg(BaseModel):
    op: Literal["abort"] = "abort"
    reason: str


ServerMsg = Annotated[BufferMsg | BucketMsg | CommitMsg | AbortMsg, Field(discriminator="op")]


class ReadyReply(BaseModel):
    op: Literal["ready"] = "ready"
    device_id: str
    staged: bool = True  # False: direct mode, each bucket is loaded on arrival


class AckReply(BaseModel):
    op: Literal["ack"] = "ack"
    bucket: int


class ErrorReply(BaseModel):
    op: Literal["error"] = "error"
    kind: str  # "mismatch" | "worker_error"
    message: str
    bucket: int | None = None
    tensor: str | None = None
    traceback: str
    applied: list[str] | None = []  # direct mode: tensors loaded so far; None = unknown (a failed commit)


class DoneReply(BaseModel):
    op: Literal["done"] = "done"
    applied: int
    seconds: float
    # the receiver's weights may now be views of this update's transfer buffer (zero-copy
    # staging): the server must not write into it again until a later update replaces them
    views_buffer: bool = False


class AbortedReply(BaseModel):
    op: Literal["aborted"] = "aborted"
    applied: list[str] | None = []  # None = unknown (the abort came after a failed commit)


WorkerMsg = Annotated[
    ReadyReply | AckReply | ErrorReply | DoneReply | AbortedReply, Field(discriminator="op")
]
