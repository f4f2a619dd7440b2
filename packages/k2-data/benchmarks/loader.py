"""Loader cost per step vs the tiny K2 model's training step, on the default corpus.

Measures, in one run: the time `StatefulLoader.__next__` takes per batch (0 and 1 prefetch
workers) and one forward+backward+SGD step of `K2ForCausalLM(K2Config.preset("tiny"))` (fp32,
CPU) on those batches. Target: loader time under 5% of the step time.

  .venv/bin/python packages/k2-data/benchmarks/loader.py [--batch 8] [--seq-len 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--data", help="a tokenized dir (default: tokenize the stdlib corpus into a temp dir)"
    )
    args = parser.parse_args()

    import torch
    from k2_data import PackedDataset, StatefulLoader, TokenizeConfig, tokenize_corpus

    data = args.data
    if data is None:
        data = tempfile.mkdtemp(prefix="k2-loaderbench-")
        tokenize_corpus(None, data, config=TokenizeConfig(workers=2))
    ds = PackedDataset(data, seq_len=args.seq_len, seed=0, document_mask=True, val_fraction=0.01)

    rows = []
    for workers in (0, 1):
        loader = StatefulLoader(ds, batch_size=args.batch, num_workers=workers)
        next(loader)  # warm the epoch permutation
        loader.wait_s, loader.batches = 0.0, 0
        for _ in range(200):
            next(loader)
            if workers:
                time.sleep(0.002)  # give the prefetch thread the gaps a training step would
        rows.append((f"loader, {workers} workers", loader.stats()["wait_ms_per_batch"]))
        loader.close()

    step_ms = float("nan")
    try:
        from k2_model import K2Config, K2ForCausalLM
    except ImportError:
        print("k2-model not installed: loader numbers only")
    else:
        torch.manual_seed(0)
        model = K2ForCausalLM(K2Config.preset("tiny")).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = StatefulLoader(ds, batch_size=args.batch, num_workers=1)
        times = []
        for i in range(args.steps + 1):
            batch = next(loader)
            t0 = time.perf_counter()
            # the loader's labels are already the next tokens: plain cross-entropy, no shift
            logits = model(input_ids=batch["input_ids"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), batch["shift_labels"].flatten()
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:  # the first step includes one-time setup
                times.append(time.perf_counter() - t0)
        loader.close()
        step_ms = 1000 * sorted(times)[len(times) // 2]
        rows.append(("tiny K2 train step (median, fp32 CPU)", step_ms))

    print(
        f"batch {args.batch} x seq_len {args.seq_len}, document_mask on, torch threads {torch.get_num_threads()}"
    )
    print("| what | ms per step | share of the model step |\n|---|---|---|")
    for name, ms in rows:
        share = ms / step_ms if step_ms == step_ms else float("nan")
        print(f"| {name} | {ms:.2f} | {share:.3%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
