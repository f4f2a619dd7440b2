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


def _choice_scores(
    logits_TE: torch.Tensor, bias_E: torch.Tensor | None, n_group: int, topk_group: int
) -> torch.Tensor:
    """The biased (and group-masked) scores the reference selects by, in float64."""
    T, E = logits_TE.shape
    choice_TE = logits_TE.double().sigmoid()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.double()
    if n_group > 1:
        group_TG = choice_TE.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_TG).scatter_(1, group_TG.topk(topk_group, dim=-1).indices, 1.0)
        choice_TE = choice_TE.masked_fill(keep_TG.repeat_interleave(E // n_group, dim=1) == 0, 0.0)
    return choice_TE


def route_mismatches(
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
    tie_tol: float = 1e-6,
    weight_tol: float = 2e-6,
) -> list[str]:
    """Compare a routing result with the reference; empty when it agrees.

    Indices must equal the reference's except where two experts' selection scores are within
    `tie_tol` (a near-tie that fp32 rounding may order either way); the weights must match the
    reference formula for the chosen experts within `weight_tol`.
    """
    logits_TE = logits_TE.cpu()
    bias_E = None if bias_E is None else bias_E.cpu()
    idx_TK, weight_TK = idx_TK.cpu(), weight_TK.cpu()
    out: list[str] = []
    ridx_TK, _ = reference.moe_route(
        logits_TE, bias_E, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob
    )
    diff = idx_TK != ridx_TK
    if diff.any():
        choice_TE = _choice_scores(logits_TE, bias_E, n_group, topk_group)
        gap = (choice_TE.gather(1, idx_TK) - choice_TE.gather(1, ridx_TK)).abs()
        bad = diff & (gap > tie_tol)
        if bad.any():
            t, k = (int(v) for v in bad.nonzero()[0])
            out.append(
                f"indices differ at token {t} slot {k}: {int(idx_TK[t, k])} vs reference {int(ridx_TK[t, k])}"
            )
    s_TK = logits_TE.float().sigmoid().gather(1, idx_TK)
    want_TK = s_TK / (s_TK.sum(-1, keepdim=True) + 1e-20) if norm_topk_prob else s_TK
    err = (weight_TK - want_TK * routed_scaling_factor).abs().max().item() if weight_TK.numel() else 0.0
    if err > weight_tol:
        out.append(f"weights differ by {err:.3g} > {weight_tol:g}")
    return out


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
        failures += [f"moe_route {tag}: {m}" for m in route_mismatches(idx, w, logits, bias, K, G, TG, 2.5)]
        ridx, rw = reference.moe_route(logits, bias, K, G, TG, 2.5)
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
            if not torch.allclose(
                wt_d.grad.cpu(), wt.grad, atol=1e-3 if dtype != torch.float32 else 1e-4, rtol=tol
            ):
                failures.append(f"moe_unpermute grad w {tag} {dtype}")
    failures += attention_mismatches(device, gen)
    failures += newton_schulz_mismatches(device, gen)
    if device == "cuda":
        torch.cuda.synchronize()
    return failures


def newton_schulz_mismatches(device: str, gen: torch.Generator) -> list[str]:
    """newton_schulz (5 Keller quintic steps) on a few wide and tall matrices vs the float64
    reference: fp32 within 1e-5, bf16 within 3e-2 (relative, per batch)."""
    from k2_kernels.newton_schulz_ops import newton_schulz, newton_schulz_reference

    failures = []
    coeffs = [(3.4445, -4.7750, 2.0315)] * 5
    for shape, dtype in (
        ((3, 40, 72), torch.float32),
        ((2, 130, 64), torch.float32),
        ((3, 64, 136), torch.bfloat16),
    ):
        x = torch.randn(*shape, generator=gen)
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        got = newton_schulz(x.to(dtype).to(device), coeffs).cpu().double()
        want = newton_schulz_reference(x.to(dtype).double(), coeffs)
        err = float((got - want).norm() / want.norm())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        if not torch.isfinite(got).all() or err > tol:
            failures.append(f"newton_schulz {shape} {dtype}: relative error {err:.2e} > {tol:g}")
    return failures


def attention_mismatches(device: str, gen: torch.Generator) -> list[str]:
    """mla_attention forward + backward on packed documents vs the float64 reference (small
    shapes, so the sanitizer run stays short): fp32 within 1e-5, bf16 within 3e-2 (relative)."""
    failures = []
    cu = torch.tensor([0, 37, 107, 108], dtype=torch.int32)
    T = int(cu[-1])
    for (Dk, Dv), dtype in (
        ((192, 128), torch.bfloat16),
        ((192, 128), torch.float32),
        ((64, 64), torch.bfloat16),
    ):
        tag = f"mla_attention Dk={Dk} Dv={Dv} {dtype}"
        q, k = (torch.randn(T, 2, Dk, generator=gen) for _ in range(2))
        v, g = (torch.randn(T, 2, Dv, generator=gen) for _ in range(2))
        leaves = [t.to(dtype).to(device).clone().requires_grad_() for t in (q, k, v)]
        out, lse, mx = ops.mla_attention(*leaves, cu.to(device), softmax_scale=0.1)
        out.backward(g.to(dtype).to(device))
        ref_leaves = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
        r_out, r_lse, r_mx = reference.mla_attention(*ref_leaves, cu, 0.1)
        r_out.backward(g.to(dtype).double())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        pairs = [("out", out, r_out), ("lse", lse, r_lse), ("max_logit", mx, r_mx)]
        pairs += [(f"d{n}", a.grad, b.grad) for n, a, b in zip("qkv", leaves, ref_leaves, strict=True)]
        for name, a, b in pairs:
            a, b = a.detach().cpu().double(), b.detach().double()
            err = float((a - b).norm() / b.norm())
            if not torch.isfinite(a).all() or err > tol:
                failures.append(f"{tag} {name}: relative error {err:.2e} > {tol:g}")
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
