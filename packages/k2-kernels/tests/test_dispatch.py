"""The dispatch boundary: consumers ask `k2_kernels.ops.preferred(op, device)` and
`capabilities()`; only k2-kernels itself looks at the compiled module and the BLAS."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from k2_kernels import _lib, ops

PACKAGES = Path(__file__).resolve().parents[2]


def test_capabilities_report_the_build():
    caps = ops.capabilities()
    info = _lib.info()
    assert caps.compiled == info["compiled"] and caps.cpu_kernels == info["cpu_kernels"]
    assert caps.cuda_kernels == info["cuda_kernels"] and caps.blas == info["blas"]
    assert caps.fast_cpu_blas == caps.blas.startswith("openblas")
    assert set(caps.as_dict()) >= {"compiled", "cpu_kernels", "cuda_kernels", "blas", "load_error"}


def test_cpu_choices_follow_the_blas(monkeypatch):
    """On the built-in GEMM the automatic choice is torch's path for the GEMM-heavy ops; the
    RMSNorm kernel (no GEMM) is chosen whenever it is compiled."""
    if not _lib.has_cpu():
        pytest.skip("k2_kernels._C did not load")
    monkeypatch.setattr(_lib, "BLAS", "builtin")
    assert not ops.preferred("mla_attention", "cpu", head_dims=(192, 128))
    assert not ops.preferred("moe_swiglu_experts", "cpu")
    assert not ops.preferred("newton_schulz", "cpu")
    assert ops.preferred("rms_norm", "cpu") == hasattr(_lib.compiled(), "rms_norm_fwd_cpu")
    monkeypatch.setattr(_lib, "BLAS", "openblas 0.3.x (scipy-openblas32)")
    assert ops.preferred("mla_attention", "cpu", head_dims=(192, 128))
    assert ops.preferred("moe_swiglu_experts", "cpu") and ops.preferred("newton_schulz", "cpu")
    # bf16 on CPU: no CPU kernel for these
    assert not ops.preferred("rms_norm", "cpu", torch.bfloat16)
    assert not ops.preferred("moe_swiglu_experts", "cpu", torch.bfloat16)


def test_bad_questions_are_errors():
    with pytest.raises(ValueError, match="unknown op 'flash'"):
        ops.preferred("flash", "cpu")
    with pytest.raises(ValueError, match="head_dims"):
        ops.preferred("mla_attention", "cpu")


@pytest.mark.parametrize("package", ["k2-model", "k2-optim"])
def test_consumers_do_not_probe_the_build(package):
    """k2-model and k2-optim go through k2_kernels.ops: no `_lib`, no BLAS probing of their own."""
    for path in sorted((PACKAGES / package / "src").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"k2_kernels\s+import\s+_lib|k2_kernels\._lib|_C\b", text), path
        assert not re.search(r"has_fast_blas|scipy_openblas|\bBLAS\b", text), path
