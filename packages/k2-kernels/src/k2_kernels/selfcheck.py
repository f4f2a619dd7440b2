"""Quick self-check of the compiled ops against the reference on one device.

    python -m k2_kernels.selfcheck [--device cuda]

Runs every op (forward and backward) on a few small shapes and compares with
`k2_kernels.reference` computed on the CPU; exit status 1 on any mismatch. Small enough to run
under `compute-sanitizer` (scripts/gpu_check.sh does, to catch out-of-bounds accesses and races).

Shape legend: T tokens, E experts, K experts per token, D hidden size.
"""

from __future__ import annotations

import argparse
import sys

import torch

from k2_kernels import info, ops, reference


def check(device: str, quick: bool = False) -> list[str]:
    """Mismatch descriptions (empty when everything agrees). quick: small shapes only."""
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)
    cases = [(1, 384, 8, 1, 1, 64), (300, 256, 8, 8, 4, 72), (33, 16, 16, 1, 1, 7)]
    if not quick:
        cases.append((5000, 64, 6, 4, 2, 16))  # many chunks in the GPU sort
    for T, E, K, G, TG, D in cases:
        tag = f"T={T} E={E} K={K} G={G}/{TG} D={D}"
        logits = torch.randn(T, E, generator=gen)
        bias = 0.05 * torch.randn(E, generator=gen)
        idx, w = ops.moe_route(logits.to(device), bias.to(device), K, G, TG, 2.5)
        ridx, rw = reference.moe_route(logits, bias, K, G, TG, 2.5)
        if not torch.equal(idx.cpu(), ridx):
            failures.append(f"moe_route indices {tag}")
        if not torch.allclose(w.cpu(), rw, atol=2e-6, rtol=0):
            failures.append(f"moe_route weights {tag}: max err {(w.cpu() - rw).abs().max():.3g}")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, D, generator=gen).to(dtype)
            got = ops.moe_permute(x.to(device), ridx.to(device).int(), E)
            want = reference.moe_permute(x, ridx, E)
            for name, g, r in zip(("x_ND", "row_to_slot", "counts", "offsets"), got, want):
                if not torch.equal(g.cpu(), r.to(g.dtype)):
                    failures.append(f"moe_permute {name} {tag} {dtype}")
            y = torch.randn(T * K, D, generator=gen).to(dtype).requires_grad_()
            wt = rw.clone().requires_grad_()
            y_d = y.detach().to(device).requires_grad_()
            wt_d = wt.detach().to(device).requires_grad_()
            out = ops.moe_unpermute(y_d, got[1], wt_d)
            ref = reference.moe_unpermute(y, want[1], wt)
            tol = 1e-5 if dtype == torch.float32 else 2**-7
            if not torch.allclose(out.cpu().float(), ref.float(), atol=1e-5, rtol=tol):
                failures.append(f"moe_unpermute {tag} {dtype}")
            g_TD = torch.randn(T, D, generator=gen).to(dtype)
            out.backward(g_TD.to(device))
            ref.backward(g_TD)
            if not torch.allclose(y_d.grad.cpu().float(), y.grad.float(), atol=1e-5, rtol=tol):
                failures.append(f"moe_unpermute grad y {tag} {dtype}")
            if not torch.allclose(wt_d.grad.cpu(), wt.grad, atol=1e-3 if dtype != torch.float32 else 1e-4, rtol=tol):
                failures.append(f"moe_unpermute grad w {tag} {dtype}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="k2_kernels self-check against the reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes only (for compute-sanitizer)")
    args = ap.parse_args(argv)
    print(f"k2_kernels selfcheck on {args.device}: {info()}")
    failures = check(args.device, args.quick)
    for f in failures:
        print(f"FAIL: {f}")
    print("selfcheck: OK" if not failures else f"selfcheck: {len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
