"""k2-kernels: compiled C++/CUDA kernels for K2, exposed as torch ops (`k2_kernels.ops`)
with a plain PyTorch ground truth (`k2_kernels.reference`)."""

__version__ = "0.1.0"
