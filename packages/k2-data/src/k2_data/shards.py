"""Writing and reading k2-data's shard files: one implementation for every pipeline that writes
them (tokenize / SFT ingest, rephrasing).

* `write_table_atomic`: an Arrow table to Parquet (zstd) or Arrow IPC, its run metadata as JSON
  under a schema-metadata key, written to a temporary name in the same directory and renamed, so a
  crash or an interrupt never leaves a half-written shard; files read like any other (0644).
* `read_table_meta`: that metadata back, or None when the file is unreadable (a shard to redo).
* `atomic_json`: the same temporary-name-and-rename for JSON manifests and plans.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

ARROW_CHUNK_ROWS = 64 << 10  # record-batch size of Arrow IPC shards


def write_table_atomic(table: pa.Table, path: Path, fmt: str, meta_key: bytes, meta: dict) -> None:
    """Write `table` with `meta` under `meta_key` to `path` ("parquet" or "arrow"), atomically."""
    if fmt not in ("parquet", "arrow"):
        raise ValueError(f"shard format must be 'parquet' or 'arrow', got {fmt!r}")
    table = table.replace_schema_metadata({meta_key: json.dumps(meta).encode()})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if fmt == "arrow":
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=ARROW_CHUNK_ROWS)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, tmp, compression="zstd")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_table_meta(path: str | Path, meta_key: bytes) -> dict | None:
    """The JSON metadata a shard carries under `meta_key`, or None if the file is unreadable."""
    path = Path(path)
    try:
        if path.suffix == ".arrow":
            with pa.memory_map(str(path), "r") as source:
                schema = pa.ipc.open_file(source).schema
        else:
            import pyarrow.parquet as pq

            schema = pq.read_schema(str(path))
    except (pa.ArrowInvalid, OSError):
        return None
    raw = (schema.metadata or {}).get(meta_key)
    return json.loads(raw) if raw else None


def atomic_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON at `path` (parent directories created), via a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["atomic_json", "read_table_meta", "write_table_atomic"]
