"""Append-only JSONL outputs that survive a kill: each record is one flushed, fsynced line; on reopen a
torn last line is cut off, so a rerun continues from the last whole record without duplicates."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict[str, Any]]:
    """The whole records of `path`, cutting a torn tail off the file itself."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records, good = [], 0
    for line in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
        end = good + len(line) + 1
        if end > len(data):  # no newline: torn
            break
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good = end
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return records


def rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        self.records = read_records(path)
        self._f = open(path, "a", encoding="utf-8")

    def ids(self) -> set[str]:
        return {r["id"] for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.records.append(record)

    def close(self) -> None:
        self._f.close()
