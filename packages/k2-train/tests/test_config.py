"""Run configs: where the data cache lives."""

from __future__ import annotations

from pathlib import Path

from k2_train import PretrainConfig


def test_cache_dir_flag_then_env_then_home(tmp_path, monkeypatch):
    from k2_train.data import cache_root

    monkeypatch.delenv("K2_CACHE", raising=False)
    assert cache_root() == Path.home() / ".cache" / "k2"
    monkeypatch.setenv("K2_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(PretrainConfig()) == tmp_path / "env"
    assert cache_root(PretrainConfig.flat(cache_dir=str(tmp_path / "flag"))) == tmp_path / "flag"
