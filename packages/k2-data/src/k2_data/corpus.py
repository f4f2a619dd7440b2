"""Input corpora: the default corpus (this interpreter's standard library source) and file discovery.

The default corpus exists on every machine with Python, needs no download and is about 11-13 MB of
code and docstrings. Its file order is sorted by relative path, so it is the same on every run.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

# Directory names skipped in the default corpus: test suites (large, repetitive, and partly
# intentionally broken source) and third-party packages.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

TEXT_SUFFIXES = frozenset(
    {".txt", ".py", ".md", ".rst", ".c", ".h", ".cpp", ".json", ".toml", ".yaml", ".yml"}
)
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})
ARROW_SUFFIXES = frozenset({".arrow", ".feather", ".ipc"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(root: str | Path | None = None) -> list[Path]:
    """The `*.py` files of the standard library, skipping tests and site-packages, sorted."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"standard library directory {base} does not exist")
    files = [
        p
        for p in base.rglob("*.py")
        if p.is_file() and not (_SKIPPED_DIRS & set(p.relative_to(base).parts[:-1]))
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def file_kind(path: Path) -> str:
    """'text', 'jsonl', 'parquet' or 'arrow', from the suffix (unknown suffixes read as text)."""
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in ARROW_SUFFIXES:
        return "arrow"
    return "text"


def expand_inputs(inputs: Iterable[str | Path]) -> list[Path]:
    """Files named directly plus every file under named directories (sorted, hidden files skipped)."""
    out: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                (
                    p
                    for p in path.rglob("*")
                    if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
                ),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not found:
                raise FileNotFoundError(f"input directory {path} contains no files")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"input {path} is neither a file nor a directory")
    return out


def iter_texts(files: Iterable[Path]) -> Iterator[str]:
    """Plain text of each file (UTF-8, undecodable bytes replaced); used for tokenizer training."""
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")
