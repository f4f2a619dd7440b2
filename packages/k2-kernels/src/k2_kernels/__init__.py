"""k2-kernels: compiled C++/CUDA kernels for K2, exposed as torch ops (`k2_kernels.ops`)
with a plain PyTorch ground truth (`k2_kernels.reference`)."""

from k2_kernels import ops, reference
from k2_kernels._lib import available, info
from k2_kernels.dispatch import capabilities, preferred

__version__ = "0.1.0"
__all__ = ["available", "capabilities", "info", "ops", "preferred", "reference"]
