"""MLA decode attention read in place (k2-kernels' `mla_decode_paged`) against the engine's former
path (gather each sequence's blocks into one padded buffer, then bmm + softmax + bmm), one run.

    .venv/bin/python benchmarks/paged_decode.py [--threads 1] [--repeats 200] [--engine-rounds 3]

Part 1, the attention alone, fp32 cache, at shapes `n sequences x H heads x L rows` (latent 512 +
rope 64, blocks of 16): mean ms per call over --repeats, the two paths interleaved. Part 2, the
engine end to end (`Engine.generate`, the `tiny-vllm` preset with random weights, 32-token random
prompts, 64 greedy tokens, eos ignored) at 1, 8 and 32 sequences, tokens/s with the paged kernel and
with the gather path, best of --engine-rounds, the two interleaved. Prints the machine; ratios are
paged / gather speed (above 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from bench_common import cpu_flags, machine

SHAPES = ((32, 4, 512), (32, 16, 256), (8, 64, 1024), (32, 4, 96))  # (n, H, L)
C, R, B = 512, 64, 16


def gather_path(q, cache, table, n, M, scale, buf):
    """The engine's former step: index_select into a buffer reused across layers, then bmm."""
    rows = torch.index_select(cache, 0, table.reshape(-1), out=buf).view(n, M * B, C + R)
    p = torch.softmax(torch.bmm(q, rows.transpose(1, 2)).mul_(scale), -1)
    return torch.bmm(p, rows[..., :C])


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def attention_row(n: int, H: int, L: int, repeats: int) -> str:
    from k2_kernels import ops

    M = L // B
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(n * M + 8, B, C + R, generator=g)
    table = torch.randperm(n * M + 8, generator=g)[: n * M].view(n, M)
    lens = torch.full((n,), L, dtype=torch.long)
    q = torch.randn(n, H, C + R, generator=g)
    buf = torch.empty(n * M, B, C + R)
    paged = timed(lambda: ops.mla_decode_paged(q, cache, table, lens, C, 0.1), repeats)
    gather = timed(lambda: gather_path(q, cache, table, n, M, 0.1, buf), repeats)
    return f"| {n} x {H} heads x {L} rows | {paged:.2f} | {gather:.2f} | {gather / paged:.2f}x |"


def engine_rows(rounds: int) -> list[str]:
    import k2_model.engine.forward as fwd
    from k2_model import K2Config, K2ForCausalLM
    from k2_model.engine import Engine, SamplingParams

    torch.manual_seed(0)
    model = K2ForCausalLM(K2Config.preset("tiny-vllm")).eval()
    kernel = fwd.paged_decode
    rng = random.Random(0)

    def run(n: int, paged: bool) -> float:
        fwd.paged_decode = kernel if paged else (lambda _device, _dtype: False)
        try:
            engine = Engine(model, max_batch_size=32, max_model_len=1024, eos_token_ids=[])
            prompts = [[rng.randrange(7900) for _ in range(32)] for _ in range(n)]
            t0 = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            return n * 64 / (time.perf_counter() - t0)
        finally:
            fwd.paged_decode = kernel

    run(4, True), run(4, False)  # warm-up
    out = []
    for n in (1, 8, 32):
        best = {True: 0.0, False: 0.0}
        for r in range(rounds):
            for paged in (True, False) if r % 2 == 0 else (False, True):
                best[paged] = max(best[paged], run(n, paged))
        out.append(f"| {n} | {best[True]:.0f} | {best[False]:.0f} | {best[True] / best[False]:.2f}x |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200, help="calls per attention measurement")
    ap.add_argument("--engine-rounds", type=int, default=3, help="interleaved engine runs per size (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine(load=True)}; flags {' '.join(cpu_flags())}; torch {torch.__version__}, "
          f"{args.threads} thread(s), fp32\n")  # fmt: skip
    print("| attention (one layer) | paged ms | gather + bmm ms | paged speed |")
    print("|---|---|---|---|")
    print("\n".join(attention_row(n, H, L, args.repeats) for n, H, L in SHAPES))
    if args.engine_rounds:
        print("\n| engine, sequences | paged tok/s | gather tok/s | ratio |")
        print("|---|---|---|---|")
        print("\n".join(engine_rows(args.engine_rounds)))


if __name__ == "__main__":
    main()
