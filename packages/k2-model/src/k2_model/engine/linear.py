"""Linear layers of a CPU decode step through oneDNN with pre-packed weights.

torch's CPU `F.linear` re-lays the weight out for its GEMM on every call; at a decode step's few
rows that is most of the cost of a large matrix. oneDNN's linear takes a weight packed once
(`torch.ops.mkldnn._reorder_linear_weight`), which measured, 1 thread, on a 2-core AMD EPYC
(AVX512-BF16), F.linear / packed in us:

    fp32 LM head 256 -> 8192:   1 row 231 / 140,  8 rows 927 / 348,  32 rows 2316 / 1315
    fp32 256 -> 576:            1 row  13 /  23,  8 rows  41 /  37,  32 rows  110 /  102
    bf16 LM head 256 -> 8192:   1 row 176 /  86,  8 rows 292 / 189,  32 rows  754 /  651
    bf16 256 -> 576:            1 row  26 /  19,  8 rows  33 /  25,  32 rows   65 /   57

so bf16 weights are packed at any size and fp32 ones from `FP32_MIN_ELEMENTS` up (below it
oneDNN's fixed cost loses at one row). The engine keeps no stale copy: a pack is keyed by the
weight tensor and its version counter, which every in-place update (`copy_` of a weight sync)
bumps, so an updated weight is re-packed on its next use. Anything else (CUDA, gradients, a torch
without the op) is plain `F.linear`; a weight or input oneDNN refuses falls back for that call or
weight only, not for the process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

FP32_MIN_ELEMENTS = 1 << 19  # 512K weights (2 MB): the fp32 size from which the packed GEMM wins

_packs = WeakTensorKeyDictionary()  # weight -> (its version when packed, the packed weight)
_unavailable = False  # set when this torch lacks the ops (then every call is F.linear)


def _packs_weight(w: Tensor) -> bool:
    if _unavailable or w.device.type != "cpu" or w.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if w.dtype == torch.bfloat16:
        return True
    return w.dtype == torch.float32 and w.numel() >= FP32_MIN_ELEMENTS


def linear(mod: nn.Linear, x: Tensor) -> Tensor:
    """`mod(x)` for a decode or prefill step (no gradients): through the packed weight where it wins."""
    global _unavailable
    w = mod.weight
    if not _packs_weight(w) or x.dtype != w.dtype or (torch.is_grad_enabled() and w.requires_grad):
        return mod(x)
    entry = _packs.get(w)
    try:
        if entry is None or entry[0] != w._version:
            entry = _packs[w] = (w._version, _pack(w))
        if entry[1] is None:  # oneDNN refused this weight: it stays on F.linear until it changes
            return F.linear(x, w, mod.bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x2, entry[1], mod.bias, "none", [], "")
    except (AttributeError, NotImplementedError):  # an op this torch build lacks: F.linear from now on
        _unavailable = True
        return F.linear(x, w, mod.bias)
    except RuntimeError:  # oneDNN refused this input: F.linear gives the answer (or the real error)
        return F.linear(x, w, mod.bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def _pack(w: Tensor) -> Tensor | None:
    """The oneDNN-packed copy of `w`, or None when oneDNN refuses it (an error that is about this
    weight, such as a layout it does not take, rather than about the build)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    except RuntimeError:
        return None
