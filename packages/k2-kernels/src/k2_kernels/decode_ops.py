"""MLA decode attention over a paged latent cache, read in place: `torch.ops.k2.mla_decode_paged`.

`mla_decode_paged(q, cache, table, lens, C, scale)`: for each sequence i and head h,
`softmax_j(scale * q[i, h] . row_j) @ rows[:, :C]` over the rows j < lens[i] of sequence i, row j
being `cache[table[i, j // B], j % B]` (the absorbed form of MLA decode: the query already holds
W_UK, the caller applies W_UV). CPU tensors run the C++ kernel (`csrc/cpu/mla_decode_cpu.cpp`:
each row read once per sequence for all heads, in the pool; fp32 or bf16 cache); elsewhere, or
without the compiled module, the reference, which gathers each sequence's blocks into a padded
copy (the engine's former path). Inference only: no autograd.

Shape legend: n sequences, H heads, K = C + R cache row, Nb blocks, B rows per block, M blocks per table.
"""

# No `from __future__ import annotations`: custom_op reads the annotations to infer the schema.
import torch
from torch import Tensor

from k2_kernels import _lib, reference

__all__ = ["decode_kernel_serves", "mla_decode_paged"]


def decode_kernel_serves(device: torch.device | str) -> bool:
    """Whether the compiled kernel runs `mla_decode_paged` on `device` (CPU, compiled module)."""
    C = _lib.compiled()
    return torch.device(device).type == "cpu" and C is not None and hasattr(C, "mla_decode_paged_cpu")


def _check(q: Tensor, cache: Tensor, table: Tensor, lens: Tensor, C: int) -> None:
    if q.dim() != 3 or cache.dim() != 3 or table.dim() != 2 or lens.dim() != 1:
        raise ValueError(
            "mla_decode_paged: expected q [n, H, K], cache [blocks, B, K], table [n, M], lens [n]; got "
            f"{tuple(q.shape)}, {tuple(cache.shape)}, {tuple(table.shape)}, {tuple(lens.shape)}"
        )
    n, _, K = q.shape
    if cache.shape[2] != K or table.shape[0] != n or lens.shape[0] != n:
        raise ValueError(
            f"mla_decode_paged: q {tuple(q.shape)}, cache {tuple(cache.shape)}, table {tuple(table.shape)}, "
            f"lens {tuple(lens.shape)} disagree (K and n must match)"
        )
    if not 1 <= C <= K:
        raise ValueError(f"mla_decode_paged: C={C} must be in 1..K={K}")
    if table.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError(f"mla_decode_paged: table and lens must be int64, got {table.dtype}, {lens.dtype}")


@torch.library.custom_op("k2::mla_decode_paged", mutates_args=())
def _mla_decode_paged(q: Tensor, cache: Tensor, table: Tensor, lens: Tensor, C: int, scale: float) -> Tensor:
    _check(q, cache, table, lens, C)
    if not decode_kernel_serves(q.device) or cache.dtype not in (torch.float32, torch.bfloat16):
        return reference.mla_decode_paged(q, cache, table, lens, C, scale).to(q.dtype)
    n, H, K = q.shape
    qf = q.float().contiguous()
    cache_c, table_c, lens_c = cache.contiguous(), table.contiguous(), lens.contiguous()
    out = torch.empty(n, H, C, dtype=torch.float32)
    lib = _lib.compiled()
    lib.set_num_threads(torch.get_num_threads())
    lib.mla_decode_paged_cpu(
        qf.data_ptr(), cache_c.data_ptr(), _lib.DTYPE_TAG[cache.dtype], table_c.data_ptr(), lens_c.data_ptr(),
        n, H, K, C, cache.shape[0], cache.shape[1], table.shape[1], float(scale), out.data_ptr(),
    )  # fmt: skip
    return out.to(q.dtype)


@_mla_decode_paged.register_fake
def _(q, cache, table, lens, C, scale):
    _check(q, cache, table, lens, C)
    return q.new_empty(q.shape[0], q.shape[1], C)


def mla_decode_paged(q: Tensor, cache: Tensor, table: Tensor, lens: Tensor, C: int, scale: float) -> Tensor:
    """See the module: [n, H, C] in q's dtype (fp32 accumulation)."""
    return _mla_decode_paged(q, cache, table, lens, int(C), float(scale))
