"""The optimizer the run builds: the Newton-Schulz dtype follows the machine unless set."""

from __future__ import annotations

import pytest
import torch
from k2_model.testing import tiny_model
from k2_optim.config import OptimConfig
from k2_optim.muon import default_ns_dtype
from k2_train.builders import build_optimizer
from k2_train.config import PretrainConfig


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    ("flag", "want"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", None)]
)
def test_ns_dtype_reaches_every_muon_group(monkeypatch, flag, want, native):
    """The flag reaches every Muon group, and "auto" resolves by the CPU probe: bf16 with native
    bf16 GEMMs, fp32 without (the probe forced both ways, so neither kind of CPU hides a dropped flag)."""
    monkeypatch.setenv("K2_NATIVE_BF16", "1" if native else "0")
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(ns_dtype=flag))
    muon = [g for g in opt.param_groups if g.get("algorithm") != "adamw"]
    assert muon
    expected = want or (torch.bfloat16 if native else torch.float32)
    for g in muon:
        assert g["ns_dtype"] == {"fp32": "float32", "bf16": "bfloat16", "auto": "auto"}[flag]
        assert default_ns_dtype(torch.device("cpu"), g["ns_dtype"]) == expected


def test_bad_ns_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="ns_dtype='fp16'"):
        PretrainConfig.flat(ns_dtype="fp16").validate()


def test_start_up_line_names_the_ns_dtype_and_why(monkeypatch):
    from k2_train.builders import describe_ns_dtype

    cpu = torch.device("cpu")
    monkeypatch.setenv("K2_NATIVE_BF16", "1")
    assert describe_ns_dtype(OptimConfig(), cpu) == "bfloat16 (auto: native bf16 GEMMs)"
    monkeypatch.setenv("K2_NATIVE_BF16", "0")
    assert describe_ns_dtype(OptimConfig(), cpu) == "float32 (auto: bf16 emulated on this CPU)"
    assert describe_ns_dtype(OptimConfig(ns_dtype="bf16"), cpu) == "bfloat16 (--ns-dtype bf16)"
    assert describe_ns_dtype(OptimConfig(optimizer="adamw"), cpu) == "none (AdamW)"
