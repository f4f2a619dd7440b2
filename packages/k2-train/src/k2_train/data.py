"""Data for a run: tokenized once into a cache directory keyed by its inputs, then packed into
train/val samples.

Pretraining: text (default: this interpreter's standard library source), or several sources
mixed by weight (`--data raw:0.5,rephrased:0.5`: k2_data.MixedDataset). SFT: chat records
(default: the tool-use example set k2-data generates), rendered in the Kimi format with a loss
mask on the assistant turns."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from k2_data import (
    MixedDataset,
    PackedDataset,
    StatefulLoader,
    TokenizeConfig,
    default_corpus_files,
    ensure_tokenized,
    parse_mixture,
    tokenize_corpus,
)

from k2_train.config import PretrainConfig, SFTConfig


def cache_root(cfg: PretrainConfig | None = None) -> Path:
    """The data cache: the config's `cache_dir`, else $K2_CACHE, else ~/.cache/k2."""
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir)
    return Path(os.environ.get("K2_CACHE") or Path.home() / ".cache" / "k2")


def _limited_default_corpus(max_mb: float) -> list[Path]:
    """The first files of the default corpus (in its deterministic order) up to `max_mb`."""
    files, total = [], 0
    for f in default_corpus_files():
        files.append(f)
        total += f.stat().st_size
        if total >= max_mb * 2**20:
            break
    return files


def mixture_sources(cfg: PretrainConfig) -> list[tuple[str, float]] | None:
    """`--data a:0.7,b:0.3` -> [(a, 0.7), (b, 0.3)] (sources mixed by weight); None for one source.

    A path that exists is always one source, even with a ':' in its name."""
    if cfg.dataset.data is None or Path(cfg.dataset.data).exists():
        return None
    sources = parse_mixture(cfg.dataset.data, "--data")
    if len(sources) == 1 and sources[0][0] == cfg.dataset.data:
        return None  # a plain path (that does not exist: reported by the one-source path)
    return sources


def prepare_tokenized(cfg: PretrainConfig, workers: int = 0) -> Path | list[Path]:
    """A tokenized dataset directory for `cfg.dataset.data` (tokenizing into the cache when needed); for a
    mixture (`--data a:0.7,b:0.3`, pretraining only) one directory per source, in order."""
    if isinstance(cfg, SFTConfig):
        return prepare_chat(cfg, workers)
    sources = mixture_sources(cfg)
    if sources is not None:
        return [_prepare_one(cfg, path, workers) for path, _ in sources]
    return _prepare_one(cfg, cfg.dataset.data, workers)


# A mixture's name for the default corpus (`--data stdlib:0.5,copy.jsonl:0.5`).
STDLIB = "stdlib"


def _prepare_one(cfg: PretrainConfig, data: str | None, workers: int) -> Path:
    tok_config = TokenizeConfig(workers=workers or max(1, min(4, os.cpu_count() or 1)))
    if data == STDLIB and not Path(data).exists():  # the default corpus, named in a mixture
        data = None
    if data is not None and (Path(data) / "manifest.json").is_file():
        return Path(data)
    if data is not None and not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such file or directory")
    files = None
    if data is None and cfg.dataset.max_corpus_mb > 0:
        files = _limited_default_corpus(cfg.dataset.max_corpus_mb)
    key = repr(
        (
            str(Path(data).resolve()) if data else "<stdlib>",
            [str(f) for f in files] if files is not None else None,
            str(Path(cfg.dataset.tokenizer).resolve()) if cfg.dataset.tokenizer else "<default>",
        )
    )
    cache = cache_root(cfg) / "tokenized" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if files is not None:
        tokenize_corpus(files, cache, tokenizer=cfg.dataset.tokenizer, config=tok_config)
        return cache
    # the resolved path, as in the cache key: a relative and an absolute spelling of one corpus
    # share the cache (the shards' plan records the input paths)
    source = str(Path(data).resolve()) if data else data
    return ensure_tokenized(source, cache, tokenizer=cfg.dataset.tokenizer, config=tok_config)


def build_datasets(
    cfg: PretrainConfig, tokenized: Path | list[Path]
) -> tuple[PackedDataset | MixedDataset, PackedDataset | MixedDataset | None]:
    """Train and held-out splits (by document); the held-out one is None when the corpus has too
    few documents to hold any out at `val_fraction`. A list of directories (a `--data` mixture)
    gives each split mixed by the weights (the held-out one only when every source has one)."""
    if isinstance(tokenized, list):
        weights = [w for _, w in mixture_sources(cfg) or []]
        if len(weights) != len(tokenized):
            raise ValueError(
                f"--data {cfg.dataset.data}: {len(tokenized)} tokenized sources for {len(weights)} weights"
            )
        splits = [build_datasets(cfg, t) for t in tokenized]
        train = MixedDataset([tr for tr, _ in splits], weights, seed=cfg.seed)
        vals = [va for _, va in splits]
        val = MixedDataset(vals, weights, seed=cfg.seed) if all(v is not None for v in vals) else None
        return train, val
    common = dict(
        seq_len=cfg.dataset.seq_len,
        seed=cfg.seed,
        val_fraction=cfg.dataset.val_fraction,
        document_mask=cfg.dataset.document_mask,
        packing=cfg.dataset.packing,
    )
    train = PackedDataset(tokenized, split="train", **common)
    try:
        val = PackedDataset(tokenized, split="val", **common)
    except ValueError:
        val = None
    return train, val


def build_loader(train: PackedDataset, per_rank_batch: int, rank: int, world_size: int) -> StatefulLoader:
    return StatefulLoader(train, batch_size=per_rank_batch, rank=rank, world_size=world_size, num_workers=1)


def prepare_chat(cfg: SFTConfig, workers: int = 0) -> Path:
    """A tokenized chat dataset (with loss masks) for `cfg.dataset.data`; None = the tool-use example set,
    generated and tokenized into the cache once."""
    from k2_data.sft import ChatTokenizeConfig, tokenize_chat

    if cfg.dataset.data is not None and (Path(cfg.dataset.data) / "manifest.json").is_file():
        return Path(cfg.dataset.data)
    if cfg.dataset.data is not None and not Path(cfg.dataset.data).exists():
        raise FileNotFoundError(f"--data {cfg.dataset.data}: no such file or directory")
    source = (
        Path(cfg.dataset.data)
        if cfg.dataset.data is not None
        else tooluse_example_dir(cache_root(cfg)) / "train.jsonl"
    )
    key = repr(
        (
            str(source.resolve()),
            source.stat().st_mtime_ns if source.is_file() else 0,
            str(Path(cfg.dataset.tokenizer).resolve()) if cfg.dataset.tokenizer else "<default>",
        )
    )
    cache = cache_root(cfg) / "tokenized-chat" / hashlib.sha256(key.encode()).hexdigest()[:16]
    config = ChatTokenizeConfig(workers=workers or 1)
    if not (cache / "manifest.json").is_file():
        tokenize_chat([source], cache, tokenizer=cfg.dataset.tokenizer, config=config)
    return cache


def tooluse_example_dir(root: Path | None = None) -> Path:
    """The shipped tool-use SFT set (train.jsonl, heldout.jsonl), generated once into the cache
    (`root`, default `cache_root()`)."""
    from k2_data.examples.tooluse import write_tooluse_dataset

    out = (root or cache_root()) / "examples" / "tooluse-v1"
    if not (out / "train.jsonl").is_file() or not (out / "heldout.jsonl").is_file():
        write_tooluse_dataset(out)
    return out
