"""k2-kernels: compiled C++/CUDA kernels for K2, exposed as torch ops (`k2_kernels.ops`)
with a plain PyTorch ground truth (`k2_kernels.reference`)."""

from k2_kernels import ops, reference
from k2_kernels._lib import available, info
from k2_kernels.dispatch import capabilities, cpu_has_native_bf16, preferred

__version__ = "0.1.0"
__all__ = ["available", "capabilities", "cpu_has_native_bf16", "info", "ops", "preferred", "reference"]
