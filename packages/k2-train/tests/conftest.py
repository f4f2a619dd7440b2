"""Shared fixtures: a small K2-shaped config and a tokenized corpus of real Python source."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
}


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
