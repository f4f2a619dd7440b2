"""MoE routing / permute / unpermute: k2 kernels (k2_kernels.ops) vs the PyTorch reference
(k2_kernels.reference), measured in the same run. Prints a table of times and speedups.

    python benchmarks/moe_ops.py                 # CPU, fp32
    python benchmarks/moe_ops.py --device cuda   # GPU, bf16 activations

Shape legend: T tokens, E experts, K experts per token, G groups (kept TG), D hidden size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from k2_kernels import info, ops, reference


def bench(fn: Callable[[], object], device: str, reps: int, warmup: int = 3) -> float:
    """Median wall time in milliseconds (synchronising the GPU around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def unpermute_fwd_bwd(
    mod, y_ND: torch.Tensor, rows_N: torch.Tensor, w_TK: torch.Tensor, grad_TD: torch.Tensor
) -> None:
    y_ND.grad = w_TK.grad = None
    mod.moe_unpermute(y_ND, rows_N, w_TK).backward(grad_TD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="T (default 4096 on CPU, 16384 on CUDA)")
    args = ap.parse_args()
    dev = args.device
    cuda = dev == "cuda"
    T = args.tokens or (16384 if cuda else 4096)
    D = 7168 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    reps = args.reps or (50 if cuda else 10)
    torch.manual_seed(0)
    print(f"device={dev} T={T} D={D} dtype={dtype} k2_kernels={info()}")
    if cuda:
        print(f"gpu: {torch.cuda.get_device_name(0)}")
    else:
        print(f"cpu threads: {torch.get_num_threads()}")

    rows = []
    for name, E, K, G, TG in [("kimi-k2", 384, 8, 1, 1), ("deepseek-v3", 256, 8, 8, 4)]:
        logits = torch.randn(T, E, device=dev, dtype=dtype)
        bias = 0.01 * torch.randn(E, device=dev)
        x = torch.randn(T, D, device=dev, dtype=dtype)
        idx, w = ops.moe_route(logits, bias, K, G, TG, 2.827)
        x_ND, rows_N, _, _ = ops.moe_permute(x, idx, E)
        cases = [
            ("route", "moe_route", (logits, bias, K, G, TG, 2.827)),
            ("permute", "moe_permute", (x, idx, E)),
            ("unpermute", "moe_unpermute", (x_ND, rows_N, w)),
        ]
        y_ND = x_ND.detach().requires_grad_()
        w_TK = w.detach().requires_grad_()
        grad_TD = torch.randn(T, D, device=dev, dtype=dtype)

        for op, fn_name, fn_args in cases:
            t_ref = bench(partial(getattr(reference, fn_name), *fn_args), dev, reps)
            t_k2 = bench(partial(getattr(ops, fn_name), *fn_args), dev, reps)
            rows.append((f"{op} ({name}, E={E} K={K}" + (f" G={G}/{TG})" if G > 1 else ")"), t_ref, t_k2))
        bwd_args = (y_ND, rows_N, w_TK, grad_TD)
        t_ref = bench(partial(unpermute_fwd_bwd, reference, *bwd_args), dev, reps)
        t_k2 = bench(partial(unpermute_fwd_bwd, ops, *bwd_args), dev, reps)
        rows.append((f"unpermute fwd+bwd ({name})", t_ref, t_k2))

    print()
    print(
        f"| op (T={T}, D={D}, {str(dtype).replace('torch.', '')}, {dev}) | reference ms | k2 ms | speedup |"
    )
    print("|---|---:|---:|---:|")
    for label, t_ref, t_k2 in rows:
        print(f"| {label} | {t_ref:.3f} | {t_k2:.3f} | {t_ref / t_k2:.2f}x |")


if __name__ == "__main__":
    main()
