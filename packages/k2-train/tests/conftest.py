"""Shared fixtures: a small K2-shaped config and a tokenized corpus of real Python source."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from k2_model.testing import SMALL_OVERRIDES

SMALL = SMALL_OVERRIDES  # K2's structure at test size (k2_model.testing)


@pytest.fixture
def small() -> dict:
    return dict(SMALL)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K2_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory) -> Path:
    """60 documents of 30 lines of stdlib source, tokenized with the bundled BPE."""
    from k2_data import TokenizeConfig, tokenize_corpus

    src = tmp_path_factory.mktemp("corpus")
    lines = Path(textwrap.__file__).read_text().splitlines()
    for i in range(60):
        start = (i * 30) % len(lines)
        (src / f"doc{i:03d}.py").write_text("\n".join(lines[start : start + 30]) + "\n")
    out = tmp_path_factory.mktemp("tok")
    tokenize_corpus([src], out, config=TokenizeConfig(workers=1))
    return out
