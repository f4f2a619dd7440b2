"""Tokenize text corpora into Arrow/Parquet shards plus a `manifest.json`.

Inputs: text files (one document each), JSONL (one record per line), Parquet and Arrow IPC files
(file or stream format, as HF `datasets` writes them) with a configurable text field.

The run is planned first: inputs are cut into shard tasks of about `shard_bytes` of text, each
with the first document id it owns, so shard contents and doc ids do not depend on the number of
worker processes. Each shard is written to a temporary name and renamed; its row/token counts and
skipped records ride in the file's schema metadata, so a rerun skips completed shards and still
reports everything. Bad records (invalid JSON, missing or non-string text, undecodable bytes) are
reported with file and line (or row) and either skipped (`on_error="skip"`) or fail the run.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from k2_data._version import __version__
from k2_data.corpus import default_corpus_files, expand_inputs, file_kind
from k2_data.shards import atomic_json, read_table_meta, write_table_atomic
from k2_data.tokenizer import Tokenizer, load_tokenizer

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
PLAN = ".k2-plan.json"
TOKENIZER_SUBDIR = "tokenizer"
SHARD_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),  # K2's vocabulary needs more than 16 bits
        pa.field("doc_id", pa.int64()),
        pa.field("source", pa.string()),
    ]
)
CHAT_SHARD_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.uint8())),  # 1 = trained (assistant turns), one per input id
        pa.field("doc_id", pa.int64()),
        pa.field("source", pa.string()),
    ]
)
_META_KEY = b"k2_data.shard"


class BadRecordError(ValueError):
    """A record that cannot be tokenized; names the file and the line (or row)."""

    def __init__(self, path: str, where: str, reason: str):
        super().__init__(f"{path}:{where}: {reason}")
        self.record = {"file": path, "where": where, "reason": reason}


@dataclass
class TokenizeConfig:
    text_field: str = "text"
    format: str = "arrow"  # "arrow" (IPC file, memory-mappable) or "parquet"
    shard_bytes: int = 16 << 20  # text bytes per shard, about
    workers: int = 1
    on_error: str = "fail"  # "fail" or "skip" (skipped records are listed in the manifest)
    batch_docs: int = 512  # documents per encode_batch call
    # "auto": the BPE's tiktoken engine where it has one (about 5x faster), with every
    # `check_every`-th document re-encoded by HF and compared; "hf": HF tokenizers only
    engine: str = "auto"
    check_every: int = 64

    def validate(self) -> None:
        if self.format not in ("arrow", "parquet"):
            raise ValueError(f"format must be 'arrow' or 'parquet', got {self.format!r}")
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.engine not in ("auto", "hf"):
            raise ValueError(f"engine must be 'auto' or 'hf', got {self.engine!r}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")


@dataclass
class Unit:
    """A slice of one input file: all of a text file, a byte range of JSONL, a row range of a table."""

    path: str
    kind: str
    start: int = 0  # byte offset (jsonl) or row (tables)
    stop: int = 0
    first_line: int = 1  # jsonl: line number of `start`
    n_docs: int = 1
    nbytes: int = 0


@dataclass
class ShardTask:
    index: int
    first_doc_id: int
    units: list[Unit] = field(default_factory=list)

    @property
    def n_docs(self) -> int:
        return sum(u.n_docs for u in self.units)


# ----------------------------------------------------------------------------- planning


def _jsonl_units(path: Path, shard_bytes: int) -> list[Unit]:
    units: list[Unit] = []
    start, line_no, first_line, n, pos = 0, 1, 1, 0, 0
    with open(path, "rb") as f:
        for raw in f:
            pos += len(raw)
            n += 1
            line_no += 1
            if pos - start >= shard_bytes:
                units.append(Unit(str(path), "jsonl", start, pos, first_line, n, pos - start))
                start, first_line, n = pos, line_no, 0
    if n:
        units.append(Unit(str(path), "jsonl", start, pos, first_line, n, pos - start))
    return units


def _open_arrow(path: Path) -> pa.Table:
    source = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path}: not an Arrow IPC file or stream ({e})") from e


def _table_units(path: Path, kind: str, shard_bytes: int) -> list[Unit]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(str(path)).metadata.num_rows
        except Exception as e:
            raise ValueError(f"{path}: not a Parquet file ({e})") from e
    else:
        rows = _open_arrow(path).num_rows
    size = path.stat().st_size
    rows_per_unit = max(1, int(rows * shard_bytes / max(size, 1)))
    return [
        Unit(
            str(path),
            kind,
            r,
            min(r + rows_per_unit, rows),
            0,
            min(r + rows_per_unit, rows) - r,
            size * (min(r + rows_per_unit, rows) - r) // max(rows, 1),
        )
        for r in range(0, rows, rows_per_unit)
    ]


def plan_shards(files: list[Path], shard_bytes: int) -> list[ShardTask]:
    """Cut the inputs into shard tasks of about `shard_bytes`; deterministic for given inputs."""
    units: list[Unit] = []
    for path in files:
        kind = file_kind(path)
        if kind == "text":
            units.append(Unit(str(path), "text", 0, 0, 1, 1, path.stat().st_size))
        elif kind == "jsonl":
            units.extend(_jsonl_units(path, shard_bytes))
        else:
            units.extend(_table_units(path, kind, shard_bytes))
    tasks: list[ShardTask] = []
    doc_id = 0
    current = ShardTask(0, 0)
    size = 0
    for unit in units:
        current.units.append(unit)
        size += unit.nbytes
        if size >= shard_bytes:
            tasks.append(current)
            doc_id += current.n_docs
            current, size = ShardTask(len(tasks), doc_id), 0
    if current.units:
        tasks.append(current)
    return tasks


# ----------------------------------------------------------------------------- reading records


def _read_table(path: str, kind: str, fields: list[str], required: dict[str, str]) -> pa.Table:
    """The named columns of a Parquet/Arrow file; a missing required column is an error naming the file
    (and the option, `required[column]`, that selects it)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        present = [f for f in fields if f in names]
        table = pq.read_table(path, columns=present) if present else pa.table({})
    else:
        table = _open_arrow(Path(path))
        names = table.column_names
    for name, option in required.items():
        if name not in names:
            raise ValueError(f"{path}: no column {name!r} (columns: {', '.join(names)}); set {option}")
    return table


def read_records(
    unit: Unit,
    fields: list[str],
    required: dict[str, str] | None = None,
    check_column: Callable[[str, str, pa.DataType], None] | None = None,
) -> Iterator[tuple[str, str, object]]:
    """`(source, where, record)` for each record of a JSONL or table unit.

    JSONL: `record` is the line's parsed JSON value (any type; blank lines are skipped) or a
    `BadRecordError` for invalid JSON; `where` is the line number. Tables: `record` is a dict of the named
    `fields` present in the file (`required` ones must be: else ValueError naming the file and the option
    `required[field]` that selects the column), `where` is
    `row N`. `check_column(path, name, type)` may refuse a column's type for the whole file.
    `source` is `path:line` or `path#row`, the label a shard row carries.
    """
    path = unit.path
    if unit.kind == "jsonl":
        with open(path, "rb") as f:
            f.seek(unit.start)
            chunk = f.read(unit.stop - unit.start)
        lines = chunk.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the newline that ends the last record
        for i, raw in enumerate(lines):
            line = unit.first_line + i
            if not raw.strip():
                continue  # a blank line is not a record
            try:
                yield f"{path}:{line}", f"{line}", json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"{path}:{line}", f"{line}", BadRecordError(path, f"{line}", f"invalid JSON ({e})")
        return
    if unit.kind not in ("parquet", "arrow"):
        raise ValueError(f"{path}: a {unit.kind} file holds no records (expected JSONL, Parquet or Arrow)")
    table = _read_table(path, unit.kind, fields, required or {})
    present = [f for f in fields if f in table.column_names]
    columns = {}
    for name in present:
        column = table.column(name)
        if check_column is not None:
            check_column(path, name, column.type)
        columns[name] = column.slice(unit.start, unit.stop - unit.start).to_pylist()
    for i in range(unit.stop - unit.start):
        row = unit.start + i
        yield f"{path}#{row}", f"row {row}", {name: columns[name][i] for name in present}


def _check_string_column(path: str, name: str, type_: pa.DataType) -> None:
    if not (pa.types.is_string(type_) or pa.types.is_large_string(type_)):
        raise ValueError(f"{path}: column {name!r} has type {type_}, expected string")


def _read_unit(unit: Unit, text_field: str) -> Iterator[tuple[str, str | BadRecordError]]:
    """`(source, text or BadRecordError)` for each document of a unit."""
    path = unit.path
    if unit.kind == "text":
        data = Path(path).read_bytes()
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            yield path, BadRecordError(path, f"{line}", f"not valid UTF-8 (byte {e.start})")
        return
    for source, where, rec in read_records(
        unit, [text_field], {text_field: "--text-field"}, _check_string_column
    ):
        if isinstance(rec, BadRecordError):
            yield source, rec
        elif not isinstance(rec, dict) or text_field not in rec:
            yield source, BadRecordError(path, where, f"no field {text_field!r} in the record")
        elif unit.kind != "jsonl" and rec[text_field] is None:
            yield source, BadRecordError(path, where, f"field {text_field!r} is null")
        elif not isinstance(rec[text_field], str):
            kind = type(rec[text_field]).__name__
            yield source, BadRecordError(path, where, f"field {text_field!r} is {kind}, expected a string")
        else:
            yield source, rec[text_field]


# ----------------------------------------------------------------------------- writing shards


def _shard_name(index: int, fmt: str) -> str:
    return f"shard-{index:05d}.{'arrow' if fmt == 'arrow' else 'parquet'}"


def _np_array(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    # from_buffers, not pa.array: pa.array imports pandas when it is installed (seconds per worker)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


def _build_table(
    ids: list[list[int]], doc_ids: list[int], sources: list[str], loss_mask: list[list[int]] | None = None
) -> pa.Table:
    """A shard: input_ids list<int32>, doc_id, source, and (chat data) loss_mask list<uint8> aligned to input_ids."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    total = int(lengths.sum())
    if total >= 2**31:
        raise ValueError(
            f"a shard holds {total} tokens, more than list<int32> offsets allow; lower shard_bytes"
        )
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
    input_ids = pa.ListArray.from_arrays(_np_array(offsets, pa.int32()), _np_array(values, pa.int32()))
    encoded = [s.encode("utf-8") for s in sources]
    str_offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in encoded], out=str_offsets[1:])
    source = pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(str_offsets), pa.py_buffer(b"".join(encoded))]
    )
    doc_id = _np_array(np.asarray(doc_ids, dtype=np.int64), pa.int64())
    if loss_mask is None:
        return pa.Table.from_arrays([input_ids, doc_id, source], schema=SHARD_SCHEMA)
    mask_values = np.fromiter(itertools.chain.from_iterable(loss_mask), dtype=np.uint8, count=total)
    mask = pa.ListArray.from_arrays(_np_array(offsets, pa.int32()), _np_array(mask_values, pa.uint8()))
    return pa.Table.from_arrays([input_ids, mask, doc_id, source], schema=CHAT_SHARD_SCHEMA)


def _write_shard(table: pa.Table, path: Path, fmt: str, meta: dict) -> None:
    meta["sha256"] = table_digest(table)  # the shard's content identity (manifest: content_sha256)
    write_table_atomic(table, path, fmt, _META_KEY, meta)


def table_digest(table: pa.Table) -> str:
    """sha256 of a shard's training content: token ids (and loss masks) with their row boundaries and
    document ids. Source paths are left out, so a corpus moved or cloned elsewhere, with new paths
    and file times, tokenizes to the same identity and a run's loader state still applies."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask", "doc_id"):
        if name not in table.column_names:
            continue
        col = table.column(name).combine_chunks()
        if isinstance(col, pa.ListArray):
            h.update(np.asarray(col.offsets).astype(np.int64).tobytes())
            col = col.flatten()
        h.update(name.encode())
        h.update(np.asarray(col.to_numpy(zero_copy_only=False)).tobytes())
    return h.hexdigest()


def read_shard_meta(path: str | Path) -> dict | None:
    """The row/token counts a completed shard carries, or None if it is unreadable (then redone)."""
    return read_table_meta(path, _META_KEY)


_WORKER_TOKENIZER: dict[str, Tokenizer] = {}


def _worker_init() -> None:
    # One process per core already; nested rayon threads would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def _get_tokenizer(path: str) -> Tokenizer:
    if path not in _WORKER_TOKENIZER:
        _WORKER_TOKENIZER[path] = load_tokenizer(path)
    return _WORKER_TOKENIZER[path]


class EngineMismatchError(RuntimeError):
    """The fast engine disagreed with the tokenizer's own encoding on a spot-checked document."""


def _encoder(tok: Tokenizer, config: TokenizeConfig) -> Callable[[list[str], list[str]], list[list[int]]]:
    fast = config.engine == "auto" and getattr(tok, "has_fast_engine", False)
    if not fast:
        return lambda texts, sources: tok.encode_batch(texts)
    counter = itertools.count()

    def encode(texts: list[str], sources: list[str]) -> list[list[int]]:
        ids = tok.encode_batch_fast(texts)
        for text, source, got in zip(texts, sources, ids):
            if next(counter) % config.check_every == 0 and tok.encode(text) != got:
                raise EngineMismatchError(
                    f"{source}: the tiktoken engine and HF tokenizers disagree on this document; "
                    "rerun with --engine hf"
                )
        return ids

    return encode


def tokenize_shard(task: ShardTask, tokenizer_path: str, out_dir: str, config: TokenizeConfig) -> dict:
    """Tokenize one planned shard and write it; returns its manifest entry."""
    tok = _get_tokenizer(tokenizer_path)
    encode = _encoder(tok, config)
    ids: list[list[int]] = []
    doc_ids: list[int] = []
    sources: list[str] = []
    skipped: list[dict] = []
    pending_text: list[str] = []
    doc_id = task.first_doc_id
    for unit in task.units:
        for source, text in _read_unit(unit, config.text_field):
            if isinstance(text, BadRecordError):
                if config.on_error == "fail":
                    raise text
                skipped.append(text.record)
            else:
                pending_text.append(text)
                doc_ids.append(doc_id)
                sources.append(source)
                if len(pending_text) >= config.batch_docs:
                    ids.extend(encode(pending_text, sources[-len(pending_text) :]))
                    pending_text.clear()
            doc_id += 1
    if pending_text:
        ids.extend(encode(pending_text, sources[-len(pending_text) :]))
    table = _build_table(ids, doc_ids, sources)
    tokens = int(sum(len(x) for x in ids))
    name = _shard_name(task.index, config.format)
    meta = {
        "index": task.index,
        "file": name,
        "rows": table.num_rows,
        "tokens": tokens,
        "first_doc_id": task.first_doc_id,
        "skipped": skipped,
    }
    _write_shard(table, Path(out_dir) / name, config.format, meta)
    return meta


# ----------------------------------------------------------------------------- the run


def _plan_fingerprint(tasks: list[ShardTask], tokenizer: Tokenizer, settings: list) -> str:
    h = hashlib.sha256()
    h.update(tokenizer.fingerprint().encode())
    h.update(json.dumps(settings).encode())
    for task in tasks:
        for u in task.units:
            st = os.stat(u.path)
            h.update(json.dumps([task.index, u.path, u.start, u.stop, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()


@dataclass
class _Run:
    """A planned run: output dir, tokenizer (and the path workers load it from), shard tasks, plan hash."""

    out: Path
    tok: Tokenizer
    tok_path: str
    tasks: list[ShardTask]
    plan_sha: str


def _prepare_run(
    files: list[Path], out_dir: str | Path, tokenizer: str | Path | None, shard_bytes: int, settings: list
) -> _Run:
    """Plan the shards, refuse a directory holding another plan, save the tokenizer next to the shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer)
    files = [f for f in files if not _is_inside(f, out)]
    tasks = plan_shards(files, shard_bytes)
    plan_sha = _plan_fingerprint(tasks, tok, settings)
    plan_path = out / PLAN
    if plan_path.exists():
        previous = json.loads(plan_path.read_text())
        if previous.get("plan_sha256") != plan_sha:
            raise ValueError(
                f"{out} holds shards of a different run (other inputs, tokenizer or settings); "
                "use a new --out directory or delete it"
            )
    else:
        atomic_json(plan_path, {"plan_sha256": plan_sha, "shards": len(tasks)})
    tok.save(out / TOKENIZER_SUBDIR)
    tok_path = str(tokenizer) if tokenizer is not None else str(_default_path())
    _WORKER_TOKENIZER[tok_path] = tok  # forked workers inherit it instead of parsing it again
    return _Run(out, tok, tok_path, tasks, plan_sha)


def _run_shards(
    run: _Run,
    fmt: str,
    workers: int,
    work: Callable[[ShardTask], dict],
    progress: Callable[[int, int, dict], None] | None,
) -> tuple[list[dict], float]:
    """Run `work(task)` (picklable: it goes to worker processes) for every shard not completed by an
    earlier run; returns the shard metas in plan order and the seconds taken."""
    t0 = time.perf_counter()
    results: dict[int, dict] = {}
    todo: list[ShardTask] = []
    for task in run.tasks:
        meta = read_shard_meta(run.out / _shard_name(task.index, fmt))
        if meta is not None and meta.get("rows") is not None:
            results[task.index] = meta | {"resumed": True}
        else:
            todo.append(task)
    done = len(results)
    total = len(run.tasks)
    if workers == 1 or len(todo) <= 1:
        for task in todo:
            meta = work(task)
            results[task.index] = meta
            done += 1
            if progress:
                progress(done, total, meta)
    else:
        ctx = multiprocessing.get_context(
            os.environ.get("K2_DATA_MP_START", "fork" if os.name == "posix" else "spawn")
        )
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futures = [pool.submit(work, task) for task in todo]
            try:
                for fut in futures:
                    meta = fut.result()
                    results[meta["index"]] = meta
                    done += 1
                    if progress:
                        progress(done, total, meta)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return [results[t.index] for t in run.tasks], time.perf_counter() - t0


def _manifest(
    run: _Run, fmt: str, schema: pa.Schema, inputs: list[str], shards: list[dict], seconds: float, **extra
) -> dict:
    """The manifest fields every kind of dataset shares, plus `extra`; written atomically."""
    skipped = [rec for s in shards for rec in s.get("skipped", [])]
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "created_by": f"k2-data {__version__}",
        "format": fmt,
        "schema": {f.name: str(f.type) for f in schema},
        "tokenizer": run.tok.identity() | {"path": TOKENIZER_SUBDIR},
        **extra,
        "inputs": inputs,
        "plan_sha256": run.plan_sha,
        # the data's identity independent of paths and file times (None when a shard predates it)
        "content_sha256": _content_digest(shards),
        "num_docs": sum(s["rows"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_skipped": len(skipped),
        "skipped": skipped,
        "shards": [{k: s[k] for k in ("file", "rows", "tokens", "first_doc_id")} for s in shards],
        "seconds": round(seconds, 3),
        "resumed_shards": sum(1 for s in shards if s.get("resumed")),
    }
    atomic_json(run.out / MANIFEST, manifest)
    return manifest


def _content_digest(shards: list[dict]) -> str | None:
    if not shards or any(not s.get("sha256") for s in shards):
        return None
    return hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()


def tokenize_corpus(
    inputs: list[str | Path] | None,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    config: TokenizeConfig | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Tokenize `inputs` (files/directories; None = the default corpus) into `out_dir`.

    Returns the manifest. Completed shards of an earlier run with the same plan are kept.
    `progress(done, total, shard_meta)` is called after each shard.
    """
    config = config or TokenizeConfig()
    config.validate()
    files = default_corpus_files() if inputs is None else expand_inputs(inputs)
    run = _prepare_run(
        files, out_dir, tokenizer, config.shard_bytes, [config.text_field, config.format, config.shard_bytes]
    )
    work = functools.partial(tokenize_shard, tokenizer_path=run.tok_path, out_dir=str(run.out), config=config)
    shards, elapsed = _run_shards(run, config.format, config.workers, work, progress)
    fast = config.engine == "auto" and getattr(run.tok, "has_fast_engine", False)
    return _manifest(
        run,
        config.format,
        SHARD_SCHEMA,
        [str(p) for p in inputs] if inputs is not None else ["<default corpus: python stdlib>"],
        shards,
        elapsed,
        kind="text",
        text_field=config.text_field,
        encoder=f"tiktoken engine, every {config.check_every}th document checked against HF tokenizers"
        if fast
        else run.tok.kind,
    )


def _default_path() -> Path:
    from k2_data.tokenizer import default_tokenizer_path

    return default_tokenizer_path()


def _is_inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
        return True
    except ValueError:
        return False


def load_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a tokenized dataset (run `k2 data tokenize` first)")
    manifest = json.loads(path.read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    return manifest


def ensure_tokenized(
    source: str | Path | None,
    cache_dir: str | Path,
    tokenizer: str | Path | None = None,
    config: TokenizeConfig | None = None,
) -> Path:
    """A tokenized dataset directory for `source`, for training entry points.

    `source` may be a tokenized directory (has manifest.json; returned as is), a corpus file or
    directory, or None for the default corpus; the latter two are tokenized into `cache_dir`
    (resumable, so a second call with the same inputs only re-reads the manifest).
    """
    if source is not None and (Path(source) / MANIFEST).is_file():
        return Path(source)
    tokenize_corpus(None if source is None else [source], cache_dir, tokenizer=tokenizer, config=config)
    return Path(cache_dir)


__all__ = [
    "TokenizeConfig",
    "BadRecordError",
    "tokenize_corpus",
    "ensure_tokenized",
    "load_manifest",
    "plan_shards",
    "read_records",
]
