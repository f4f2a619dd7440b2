"""Which path an op takes here: the one boundary consumers ask instead of probing the build.

`capabilities()` says what this install can run (compiled module, CPU and CUDA kernels, the
BLAS the CPU kernels call). `preferred(op, device, ...)` is the automatic choice of k2-model and
k2-optim: True when the compiled kernel is the path to take for `op` there, False when torch's
own path is as good or better (e.g. the CPU kernels on the built-in GEMM, without OpenBLAS, are
correct but slower than torch's). Calling an op directly always works: it runs the kernel when
one serves the tensors and the PyTorch reference otherwise (`k2_kernels.ops`).

`cpu_has_native_bf16()` is the one probe every package asks before it picks bf16 for CPU work
(k2-optim's Newton-Schulz dtype, k2 commands' startup lines): bf16 GEMMs are native on CPUs with
AVX512-BF16 or AMX (measured ~3.5-4.5x fp32's GFLOP/s there) and emulated elsewhere (~30x slower
than fp32 on AVX2). `K2_NATIVE_BF16=0|1` overrides it, so a developer on one kind of CPU can run
the suite as the other kind would choose its dtypes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from k2_kernels import _lib
from k2_kernels.attention_ops import kernel_serves as _attention_serves
from k2_kernels.newton_schulz_ops import kernel_serves as _newton_schulz_serves

OPS = ("rms_norm", "mla_attention", "mla_decode_paged", "moe_swiglu_experts", "newton_schulz")


@dataclass(frozen=True)
class Capabilities:
    """What this install of k2-kernels can run."""

    compiled: bool  # k2_kernels._C imported
    cpu_kernels: bool
    cuda_kernels: bool
    cuda_archs: str | None  # the archs the CUDA code was built for, e.g. "90a"
    blas: str  # what the CPU kernels' GEMMs call: "openblas ...", "builtin" or "none"
    fast_cpu_blas: bool  # OpenBLAS attached (k2-kernels[blas]): the CPU kernels are the fast path
    load_error: str | None  # why k2_kernels._C did not import, when it did not
    native_bf16: bool = False  # cpu_has_native_bf16(): bf16 GEMMs are native on this CPU

    def as_dict(self) -> dict:
        return asdict(self)


def capabilities() -> Capabilities:
    info = _lib.info()
    return Capabilities(
        compiled=info["compiled"],
        cpu_kernels=info["cpu_kernels"],
        cuda_kernels=info["cuda_kernels"],
        cuda_archs=info["cuda_archs"],
        blas=info["blas"],
        fast_cpu_blas=_lib.has_fast_blas(),
        load_error=info["load_error"],
        native_bf16=cpu_has_native_bf16(),
    )


NATIVE_BF16_ENV = "K2_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles), as torch's oneDNN
    sees it; `K2_NATIVE_BF16=1` / `=0` overrides the probe (any other value is an error)."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{NATIVE_BF16_ENV}={forced!r}: expected 0 or 1 (or unset: probe the CPU)")
        return forced == "1"
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private probes moved: assume the conservative answer
        return False


def preferred(
    op: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    head_dims: tuple[int, int] | None = None,
) -> bool:
    """Whether the automatic choice for `op` on `device` (and `dtype`) is the compiled kernel.

    `head_dims=(Dk, Dv)` is required for "mla_attention" (the CUDA kernel is built for some head
    sizes only). CPU kernels are preferred only on OpenBLAS; the RMSNorm kernel is CPU-only (on
    CUDA, torch's fused rms_norm)."""
    device = torch.device(device)
    cpu = device.type == "cpu"
    if op == "rms_norm":
        C = _lib.compiled()
        return cpu and dtype == torch.float32 and _lib.has_cpu() and hasattr(C, "rms_norm_fwd_cpu")
    if op == "mla_attention":
        if head_dims is None:
            raise ValueError("preferred('mla_attention', ...) needs head_dims=(Dk, Dv)")
        return _attention_serves(device, *head_dims) and (not cpu or _lib.has_fast_blas())
    # reads the pool in place: at a few heads faster than torch's gather + bmm on any BLAS; from 16
    # heads on its per-block products are GEMMs, on par with torch's with OpenBLAS attached
    # (docs/kernels.md), about 2x slower on the built-in GEMM at K2's 64 heads
    if op == "mla_decode_paged":
        from k2_kernels.decode_ops import decode_kernel_serves

        return decode_kernel_serves(device)
    if op == "moe_swiglu_experts":  # fp32 CPU kernel; elsewhere the op is torch._grouped_mm anyway
        return cpu and dtype == torch.float32 and _lib.has_cpu() and _lib.has_fast_blas()
    if op == "newton_schulz":
        return _newton_schulz_serves(device, dtype)
    raise ValueError(f"preferred: unknown op {op!r}; one of {OPS}")


__all__ = ["NATIVE_BF16_ENV", "OPS", "Capabilities", "capabilities", "cpu_has_native_bf16", "preferred"]
