"""Batched Newton-Schulz orthogonalisation (the "msign" at the heart of Muon).

Tensor legend (torchtitan style):
    B  batch of logical matrices (experts, same-shape weights stacked together)
    M  rows of the matrix after the optional transpose (M <= N: the Gram side)
    N  columns after the optional transpose

`newton_schulz(G_BMN)` returns an approximation of U V^T for G = U S V^T, computed
as a fixed polynomial iteration X <- a X + (b A + c A^2) X with A = X X^T. The whole
batch goes through one batched GEMM per product, so 64 experts cost three batched calls
per step instead of 192 Python-level matmuls; the a/b/c terms are applied in place on the
fresh products (fp32) or fused into `baddbmm` (bf16, matching torch.optim.Muon's rounding).

Where k2-kernels has a compiled kernel for the device and dtype (CPU fp32; CUDA bf16 and fp32)
the iteration runs there (`k2_kernels.newton_schulz_ops`: ssyrk for the symmetric X X^T and
A A, the polynomial fused into the products); elsewhere, notably CPU bf16 (kept bit-identical
to torch.optim.Muon), the batched PyTorch code below runs. `backend=` forces either.

Two coefficient schedules ship:
  * "keller"        Keller Jordan's quintic (3.4445, -4.7750, 2.0315), every step; what
                    `torch.optim.Muon` uses. Normalisation X / max(||X||_F, eps).
  * "polar_express" the per-step optimal schedule of Amsel et al. 2025 (arXiv:2505.16932),
                    with the paper's 1.01 safety factor on all but the last polynomial and
                    normalisation X / (1.01 ||X||_F + eps). Steps past the list reuse the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from k2_kernels.ops import newton_schulz as _ns_kernel
from k2_kernels.ops import preferred as _kernel_preferred
from torch import Tensor

__all__ = [
    "KELLER_QUINTIC",
    "POLAR_EXPRESS",
    "NSSchedule",
    "NSWorkspace",
    "resolve_ns_schedule",
    "newton_schulz",
]

Coeffs = tuple[float, float, float]

KELLER_QUINTIC: Coeffs = (3.4445, -4.7750, 2.0315)

# Degree-5 Polar Express polynomials (arXiv:2505.16932, Algorithm 1), before the safety factor.
_POLAR_EXPRESS_RAW: tuple[Coeffs, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01
POLAR_EXPRESS: tuple[Coeffs, ...] = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for (a, b, c) in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)


@dataclass(frozen=True)
class NSSchedule:
    """The per-step coefficients and the pre-iteration normalisation of one NS run."""

    coeffs: tuple[Coeffs, ...]  # one (a, b, c) per step
    norm_scale: float = 1.0  # X / (norm_scale * ||X||_F), then clamp by eps
    eps_mode: str = "clamp"  # "clamp": max(norm, eps) (torch); "add": norm + eps (Polar Express)


def resolve_ns_schedule(
    ns_coefficients: str | Coeffs | Sequence[Coeffs] = "keller", ns_steps: int = 5
) -> NSSchedule:
    """Turn the user's `ns_coefficients` into an explicit per-step schedule.

    Accepts "keller", "polar_express", one (a, b, c) triple used every step, or a list of
    triples (one per step; the last repeats when `ns_steps` is longer).
    """
    if not isinstance(ns_steps, int) or ns_steps < 1 or ns_steps >= 100:
        raise ValueError(f"ns_steps must be an int in [1, 99], got {ns_steps!r}")
    if isinstance(ns_coefficients, str):
        name = ns_coefficients.lower().replace("-", "_")
        if name in ("keller", "keller_jordan", "quintic"):
            return NSSchedule((KELLER_QUINTIC,) * ns_steps)
        if name in ("polar_express", "polarexpress"):
            pe = POLAR_EXPRESS
            coeffs = tuple(pe[min(i, len(pe) - 1)] for i in range(ns_steps))
            return NSSchedule(coeffs, norm_scale=_PE_SAFETY, eps_mode="add")
        raise ValueError(
            f"ns_coefficients: unknown schedule {ns_coefficients!r}; expected 'keller', "
            "'polar_express', an (a, b, c) triple or a list of triples"
        )
    seq = tuple(ns_coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        return NSSchedule((tuple(float(v) for v in seq),) * ns_steps)  # type: ignore[arg-type]
    triples = []
    for i, t in enumerate(seq):
        t = tuple(t)
        if len(t) != 3:
            raise ValueError(f"ns_coefficients[{i}] must be an (a, b, c) triple, got {t!r}")
        triples.append(tuple(float(v) for v in t))
    if not triples:
        raise ValueError("ns_coefficients: empty list of coefficient triples")
    return NSSchedule(tuple(triples[min(i, len(triples) - 1)] for i in range(ns_steps)))  # type: ignore[misc]


class NSWorkspace:
    """Reusable buffers for repeated same-shape NS calls on CPU (an optimizer's chunks): the
    iteration's X, A and P land in memory already mapped and cached instead of fresh allocations
    (measured ~15% of a bf16 chunk's time on 2 cores). A result computed with a workspace is one
    of its buffers: valid until the next call with the same workspace."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        numel = 1
        for n in shape:
            numel *= n
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


def newton_schulz(
    G: Tensor,
    schedule: NSSchedule | None = None,
    dtype: torch.dtype = torch.float32,
    eps: float = 1e-7,
    backend: str = "auto",
    workspace: NSWorkspace | None = None,
) -> Tensor:
    """Orthogonalise every trailing [out, in] matrix of `G` (any leading batch shape).

    Never writes into `G`: the normalisation is out of place, so a momentum buffer passed
    here (even one already in `dtype`) is left untouched. Returns a tensor of `dtype`
    with G's shape. `backend`: "auto" (the k2-kernels kernel where one serves the device and
    dtype, except CPU bf16), "kernel" (always the k2-kernels op, which falls back to its own
    reference elsewhere) or "torch" (the batched PyTorch iteration here). `workspace`: buffers
    the PyTorch iteration reuses across calls (the result is then valid until the next call
    with that workspace); the arithmetic is the same with or without.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz expects [..., out, in] matrices, got shape {tuple(G.shape)}")
    if backend not in ("auto", "kernel", "torch"):
        raise ValueError(f"newton_schulz: backend must be 'auto', 'kernel' or 'torch', got {backend!r}")
    schedule = schedule or resolve_ns_schedule("keller", 5)
    out_dim, in_dim = G.shape[-2], G.shape[-1]
    G_BMN = G.reshape(-1, out_dim, in_dim)
    use_kernel = backend == "kernel" or (
        backend == "auto" and _kernel_preferred("newton_schulz", G.device, dtype)
    )
    if use_kernel or workspace is None:
        X_BMN = G_BMN.to(dtype)
    else:  # the conversion lands in a reused buffer
        X_BMN = workspace.get("in", tuple(G_BMN.shape), torch.empty(0, dtype=dtype, device=G.device))
        X_BMN.copy_(G_BMN)
    transposed = out_dim > in_dim
    if transposed and not use_kernel:  # iterate on the smaller Gram matrix (the kernel does it itself)
        X_BMN = X_BMN.mT
    norm_B11 = torch.linalg.vector_norm(X_BMN, dim=(-2, -1), keepdim=True)
    if schedule.eps_mode == "add":
        denom_B11 = norm_B11 * schedule.norm_scale + eps
    else:
        denom_B11 = (norm_B11 * schedule.norm_scale).clamp(min=eps)
    if use_kernel:
        return _ns_kernel(X_BMN / denom_B11, schedule.coeffs).reshape(G.shape)
    if workspace is None:
        X_BMN = X_BMN / denom_B11
        X_BMN = _iterate(X_BMN, schedule)
    else:
        X_BMN = _iterate_in(X_BMN.div_(denom_B11), schedule, workspace)
    if transposed:
        X_BMN = X_BMN.mT
    return X_BMN.reshape(G.shape)


def _iterate(X_BMN: Tensor, schedule: NSSchedule) -> Tensor:
    fused = X_BMN.dtype in (torch.bfloat16, torch.float16)
    for a, b, c in schedule.coeffs:
        A_BMM = torch.bmm(X_BMN, X_BMN.mT)
        if fused:
            # half precision: GEMM-fused multiply-adds round once, exactly as torch.optim.Muon's
            # addmm does (bit-identical updates), and measured no slower than the unfused form
            P_BMM = torch.baddbmm(A_BMM, A_BMM, A_BMM, beta=b, alpha=c)
            X_BMN = torch.baddbmm(X_BMN, P_BMM, X_BMN, beta=a)
        else:
            # fp32/fp64 on CPU: baddbmm with beta != 0 measured slower than a plain bmm followed
            # by in-place scaling (one pass over each fresh product, no extra allocation)
            P_BMM = torch.bmm(A_BMM, A_BMM).mul_(c).add_(A_BMM, alpha=b)
            X_BMN = torch.bmm(P_BMM, X_BMN).add_(X_BMN, alpha=a)
    return X_BMN


def _iterate_in(X_BMN: Tensor, schedule: NSSchedule, ws: NSWorkspace) -> Tensor:
    """`_iterate` with every product written into the workspace's buffers (same ops, same rounding)."""
    B, M, N = X_BMN.shape
    A_BMM, P_BMM = ws.get("A", (B, M, M), X_BMN), ws.get("P", (B, M, M), X_BMN)
    # X ping-pongs between two contiguous buffers, as the fresh products of `_iterate` are
    X_pair = [ws.get(k, (B, M, N), X_BMN) for k in ("X0", "X1")]
    fused = X_BMN.dtype in (torch.bfloat16, torch.float16)
    for i, (a, b, c) in enumerate(schedule.coeffs):
        X_next = X_pair[i % 2]
        torch.bmm(X_BMN, X_BMN.mT, out=A_BMM)
        if fused:
            torch.baddbmm(A_BMM, A_BMM, A_BMM, beta=b, alpha=c, out=P_BMM)
            torch.baddbmm(X_BMN, P_BMM, X_BMN, beta=a, out=X_next)
        else:
            torch.bmm(A_BMM, A_BMM, out=P_BMM).mul_(c).add_(A_BMM, alpha=b)
            torch.bmm(P_BMM, X_BMN, out=X_next).add_(X_BMN, alpha=a)
        X_BMN = X_next
    return X_BMN
