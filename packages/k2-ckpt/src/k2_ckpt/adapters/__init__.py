"""Receivers' loaders: a built-in one for any `nn.Module` by HF names, and engine integrations.

`vllm` and `sglang` are imported lazily (they are not dependencies of k2-ckpt).
"""

from k2_ckpt.adapters.between_steps import BetweenStepsLoader
from k2_ckpt.adapters.module import ModuleAdapter, dequantize_fp8_blocks

__all__ = ["BetweenStepsLoader", "ModuleAdapter", "dequantize_fp8_blocks"]
