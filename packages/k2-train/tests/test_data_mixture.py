"""`--data a:W,b:W`: pretraining on several sources mixed by weight (raw and rephrased text)."""

from __future__ import annotations

import json

import pytest
from k2_data import MixedDataset
from k2_model.testing import SMALL_OVERRIDES
from k2_train import run_training
from k2_train.config import PretrainConfig
from k2_train.data import build_datasets, prepare_tokenized


@pytest.fixture
def two_corpora(tmp_path):
    out = []
    for name, word in (("raw", "alpha beta gamma"), ("rephrased", "delta epsilon zeta")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{word} {i}. " * 12}) + "\n" for i in range(40)))
        out.append(path)
    return out


def _cfg(tmp_path, data: str, **kw) -> PretrainConfig:
    base = dict(model_overrides=SMALL_OVERRIDES, steps=2, batch=2, seq_len=32, warmup_steps=1, data=data)
    base.update(val_fraction=0.2, eval_every=2, threads=1, out=str(tmp_path / "run"))
    base.update(kw)
    return PretrainConfig.flat(**base)


def test_mixture_builds_one_dataset_per_source_mixed_by_weight(tmp_path, two_corpora):
    raw, reph = two_corpora
    cfg = _cfg(tmp_path, f"{raw}:0.75,{reph}:0.25")
    tokenized = prepare_tokenized(cfg)
    assert isinstance(tokenized, list) and len(tokenized) == 2
    train, val = build_datasets(cfg, tokenized)
    assert isinstance(train, MixedDataset) and isinstance(val, MixedDataset)
    assert train.weights.tolist() == [0.75, 0.25]
    share = sum(train.locate(g)[0] == 0 for g in range(2000)) / 2000
    assert share == pytest.approx(0.75, abs=0.04)
    # a single path stays a plain dataset
    single, _ = build_datasets(_cfg(tmp_path, str(raw)), prepare_tokenized(_cfg(tmp_path, str(raw))))
    assert not isinstance(single, MixedDataset)


def test_a_mixed_run_trains_and_bad_specs_name_the_flag(tmp_path, two_corpora):
    raw, reph = two_corpora
    result = run_training(_cfg(tmp_path, f"{raw}:1,{reph}:1"), log=lambda _: None)
    assert result.steps_done == 2 and result.final_val_loss is not None
    with pytest.raises(ValueError, match="--data .*weight 'x'"):
        prepare_tokenized(_cfg(tmp_path, f"{raw}:x,{reph}:1"))
    with pytest.raises(FileNotFoundError, match="--data .*missing"):
        prepare_tokenized(_cfg(tmp_path, f"{tmp_path / 'missing'}:1,{reph}:1"))


def test_stdlib_names_the_default_corpus_in_a_mixture(tmp_path, two_corpora):
    raw, _ = two_corpora
    mixed = prepare_tokenized(_cfg(tmp_path, f"stdlib:0.5,{raw}:0.5", max_corpus_mb=0.05))
    alone = prepare_tokenized(_cfg(tmp_path, None, max_corpus_mb=0.05))
    assert isinstance(mixed, list) and mixed[0] == alone  # the same tokenized default corpus


def test_a_relative_and_an_absolute_path_share_the_tokenized_cache(tmp_path, two_corpora, monkeypatch):
    raw, _ = two_corpora
    monkeypatch.chdir(raw.parent)
    first = prepare_tokenized(_cfg(tmp_path, raw.name))
    again = prepare_tokenized(_cfg(tmp_path, str(raw)))  # refused before: "holds shards of a different run"
    assert first == again
