"""Data for pretraining: the corpus (default: this interpreter's standard library source) is
tokenized once into a cache directory keyed by its inputs, then packed into train/val samples."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from k2_data import (
    PackedDataset,
    StatefulLoader,
    TokenizeConfig,
    default_corpus_files,
    ensure_tokenized,
    tokenize_corpus,
)

from k2_stack.pretrain.config import PretrainConfig


def cache_root() -> Path:
    return Path(os.environ.get("K2_CACHE", Path.home() / ".cache" / "k2"))


def _limited_default_corpus(max_mb: float) -> list[Path]:
    """The first files of the default corpus (in its deterministic order) up to `max_mb`."""
    files, total = [], 0
    for f in default_corpus_files():
        files.append(f)
        total += f.stat().st_size
        if total >= max_mb * 2**20:
            break
    return files


def prepare_tokenized(cfg: PretrainConfig, workers: int = 0) -> Path:
    """A tokenized dataset directory for `cfg.data` (tokenizing into the cache when needed)."""
    tok_config = TokenizeConfig(workers=workers or max(1, min(4, os.cpu_count() or 1)))
    if cfg.data is not None and (Path(cfg.data) / "manifest.json").is_file():
        return Path(cfg.data)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise FileNotFoundError(f"--data {cfg.data}: no such file or directory")
    files = None
    if cfg.data is None and cfg.max_corpus_mb > 0:
        files = _limited_default_corpus(cfg.max_corpus_mb)
    key = repr(
        (
            str(Path(cfg.data).resolve()) if cfg.data else "<stdlib>",
            [str(f) for f in files] if files is not None else None,
            str(Path(cfg.tokenizer).resolve()) if cfg.tokenizer else "<default>",
        )
    )
    cache = cache_root() / "tokenized" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if files is not None:
        tokenize_corpus(files, cache, tokenizer=cfg.tokenizer, config=tok_config)
        return cache
    return ensure_tokenized(cfg.data, cache, tokenizer=cfg.tokenizer, config=tok_config)


def build_datasets(cfg: PretrainConfig, tokenized: Path) -> tuple[PackedDataset, PackedDataset | None]:
    """Train and held-out splits (by document); the held-out one is None when the corpus has too
    few documents to hold any out at `val_fraction`."""
    common = dict(seq_len=cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction, document_mask=cfg.document_mask)
    train = PackedDataset(tokenized, split="train", **common)
    try:
        val = PackedDataset(tokenized, split="val", **common)
    except ValueError:
        val = None
    return train, val


def build_loader(train: PackedDataset, per_rank_batch: int, rank: int, world_size: int) -> StatefulLoader:
    return StatefulLoader(train, batch_size=per_rank_batch, rank=rank, world_size=world_size, num_workers=1)
