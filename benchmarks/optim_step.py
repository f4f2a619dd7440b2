"""Muon optimizer step and Newton-Schulz throughput: k2_optim vs its anchors, in one run.

    .venv/bin/python benchmarks/optim_step.py [--repeats 7] [--skip-torch-bf16] [--cases experts,tiny,moe]
    python -P benchmarks/optim_step.py --device cuda      # GPU rows only (scripts/gpu_check.sh)

Cases (the parameter sets Muon sees):
  tiny  the Muon-routed matrices of k2_model's "tiny" K2 preset (attention projections, dense
        MLP, router, 16 stacked experts per MoE layer); torch gets each expert as a 2-D param.
  moe   one K2-shaped MoE layer scaled down: 64 experts of 256x512 plus four 512x512 attention
        matrices (torch: 68 2-D params).

Rows (ratio = ours / anchor, lower is better; the target column applies to this machine's kind):
  (1) Muon step, k2_optim.Muon with its defaults (the NS dtype the machine runs fastest: bf16 where
      bf16 GEMMs are native, fp32 elsewhere) vs torch.optim.Muon as shipped (bf16 NS, one matrix at
      a time). Target where bf16 is native: <= 0.5. On AVX2 torch's bf16 NS is emulated and loses
      by itself: informative only.
  (1a) the same Muon step vs a plain fp32 Muon (the same momentum and update, NS written plainly
      with batched fp32 torch.bmm per shape). Target where bf16 is emulated (AVX2): <= 0.85.
  (1b) k2_optim.Muon with ns_dtype=torch.float32 vs torch.optim.Muon, for comparison.
  (2) NS only, equal precision (fp32): k2_optim.newton_schulz, which runs the k2-kernels CPU
      kernel (ssyrk for X X^T and A A, polynomial fused into the products, OpenMP)
      vs a plain PyTorch batched NS (matmul, then elementwise a/b/c)          target <= 0.85
      (2a) the same with k2_optim's batched PyTorch path (backend="torch"), for comparison
      (2b) bf16 (the PyTorch path; fast only on CPUs with AVX512-BF16/AMX)
  (3) with --device cuda: bf16 NS TFLOP/s, ours (the k2-kernels CUDA kernel) vs the plain
      torch.matmul NS; (3a) k2_optim's batched PyTorch path (cuBLAS) vs the same anchor; and the
      Muon step vs torch.optim.Muon on the GPU; case k2moe adds 64 real-size K2 experts (2048x7168).
Cases: experts (16 experts of 128x256 + two 256x256: the set the CPU targets are stated on), tiny,
moe, k2moe (cuda).
Timings: best of --repeats, ours and anchor interleaved (the 2-core CI machine is shared);
with --threads 1 the clock is the process CPU time, which other jobs on the cores do not inflate.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from bench_common import cpu_flags, machine
from k2_optim import Muon, newton_schulz, resolve_ns_schedule
from k2_optim.muon import cpu_has_native_bf16, default_ns_dtype

try:
    from k2_kernels.newton_schulz_ops import kernel_serves
except ImportError:  # k2-kernels absent: k2_optim runs its PyTorch path

    def kernel_serves(device, dtype) -> bool:
        return False

# legend: B batch of matrices, M rows (Gram side), N columns


def plain_batched_ns(G_BMN: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The anchor: the textbook batched quintic NS, one op per term."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G_BMN.to(dtype)
    if X.shape[-2] > X.shape[-1]:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X


def ns_flops(shapes: list[tuple[int, int, int]], steps: int = 5) -> float:
    """Matmul FLOPs of `steps` NS iterations on [B, M, N] batches (M = min side)."""
    total = 0.0
    for B, r, c in shapes:
        M, N = min(r, c), max(r, c)
        total += B * steps * 2 * (2 * M * M * N + M * M * M)
    return total


def case_shapes(name: str) -> list[tuple[int, int, int]]:
    """[(count, out, in)]: the logical matrices of one case."""
    if name == "moe":
        return [(64, 256, 512), (4, 512, 512)]
    if name == "experts":  # 16 routed experts' 128x256 matrices + two dense 256x256 (the CPU target set)
        return [(16, 128, 256), (2, 256, 256)]
    if name == "k2moe":  # 64 of K2's 384 experts at real size (gate/up: 2048 x 7168)
        return [(64, 2048, 7168)]
    if name == "tiny":
        try:
            from k2_model import K2Config, K2ForCausalLM

            with torch.device("meta"):
                model = K2ForCausalLM(K2Config.preset("tiny"))
            from k2_optim import muonclip_param_groups

            shapes: list[tuple[int, int, int]] = []
            for g in muonclip_param_groups(model):
                if g["algorithm"] != "muon":
                    continue
                for p in g["params"]:
                    n = 1 if p.ndim == 2 else int(torch.tensor(p.shape[:-2]).prod())
                    shapes.append((n, p.shape[-2], p.shape[-1]))
            return shapes
        except ImportError:  # k2-model not installed: the tiny preset's shapes, written out
            raise SystemExit("the 'tiny' case needs k2-model installed (pip install k2-model)") from None
    raise SystemExit(f"unknown case {name!r} (expected tiny, moe or k2moe)")


# With one intra-op thread, the process CPU time is the compute time even when other jobs
# share the cores (a descheduled process accrues none); otherwise wall-clock.
CLOCK: Callable[[], float] = time.perf_counter


def timeit(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    t0 = CLOCK()
    fn()
    sync()
    return CLOCK() - t0


def interleaved(fns: list[Callable[[], object]], repeats: int, sync=lambda: None) -> list[float]:
    for f in fns:  # warm-up
        f()
    sync()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, f in enumerate(fns):
            best[i] = min(best[i], timeit(f, sync))
    return best


class PlainMuon:
    """The anchor of row (1a): Muon as one would write it plainly, per shape: torch.optim.Muon's
    momentum (EMA + nesterov) and update, NS = `plain_batched_ns` in fp32 over the stacked matrices."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.02, weight_decay: float = 0.1) -> None:
        self.params, self.lr, self.wd, self.mu = params, lr, weight_decay, 0.95
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.bufs):
            buf.lerp_(p.grad, 1 - self.mu)
            u = p.grad.lerp(buf, self.mu)
            O, I = p.shape[-2:]
            upd = plain_batched_ns(u.reshape(-1, O, I))
            if O > I:
                upd = upd.mT
            p.mul_(1 - self.lr * self.wd)
            p.add_(upd.reshape(p.shape), alpha=-self.lr * 0.2 * max(O, I) ** 0.5)


def muon_step_case(shapes, repeats: int, skip_torch: bool) -> dict[str, float | None]:
    """Step seconds: k2's default, k2 with fp32 NS, the plain fp32 Muon, torch.optim.Muon."""
    g = torch.Generator().manual_seed(0)

    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        ps = [
            torch.nn.Parameter(
                torch.randn(n, r, c, generator=gen) if n > 1 else torch.randn(r, c, generator=gen)
            )
            for n, r, c in shapes
        ]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        return ps

    ours = params()
    opt = Muon(ours, lr=0.02, weight_decay=0.1)
    opt_fp32 = Muon(params(), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    plain = PlainMuon(params())
    fns = [opt.step, opt_fp32.step, plain.step]
    ropt = None
    if not skip_torch:
        ref = [
            torch.nn.Parameter(m.detach().clone())
            for p in ours
            for m in (p.unbind(0) if p.ndim == 3 else [p])
        ]
        for p in ref:
            p.grad = torch.randn(p.shape, generator=g)
        ropt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        if cpu_has_native_bf16():
            fns.append(ropt.step)  # native bf16: as fast as ours, so timed like ours
    times = interleaved(fns, repeats)
    t_ref = times[3] if len(times) > 3 else None
    if ropt is not None and t_ref is None:
        ropt.step()  # warm-up (state allocation)
        t_ref = timeit(ropt.step)  # one timed step: emulated bf16 NS takes tens of seconds
    return {"default": times[0], "fp32": times[1], "plain": times[2], "torch": t_ref}


def ns_case(
    shapes, repeats: int, device: str, dtype: torch.dtype, backend: str = "auto"
) -> tuple[float, float]:
    """(k2_optim.newton_schulz with `backend`, the plain batched NS) seconds for all shapes."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, r, c, generator=g).to(device) for n, r, c in shapes]
    sched = resolve_ns_schedule("keller", 5)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t_ours, t_plain = interleaved(
        [
            lambda: [newton_schulz(b, sched, dtype=dtype, backend=backend) for b in batches],
            lambda: [plain_batched_ns(b, dtype=dtype) for b in batches],
        ],
        repeats,
        sync,
    )
    return t_ours, t_plain


def ns_label(device: str, dtype: torch.dtype) -> str:
    return "k2-kernels kernel" if kernel_serves(device, dtype) else "PyTorch path: no compiled kernel"


def cuda_rows(cases: list[str], repeats: int) -> list[tuple]:
    rows = []
    sync = torch.cuda.synchronize
    for case in cases:
        shapes = case_shapes(case)
        fl = ns_flops(shapes)
        t_ns, t_plain = ns_case(shapes, max(repeats, 10), "cuda", torch.bfloat16)
        rows.append(
            (
                case,
                f"(3) NS bf16 CUDA, {ns_label('cuda', torch.bfloat16)} ({fl / t_ns / 1e12:.0f} TFLOP/s)",
                f"plain bf16 NS ({fl / t_plain / 1e12:.0f} TFLOP/s)",
                t_ns,
                t_plain,
                1.0,
            )
        )
        t_ns, t_plain = ns_case(shapes, max(repeats, 10), "cuda", torch.bfloat16, backend="torch")
        rows.append(
            (
                case,
                f"(3a) NS bf16 CUDA, k2_optim PyTorch path ({fl / t_ns / 1e12:.0f} TFLOP/s)",
                f"plain bf16 NS ({fl / t_plain / 1e12:.0f} TFLOP/s)",
                t_ns,
                t_plain,
                1.0,
            )
        )
        g = torch.Generator(device="cuda").manual_seed(0)
        ours = [torch.nn.Parameter(torch.randn(n, r, c, device="cuda", generator=g)) for n, r, c in shapes]
        for p in ours:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        ref = [torch.nn.Parameter(m.detach().clone()) for p in ours for m in p.unbind(0)]
        for p in ref:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        opt = Muon(ours, lr=0.02, weight_decay=0.1)
        ropt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        t_ours, t_ref = interleaved([opt.step, ropt.step], repeats, sync)
        nmat = sum(n for n, _, _ in shapes)
        rows.append(
            (
                case,
                f"(3) Muon step CUDA, {nmat} matrices (bf16 NS)",
                "torch.optim.Muon CUDA",
                t_ours,
                t_ref,
                1.0,
            )
        )
        del ours, ref, opt, ropt
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--cases",
        default=None,
        help="comma list of experts, tiny, moe, k2moe (default: experts,tiny,moe; cuda: tiny,moe,k2moe)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: GPU rows only")
    ap.add_argument("--skip-torch-bf16", action="store_true", help="skip row (1)'s torch.optim.Muon anchor")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    global CLOCK
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible to torch")
        cases = (args.cases or "tiny,moe,k2moe").split(",")
        print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}")
        print_rows(cuda_rows(cases, args.repeats))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.get_num_threads() == 1:
        CLOCK = time.process_time
    default_dt = str(default_ns_dtype(torch.device("cpu"))).replace("torch.", "")
    print(
        f"# {machine(load=True)}; flags: {' '.join(cpu_flags()) or '-'}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, clock: {CLOCK.__name__}; native bf16: {cpu_has_native_bf16()} "
        f"-> k2_optim.Muon's default NS dtype: {default_dt}"
    )
    rows = []
    for case in (args.cases or "experts,tiny,moe").split(","):
        shapes = case_shapes(case)
        nmat = sum(n for n, _, _ in shapes)
        t = muon_step_case(shapes, args.repeats, args.skip_torch_bf16)
        native = cpu_has_native_bf16()
        rows.append(
            (
                case,
                f"(1) Muon step, {nmat} matrices, defaults ({default_dt} NS)",
                "torch.optim.Muon (bf16 NS)",
                t["default"],
                t["torch"],
                "0.5" if native else "- (bf16 emulated)",
            )
        )
        rows.append(
            (
                case,
                f"(1a) Muon step, {nmat} matrices, defaults ({default_dt} NS)",
                "plain fp32 Muon (torch.bmm NS)",
                t["default"],
                t["plain"],
                "0.85" if not native else "-",
            )
        )
        rows.append(
            (
                case,
                "(1b) Muon step, ns_dtype=float32",
                "torch.optim.Muon (bf16 NS)",
                t["fp32"],
                t["torch"],
                "-",
            )
        )
        t_ns, t_plain = ns_case(shapes, args.repeats, "cpu", torch.float32)
        rows.append(
            (
                case,
                f"(2) NS fp32, {ns_label('cpu', torch.float32)}",
                "plain batched NS fp32",
                t_ns,
                t_plain,
                "0.85",
            )
        )
        t_ns, t_plain = ns_case(shapes, args.repeats, "cpu", torch.float32, backend="torch")
        rows.append(
            (case, "(2a) NS fp32, k2_optim PyTorch path", "plain batched NS fp32", t_ns, t_plain, "-")
        )
        t_ns, t_plain = ns_case(shapes, args.repeats, "cpu", torch.bfloat16)
        rows.append((case, "(2b) NS bf16, batched", "plain batched NS bf16", t_ns, t_plain, "-"))
    print_rows(rows)


def print_rows(rows: list[tuple]) -> None:
    print("| case | measurement | ours (ms) | anchor | anchor (ms) | ratio | target |")
    print("|---|---|---|---|---|---|---|")
    for case, what, anchor, t_o, t_a, target in rows:
        ratio = f"{t_o / t_a:.3f}" if t_a else "n/a"
        anchor_s = f"{t_a * 1e3:.1f}" if t_a else "skipped"
        target = target if isinstance(target, str) else f"{target}"
        target = f"<= {target}" if target[:1].isdigit() else target
        print(f"| {case} | {what} | {t_o * 1e3:.1f} | {anchor} | {anchor_s} | {ratio} | {target} |")


if __name__ == "__main__":
    main()
