"""Tokenization throughput: `k2 data tokenize` (k2_data.tokenize_corpus) vs HF `datasets.map`.

Same input (the default corpus, this interpreter's stdlib source, written once as one JSONL file),
same tokenizer (k2-data's bundled BPE), end to end from the JSONL to tokenized Arrow on disk,
measured in one run; every method must produce the same number of tokens. Anchors:

  hf-recipe    datasets.load_dataset("json") + .map(batched) calling the transformers fast
               tokenizer loaded from the same files (tok(batch["text"])), the usual HF recipe
  hf-same-fn   the same, but .map calls k2's own encode_batch (isolates the pipeline overhead)
  hf-same-fn-N as hf-same-fn with num_proc=N
  hf-same-engine datasets.map calling the tiktoken engine k2 uses (isolates the engine's share)

Needs the `bench` extra (`pip install datasets transformers`). Run:
  .venv/bin/python benchmarks/tokenize_throughput.py [--workers 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children: robust to other load on the machine."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _measure(methods: dict, repeat: int) -> dict[str, tuple[float, float, int]]:
    """Best wall and CPU seconds per method; repeats interleave the methods so that a burst of
    load from other processes does not land on one method only."""
    best: dict[str, list] = {name: [float("inf"), float("inf"), -1] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            w0, c0 = time.perf_counter(), _cpu_s()
            n = fn()
            wall, cpu = time.perf_counter() - w0, _cpu_s() - c0
            b = best[name]
            if b[2] not in (-1, n):
                raise AssertionError(f"{name}: token count changed between repeats: {b[2]} vs {n}")
            b[0], b[1], b[2] = min(b[0], wall), min(b[1], cpu), n
    return {k: tuple(v) for k, v in best.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    import datasets
    import pyarrow.compute as pc
    import transformers
    from k2_data import TokenizeConfig, default_corpus_files, load_tokenizer, tokenize_corpus

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="k2-tokbench-"))
    try:
        files = default_corpus_files()
        jsonl = work / "corpus.jsonl"
        with open(jsonl, "w", encoding="utf-8") as f:
            for p in files:
                f.write(json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n")
        mb = jsonl.stat().st_size / 2**20
        tok = load_tokenizer()
        tok.save(work / "tok")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(work / "tok"))
        counter = iter(range(10**6))

        def ours() -> int:
            out = work / f"ours{next(counter)}"
            m = tokenize_corpus(
                [jsonl], out, config=TokenizeConfig(workers=args.workers, shard_bytes=2 << 20)
            )
            return m["num_tokens"]

        def hf(fn, num_proc=None) -> int:
            cache = work / f"hf{next(counter)}"
            ds = datasets.load_dataset("json", data_files=str(jsonl), cache_dir=str(cache))["train"]
            ds = ds.map(fn, batched=True, remove_columns=["text"], num_proc=num_proc)
            # count from the Arrow column (no extra pass through Python for the anchor)
            return int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py())

        def recipe(b):
            return {"input_ids": hf_tok(b["text"], add_special_tokens=False)["input_ids"]}

        def same_fn(b):
            return {"input_ids": tok.encode_batch(b["text"])}

        def same_engine(b):
            return {"input_ids": tok.encode_batch_fast(b["text"])}

        methods = {
            "k2 data tokenize": ours,
            "hf-recipe (datasets.map + transformers tokenizer)": lambda: hf(recipe),
            "hf-same-fn (datasets.map + k2 encode_batch)": lambda: hf(same_fn),
            f"hf-same-fn-{args.workers} (num_proc={args.workers})": lambda: hf(same_fn, args.workers),
            "hf-same-engine (datasets.map + k2's tiktoken engine)": lambda: hf(same_engine),
        }
        results = _measure(methods, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    tokens = {r[2] for r in results.values()}
    if len(tokens) != 1:
        raise AssertionError(f"methods disagree on the token count: {results}")
    ours_wall, ours_cpu, n_tokens = results["k2 data tokenize"]
    print(
        f"input: {len(files)} stdlib files, {mb:.1f} MiB JSONL, {n_tokens:,} tokens; "
        f"workers={args.workers}, best of {args.repeat} (interleaved); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f}"
    )
    print("| method | wall s | tokens/s | k2 speed-up (wall) | CPU s | k2 speed-up (CPU) |")
    print("|---|---|---|---|---|---|")
    for name, (wall, cpu, n) in results.items():
        print(
            f"| {name} | {wall:.2f} | {n / wall:,.0f} | {wall / ours_wall:.2f}x | {cpu:.2f} | {cpu / ours_cpu:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
