"""Newton-Schulz orthogonalisation (Muon's "msign") as a torch op: `torch.ops.k2.newton_schulz`.

Shape legend: B matrices, M rows, N columns; the kernels iterate on the wide orientation
(M <= N, the smaller Gram matrix), so a tall input is transposed in and out.

One step with coefficients (a, b, c), all steps in X's dtype:
    A = X X^T;   P = b A + c A A;   X <- a X + P X
Each product is rounded once to X's dtype (P and X' are `baddbmm`s: the a/b/c terms are added
before rounding), which is what the bf16 CUDA kernel does with fp32 accumulation and what
`torch.optim.Muon`'s bf16 `addmm`s do. The input must already be normalised (||X||_2 <= 1,
e.g. X / ||X||_F): the norm and its eps convention belong to the caller (k2_optim).

Dispatch: CPU float32 -> the C++ kernel (OpenMP + BLAS ssyrk/sgemm, torch's thread count);
CUDA bfloat16/float32 -> the CUDA kernel (upper-triangle tiles of the symmetric products, fused
epilogues); anything else (float64, fp16, CPU bf16) -> `newton_schulz_reference`. A missing
compiled module or CUDA part also falls back to the reference and warns once. No autograd: the
op is for optimizers.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from k2_kernels import _lib

__all__ = ["kernel_serves", "newton_schulz", "newton_schulz_reference"]

Coeffs = tuple[float, float, float]

_stale_warned = False
_stale_lock = threading.Lock()


def newton_schulz_reference(X_BMN: Tensor, coeffs: Sequence[Coeffs]) -> Tensor:
    """Plain PyTorch NS: the semantics of the op and its fallback (any dtype and device)."""
    transposed = X_BMN.shape[-2] > X_BMN.shape[-1]
    X = X_BMN.mT if transposed else X_BMN
    for a, b, c in coeffs:
        A = torch.bmm(X, X.mT)
        P = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, P, X, beta=a)
    return X.mT if transposed else X


def _flat_coeffs(coeffs: Sequence[Coeffs]) -> list[float]:
    flat: list[float] = []
    for i, t in enumerate(coeffs):
        t = tuple(t)
        if len(t) != 3:
            raise ValueError(f"newton_schulz: coeffs[{i}] must be an (a, b, c) triple, got {t!r}")
        flat.extend(float(v) for v in t)
    return flat


def _triples(flat: Sequence[float]) -> list[Coeffs]:
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


def _check(X_BMN: Tensor, coeffs: Sequence[float]) -> None:
    if X_BMN.dim() != 3:
        raise ValueError(
            f"newton_schulz: X_BMN must be 3-D [matrices, rows, cols], got shape {tuple(X_BMN.shape)}"
        )
    if not X_BMN.dtype.is_floating_point:
        raise TypeError(f"newton_schulz: X_BMN must be floating point, got {X_BMN.dtype}")
    if len(coeffs) % 3:
        raise ValueError(f"newton_schulz: coeffs must be (a, b, c) triples, got {len(coeffs)} values")


def _kernel_fn(device: torch.device, dtype: torch.dtype) -> str | None:
    """Name of the compiled function serving (device, dtype), or None (then the reference runs)."""
    if device.type == "cpu":
        name, dtypes, has = "newton_schulz_cpu", (torch.float32,), _lib.has_cpu()
    elif device.type == "cuda":
        name, dtypes, has = "newton_schulz_cuda", (torch.float32, torch.bfloat16), _lib.has_cuda()
    else:
        return None
    if dtype not in dtypes:
        return None  # outside the kernel's range: the reference, silently (as documented)
    if not has:
        _lib.warn_fallback(device)
        return None
    if not hasattr(_lib.compiled(), name):
        global _stale_warned
        with _stale_lock:
            first, _stale_warned = not _stale_warned, True
        if first:
            warnings.warn(
                f"k2_kernels: the compiled module has no {name} (built before the Newton-Schulz kernels; "
                "rebuild k2-kernels); newton_schulz runs the plain PyTorch reference.",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    return name


def kernel_serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a compiled NS kernel runs for tensors of this device and dtype (else the reference)."""
    device = torch.device(device)
    if device.type == "cpu":  # on the built-in GEMM (no OpenBLAS) torch's batched NS is faster
        return (
            dtype == torch.float32 and hasattr(_lib.compiled(), "newton_schulz_cpu") and _lib.has_cpu()
            and _lib.has_fast_blas()
        )  # fmt: skip
    if device.type == "cuda":
        return (
            dtype in (torch.float32, torch.bfloat16)
            and _lib.has_cuda()
            and hasattr(_lib.compiled(), "newton_schulz_cuda")
        )
    return False


def _run(X_BMN: Tensor, coeffs: list[float]) -> Tensor | None:
    B, M, N = X_BMN.shape
    fn = _kernel_fn(X_BMN.device, X_BMN.dtype)
    if fn is None or min(M, N) == 0:
        return None
    transposed = M > N
    m, n = (N, M) if transposed else (M, N)
    # A fresh contiguous [B, m, n] buffer: the kernel iterates in place, the input stays untouched.
    X_bmn = torch.empty((B, m, n), dtype=X_BMN.dtype, device=X_BMN.device)
    X_bmn.copy_(X_BMN.mT if transposed else X_BMN)
    if B and coeffs:
        C = _lib.compiled()
        tag = _lib.DTYPE_TAG[X_bmn.dtype]
        if fn == "newton_schulz_cpu":
            threads = torch.get_num_threads()
            ws = torch.empty(C.newton_schulz_cpu_workspace_floats(B, m, n, threads), dtype=torch.float32)
            C.newton_schulz_cpu(X_bmn.data_ptr(), tag, B, m, n, m * n, coeffs, ws.data_ptr(), threads)
        else:
            dev = X_bmn.device.index if X_bmn.device.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(dev).cuda_stream
            ws = torch.empty(
                C.newton_schulz_cuda_workspace_bytes(B, m, n, tag), dtype=torch.uint8, device=X_bmn.device
            )
            C.newton_schulz_cuda(dev, stream, X_bmn.data_ptr(), tag, B, m, n, m * n, coeffs, ws.data_ptr())
    return X_bmn.mT if transposed else X_bmn


@torch.library.custom_op("k2::newton_schulz", mutates_args=())
def _newton_schulz(X_BMN: Tensor, coeffs: list[float]) -> Tensor:
    _check(X_BMN, coeffs)
    out = _run(X_BMN, coeffs)
    if out is None:
        out = newton_schulz_reference(X_BMN, _triples(coeffs)).clone()  # clone: never alias the input
    return out


@_newton_schulz.register_fake
def _(X_BMN, coeffs):
    _check(X_BMN, coeffs)
    B, M, N = X_BMN.shape
    if M > N:  # the real op returns the transpose of a contiguous [B, N, M] buffer
        return X_BMN.new_empty((B, N, M)).mT
    return X_BMN.new_empty((B, M, N))


def newton_schulz(X_BMN: Tensor, coeffs: Sequence[Coeffs]) -> Tensor:
    """Run every (a, b, c) step of `coeffs` on each trailing [M, N] matrix of `X_BMN`.

    `X_BMN` is [B, M, N] (or [M, N], or any [..., M, N]), already normalised; returns a new
    tensor of its shape and dtype. Semantics: `newton_schulz_reference`.
    """
    if X_BMN.dim() < 2:
        raise ValueError(f"newton_schulz: X_BMN must be [..., rows, cols], got shape {tuple(X_BMN.shape)}")
    shape = X_BMN.shape
    out = _newton_schulz(X_BMN.reshape(-1, shape[-2], shape[-1]), _flat_coeffs(coeffs))
    return out.reshape(shape)
