"""Fused MLA attention (k2_kernels.ops.mla_attention) vs its anchors: time and peak memory, in one run.

    .venv/bin/python benchmarks/attention.py [--seqs 512,1024,2048,4096] [--heads 8] [--repeats 3]
    .venv/bin/python benchmarks/attention.py --seqs 256 --heads 16 --repeats 15 --no-memory
        # short sequences: also times the backward recomputing q k^T (vs reusing kept probabilities)
    python -P benchmarks/attention.py --device cuda            # GPU rows (scripts/gpu_check.sh)

Shapes are MLA's training shapes: q/k head dim 192 (128 nope + 64 rope), v head dim 128, causal,
one document of S tokens, fp32 on CPU. Each row is one forward + backward.

CPU rows (issue 7's targets: faster than the eager reference everywhere, at least as fast as SDPA
from 2048 up, memory linear in S):
  ours     k2_kernels.ops.mla_attention: output, LSE and per-head max logit, no score matrix
  eager    k2_kernels.reference.mla_attention: materialised [H, S, S] scores (gives the max logit)
  sdpa     torch.nn.functional.scaled_dot_product_attention, best CPU path (flash), v padded to
           192 (SDPA needs one head dim), is_causal=True; no max logit
  sdpa+max the same plus the no-grad score pass the max logit otherwise needs (what k2-model's
           "sdpa" path does); informative
Time: median of --repeats after a warm-up, the implementations interleaved so that load from
other processes hits all alike. Memory: peak resident set of a fresh process running one
forward + backward, minus its resident set just before (so it counts the op's own buffers).

GPU rows (--device cuda, bf16): forward and backward TFLOP/s of ours vs the best peer available
(FlashAttention-3 if importable, else SDPA's flash/cuDNN backends with v padded to 192), and the
cost of the max-logit output (ours with vs without it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from k2_kernels import attention_ops, ops, reference
from k2_kernels import info as kernels_info

DK, DV = 192, 128
IMPLS = ("ours", "eager", "sdpa", "sdpa+max")


def make_inputs(S: int, H: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(S, H, DK, device=device, dtype=dtype, generator=g)
    k = torch.randn(S, H, DK, device=device, dtype=dtype, generator=g)
    v = torch.randn(S, H, DV, device=device, dtype=dtype, generator=g)
    dout = torch.randn(S, H, DV, device=device, dtype=dtype, generator=g)
    return q, k, v, dout


def step_fn(impl: str, q, k, v, dout) -> Callable[[], None]:
    """One forward + backward of `impl` on fresh leaf tensors (gradients are freed each call)."""
    S, H, _ = q.shape
    scale = DK**-0.5
    if impl in ("ours", "ours-recompute"):
        # ours-recompute: the backward recomputes q k^T instead of reusing the probabilities the
        # forward keeps for short sequences (attention_ops.PROBS_MAX_SEQLEN), to show what that saves
        keep_max = 0 if impl == "ours-recompute" else attention_ops.PROBS_MAX_SEQLEN

        def run() -> None:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            saved, attention_ops.PROBS_MAX_SEQLEN = attention_ops.PROBS_MAX_SEQLEN, keep_max
            try:
                out, _, _ = ops.mla_attention(qq, kk, vv, softmax_scale=scale)
            finally:
                attention_ops.PROBS_MAX_SEQLEN = saved
            out.backward(dout)

        return run
    if impl == "eager":

        def run() -> None:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out, _, _ = reference.mla_attention(qq, kk, vv, None, scale)
            out.backward(dout)

        return run
    # SDPA wants [B, H, S, D] with one head dim: v (and its gradient) padded to 192
    q4, k4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k))
    v4 = F.pad(v, (0, DK - DV)).transpose(0, 1).unsqueeze(0)
    g4 = F.pad(dout, (0, DK - DV)).transpose(0, 1).unsqueeze(0)
    with_max = impl == "sdpa+max"

    def run() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q4, k4, v4))
        if with_max:
            with torch.no_grad():  # the score pass the max logit needs without a fused kernel
                s = torch.matmul(qq, kk.transpose(-1, -2)).mul_(scale)
                s.masked_fill_(torch.ones(S, S, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
                s.amax(dim=(0, 2, 3))
                del s
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
        out.backward(g4)

    return run


def proc_status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process. Not getrusage's ru_maxrss: Linux carries that
    over fork + exec, so a child would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_peak(impl: str, S: int, H: int, threads: int) -> None:
    """(In a fresh process) print the peak RSS growth of one forward + backward, in bytes."""
    torch.set_num_threads(threads)
    q, k, v, dout = make_inputs(S, H, "cpu", torch.float32)
    fn = step_fn(impl, q, k, v, dout)
    base = proc_status_bytes("VmRSS")
    fn()
    peak = proc_status_bytes("VmHWM")
    print(json.dumps({"peak_bytes": max(0, peak - base)}))


def measure_peak(impl: str, S: int, H: int, threads: int) -> float:
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--child", impl, str(S), str(H), str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_bytes"]


def time_interleaved(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if r:  # round 0 is warm-up
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def fwd_bwd_flops(S: int, H: int) -> tuple[float, float]:
    pairs = S * (S + 1) / 2  # causal
    fwd = 2 * pairs * H * (DK + DV)  # q.k and p.v
    bwd = 2 * pairs * H * (3 * DK + 2 * DV)  # recomputed q.k, dv, dp, dk, dq
    return fwd, bwd


def cpu_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    threads = torch.get_num_threads()
    print(
        f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cpus, {threads} threads, "
        f"BLAS: {kernels_info()['blas']}, load average at start: {os.getloadavg()[0]:.1f}"
    )
    print(
        f"# heads {args.heads}, Dk {DK}, Dv {DV}, causal, one document, fp32, fwd+bwd, median of {args.repeats}"
    )
    rows = []
    for S in args.seqs:
        print(f"# measuring S={S} ...", file=sys.stderr, flush=True)  # the table comes at the end
        q, k, v, dout = make_inputs(S, args.heads, "cpu", torch.float32)
        impls = [i for i in IMPLS if not (i == "eager" and S > args.max_eager)]
        if S <= attention_ops.PROBS_MAX_SEQLEN:
            impls.append("ours-recompute")
        t = time_interleaved({i: step_fn(i, q, k, v, dout) for i in impls}, args.repeats)
        mem = {i: measure_peak(i, S, args.heads, threads) for i in impls} if not args.no_memory else {}
        fwd, bwd = fwd_bwd_flops(S, args.heads)
        rows.append((S, t, mem, (fwd + bwd) / 1e9))
    print()
    print(
        "| S | ours (s) | eager (s) | sdpa (s) | sdpa+max (s) | ours / eager | ours / sdpa | ours GFLOP/s "
        "| peak MB ours | eager | sdpa |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for S, t, mem, gflop in rows:
        cells = [f"{t[i]:.3f}" if i in t else "-" for i in IMPLS]
        mbs = [f"{mem[i] / 2**20:.0f}" if i in mem else "-" for i in ("ours", "eager", "sdpa")]
        r_eager = f"{t['ours'] / t['eager']:.2f}" if "eager" in t else "-"
        print(
            f"| {S} | {' | '.join(cells)} | {r_eager} | {t['ours'] / t['sdpa']:.2f} | {gflop / t['ours']:.0f} "
            f"| {' | '.join(mbs)} |"
        )
    for S, t, _, _ in rows:
        if "ours-recompute" in t:
            print(
                f"S={S}: ours keeps the forward's probabilities; with the backward recomputing them instead: "
                f"{t['ours-recompute']:.4f} s ({t['ours'] / t['ours-recompute']:.2f}x)"
            )
    print(
        "\nratios: lower is better (ours / anchor); targets: < 1 vs eager everywhere, <= 1 vs sdpa for S >= 2048"
    )


# ------------------------------------------------------------------------------------------ GPU
def cuda_time(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gpu_peer():
    """(name, fwd(q, k, v) -> out) of the best attention available besides ours, [T, H, D] layout."""
    try:
        from flash_attn_interface import flash_attn_func  # FlashAttention-3 (Hopper)

        def fa3(q, k, v):
            return flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=True)[0].squeeze(0)

        return "FlashAttention-3", fa3
    except ImportError:
        pass

    def sdpa(q, k, v):
        v_pad = F.pad(v, (0, DK - v.shape[-1]))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v_pad.transpose(0, 1)[None], is_causal=True
        )
        return out[0].transpose(0, 1)[..., : v.shape[-1]]

    return "SDPA (flash/cuDNN, v padded to 192)", sdpa


def gpu_main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    from k2_kernels import _lib

    C = _lib.compiled()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, k2_kernels {kernels_info()}")
    peer_name, peer = gpu_peer()
    print(f"# peer: {peer_name}; bf16, heads {args.heads}, Dk {DK}, Dv {DV}, causal, one document")
    print(
        "| S | ours fwd TFLOP/s | peer fwd TFLOP/s | ours bwd TFLOP/s | peer bwd TFLOP/s | max-logit cost (fwd) |"
    )
    print("|---|---|---|---|---|---|")
    for S in args.seqs:
        print(gpu_row(C, peer, S, args.heads, args.repeats))


def gpu_row(C, peer, S: int, H: int, repeats: int) -> str:
    from k2_kernels import _lib

    q, k, v, dout = make_inputs(S, H, "cuda", torch.bfloat16)
    fwd_flops, bwd_flops = fwd_bwd_flops(S, H)
    cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")

    def ours_fwd():
        with torch.no_grad():
            ops.mla_attention(q, k, v, cu, S)

    def peer_fwd():
        with torch.no_grad():
            peer(q, k, v)

    def ours_fb():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        ops.mla_attention(qq, kk, vv, cu, S)[0].backward(dout)

    def peer_fb():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        peer(qq, kk, vv).backward(dout)

    t_of, t_pf = cuda_time(ours_fwd, repeats * 5), cuda_time(peer_fwd, repeats * 5)
    t_ob = cuda_time(ours_fb, repeats * 5) - t_of
    t_pb = cuda_time(peer_fb, repeats * 5) - t_pf
    cost = "-"
    if getattr(C, "cuda_attention_max_logit_optional", False):
        # the raw kernel with max_logit = nullptr skips the reduction: the output's extra cost
        out = torch.empty(S, H, DV, dtype=q.dtype, device="cuda")
        lse = torch.empty(H, S, dtype=torch.float32, device="cuda")
        mx = torch.empty(H, dtype=torch.float32, device="cuda")
        dev, stream = q.device.index or 0, torch.cuda.current_stream().cuda_stream

        def raw(with_max: bool):
            C.mla_attention_fwd_cuda(
                dev, stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), _lib.DTYPE_TAG[q.dtype], cu.data_ptr(),
                S, H, 1, DK, DV, S, DK**-0.5, True, out.data_ptr(), lse.data_ptr(), mx.data_ptr() if with_max else 0,
            )  # fmt: skip

        t_with = cuda_time(lambda: raw(True), repeats * 10)
        t_without = cuda_time(lambda: raw(False), repeats * 10)
        cost = f"{(t_with / t_without - 1) * 100:+.1f}%"
    return (
        f"| {S} | {fwd_flops / t_of / 1e12:.1f} | {fwd_flops / t_pf / 1e12:.1f} | {bwd_flops / t_ob / 1e12:.1f} "
        f"| {bwd_flops / t_pb / 1e12:.1f} | {cost} |"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        impl, S, H, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        child_peak(impl, S, H, threads)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--seqs", default=None, help="comma-separated sequence lengths (CPU default 512,1024,2048,4096)"
    )
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: torch's default)")
    ap.add_argument("--max-eager", type=int, default=4096, help="skip the eager reference above this length")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    args = ap.parse_args()
    default = "512,1024,2048,4096" if args.device == "cpu" else "1024,2048,4096,8192"
    args.seqs = [int(s) for s in (args.seqs or default).split(",")]
    if args.device == "cuda":
        gpu_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
