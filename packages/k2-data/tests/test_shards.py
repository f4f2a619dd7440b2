"""k2_data.shards: the one shard writer (atomic, zstd Parquet or Arrow IPC) and its metadata."""

from __future__ import annotations

import json
import stat

import pyarrow as pa
import pytest
from k2_data.shards import atomic_json, read_table_meta, write_table_atomic


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_round_trip_with_metadata_and_permissions(tmp_path, fmt):
    table = pa.table({"text": ["a", "bé"], "n": [1, 2]})
    path = tmp_path / f"shard-00000.{fmt}"
    write_table_atomic(table, path, fmt, b"k2_data.test", {"rows": 2})
    assert read_table_meta(path, b"k2_data.test") == {"rows": 2}
    assert read_table_meta(path, b"other") is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    if fmt == "parquet":
        import pyarrow.parquet as pq

        assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
        assert pq.read_table(path).to_pylist() == table.to_pylist()


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="format"):
        write_table_atomic(pa.table({"x": [1]}), tmp_path / "s.csv", "csv", b"k", {})

    class Boom:
        def __repr__(self):
            raise RuntimeError

    with pytest.raises(TypeError):  # not JSON-serialisable metadata: nothing written
        write_table_atomic(pa.table({"x": [1]}), tmp_path / "s.arrow", "arrow", b"k", {"x": Boom()})
    assert list(tmp_path.iterdir()) == []
    assert read_table_meta(tmp_path / "missing.arrow", b"k") is None
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    assert read_table_meta(tmp_path / "broken.parquet", b"k") is None


def test_atomic_json(tmp_path):
    path = tmp_path / "a" / "manifest.json"
    atomic_json(path, {"name": "Zürich", "n": 1})
    assert json.loads(path.read_text()) == {"name": "Zürich", "n": 1}
    assert "Zürich" in path.read_text()
    with pytest.raises(TypeError):
        atomic_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"name": "Zürich", "n": 1}  # the old file survives
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]
