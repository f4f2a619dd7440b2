"""Milliseconds per decode step of k2_model.engine alone (no server), at 1 / 8 / 32 sequences.

    .venv/bin/python benchmarks/engine_step.py [--batches 1 8 32] [--dtypes float32 bfloat16]
        [--prompt-tokens 32] [--new-tokens 64] [--repeats 5] [--threads 1]

The `tiny-vllm` preset (the model `benchmarks/serve_vs_vllm.py` serves) with random weights (seed 0)
in each dtype; per batch size, that many prompts of --prompt-tokens random ids, greedy, eos ignored.
The prefill steps are run untimed; the timed part is the decode steps that follow, until every
sequence has its --new-tokens. A step's time is their wall time / their count; min and median over
--repeats (a fresh engine each time, sizes interleaved so machine load hits all alike). This is the
per-step table of docs/serving.md: it isolates the engine's changes from HTTP and detokenisation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import cpu_flags, machine
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, SamplingParams


def decode_ms_per_step(model: K2ForCausalLM, prompts: list[list[int]], new_tokens: int) -> float:
    engine = Engine(model, max_batch_size=len(prompts))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    produced = 0
    while produced < len(prompts):  # prefill: every sequence has its first token
        produced += sum(1 for out in engine.step() if out.token_ids)
    steps, t = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - t) / max(steps, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on shared cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = K2Config.preset("tiny-vllm")

    def build(dtype: str) -> K2ForCausalLM:  # the same weights per dtype (Module.to works in place)
        torch.manual_seed(0)
        return K2ForCausalLM(cfg).eval().to(getattr(torch, dtype))

    models = {d: build(d) for d in args.dtypes}
    g = torch.Generator().manual_seed(1)
    prompts = {
        b: [torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist() for _ in range(b)]
        for b in args.batches
    }
    times: dict[tuple[str, int], list[float]] = {(d, b): [] for d in models for b in args.batches}
    with torch.no_grad():
        for m in models.values():  # warm-up: first-call costs (oneDNN packing, allocations)
            decode_ms_per_step(m, prompts[args.batches[0]], 4)
        for _ in range(args.repeats):
            for d, m in models.items():
                for b in args.batches:
                    times[(d, b)].append(decode_ms_per_step(m, prompts[b], args.new_tokens))

    print(
        f"# engine decode step: tiny-vllm ({next(iter(models.values())).num_parameters() / 1e6:.1f}M params), random weights"
    )
    print(f"# {machine(load=True)}; flags {' '.join(cpu_flags()) or '-'}; torch {torch.__version__}")
    print(
        f"# {args.prompt_tokens}-token prompts, {args.new_tokens} greedy tokens, threads {args.threads}, "
        f"repeats {args.repeats}"
    )
    print()
    print("| dtype | sequences | ms/step min | ms/step median | tok/s (median) |")
    print("|---|---|---|---|---|")
    for (d, b), ts in times.items():
        med = statistics.median(ts)
        print(f"| {d} | {b} | {min(ts):.2f} | {med:.2f} | {b / med * 1e3:.0f} |")


if __name__ == "__main__":
    main()
