"""Loading the compiled module `k2_kernels._C` and reporting what it offers.

The compiled module is optional: without it (or without its CUDA part) every op falls back to
`k2_kernels.reference`, and the first fallback in a process says so once with `warnings.warn`.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from types import ModuleType
from typing import Any

import torch

try:  # the compiled extension; absent in a source tree that was never built
    from k2_kernels import _C as _compiled

    _LOAD_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the build
    _compiled = None
    _LOAD_ERROR = f"{type(exc).__name__}: {exc}"


def _attach_blas() -> str:
    """Give the CPU kernels OpenBLAS's sgemm (scipy-openblas32 wheel) when it is installed.

    Resolved at run time (see csrc/include/k2/blas.h), so neither the build nor the wheel needs a
    BLAS. OpenBLAS is set to one thread: the kernels call it from inside their own OpenMP loops.
    `K2_BLAS=builtin` keeps the built-in kernel. Returns the backend's name.
    """
    if _compiled is None or not hasattr(_compiled, "blas_set_sgemm"):
        return "none"
    if os.environ.get("K2_BLAS", "").lower() == "builtin":
        _compiled.blas_set_sgemm(0)
        _compiled.blas_set_ssyrk(0)
        return "builtin"
    try:
        import scipy_openblas32

        dll = (
            scipy_openblas32.dll
            if hasattr(scipy_openblas32, "dll")
            else ctypes.CDLL(
                os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
            )
        )
        dll.scipy_openblas_set_num_threads(ctypes.c_int(1))
        _compiled.blas_set_sgemm(ctypes.cast(dll.scipy_cblas_sgemm, ctypes.c_void_p).value)
        _compiled.blas_set_ssyrk(ctypes.cast(dll.scipy_cblas_ssyrk, ctypes.c_void_p).value)
        return f"openblas {scipy_openblas32.__version__} (scipy-openblas32)"
    except (ImportError, OSError, AttributeError):
        return "builtin"


BLAS = _attach_blas()


def has_fast_blas() -> bool:
    """True when the CPU kernels run on OpenBLAS (`pip install k2-kernels[blas]`). Consumers pick
    the compiled CPU kernels automatically only then: on the built-in GEMM they are correct but
    can be slower than torch's own paths."""
    return BLAS.startswith("openblas")


# dtype tags shared with csrc/include/k2/common.h (keep in sync).
DTYPE_TAG: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
}
FLOAT_TAGS = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_warned = False
_warn_lock = threading.Lock()


def compiled() -> ModuleType | None:
    """The compiled module, or None when it could not be imported."""
    return _compiled


def has_cpu() -> bool:
    return _compiled is not None and hasattr(_compiled, "moe_route_cpu")


def has_cuda() -> bool:
    return (
        _compiled is not None
        and bool(getattr(_compiled, "with_cuda", False))
        and hasattr(_compiled, "moe_route_cuda")
    )


def available() -> bool:
    """True when the compiled module loaded (CPU kernels at least)."""
    return has_cpu()


def info() -> dict[str, Any]:
    """What this install can run: compiled module, CUDA kernels, and why not when not."""
    return {
        "compiled": _compiled is not None,
        "compiled_path": getattr(_compiled, "__file__", None),
        "cpu_kernels": has_cpu(),
        "cuda_kernels": has_cuda(),
        "cuda_archs": getattr(_compiled, "cuda_archs", None),
        "blas": BLAS,
        "load_error": _LOAD_ERROR,
        "torch_cuda_available": torch.cuda.is_available(),
    }


def warn_fallback(device: torch.device) -> None:
    """Say once per process that an op runs the PyTorch reference instead of a kernel."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    if _compiled is None:
        why = f"the compiled module k2_kernels._C could not be imported ({_LOAD_ERROR})"
    elif device.type == "cuda":
        why = "k2_kernels._C was built without CUDA kernels (rebuild with K2_CUDA=ON and nvcc on PATH)"
    else:
        why = f"k2_kernels._C has no kernels for device {device}"
    warnings.warn(
        f"k2_kernels: {why}; falling back to the plain PyTorch reference ops (k2_kernels.reference), "
        "which are correct but slower.",
        RuntimeWarning,
        stacklevel=3,
    )
