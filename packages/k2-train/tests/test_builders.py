"""The optimizer the run builds: the Newton-Schulz dtype follows the machine unless set."""

from __future__ import annotations

import pytest
import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.testing import SMALL_OVERRIDES
from k2_optim.muon import default_ns_dtype
from k2_train.builders import build_optimizer
from k2_train.config import PretrainConfig


@pytest.mark.parametrize(
    ("flag", "want"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", None)]
)
def test_ns_dtype_reaches_every_muon_group(flag, want):
    model = K2ForCausalLM(K2Config.preset("tiny", **SMALL_OVERRIDES))
    opt = build_optimizer(PretrainConfig(ns_dtype=flag), model)
    muon = [g for g in opt.param_groups if g.get("algorithm") != "adamw"]
    assert muon
    for g in muon:
        got = default_ns_dtype(torch.device("cpu"), g["ns_dtype"])
        # auto: bf16 only where this CPU has native bf16 GEMMs (AMX / AVX512-BF16), else fp32
        assert got == (want or default_ns_dtype(torch.device("cpu"), "auto"))


def test_bad_ns_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="ns_dtype='fp16'"):
        PretrainConfig(ns_dtype="fp16").validate()
