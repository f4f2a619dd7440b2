"""k2-model (loading released FP8 checkpoints) and k2-ckpt (an engine receiving FP8 pushes) each
dequantise 128x128 block-scaled e4m3 weights: k2-ckpt must not depend on k2-model, so the function
exists twice. This test keeps the two identical (partial edge blocks included) against the formula."""

from __future__ import annotations

import math

import pytest
import torch
from k2_ckpt.adapters.module import dequantize_fp8_blocks as ckpt_dequant
from k2_model.checkpoint import dequantize_fp8_blocks as model_dequant


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (7, 129)])
def test_both_dequantisers_equal_the_block_formula(shape):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    scale = torch.rand(blocks, generator=g) + 0.01
    expected = torch.empty(shape)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = tile * scale[i, j]
    a, b = model_dequant(w, scale), ckpt_dequant(w, scale)
    assert torch.equal(a, expected) and torch.equal(b, expected)
