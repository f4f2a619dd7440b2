"""k2-ckpt weight update of a K2-shaped model, against its anchors measured in the same run.

    .venv/bin/python benchmarks/ckpt_update.py --device cpu [--params 2e7] [--ranks 2] [--json]
    python -P benchmarks/ckpt_update.py --device cuda [--params 1e9] [--json]   # scripts/gpu_check.sh

Each rank registers its share of a K2/DeepSeek-V3-shaped bf16 model (MLA attention, MoE
layers of 32 experts plus a shared expert, about 2.5k tensors at 1B parameters; layers
round-robin over ranks) and a stand-in inference engine on the same device receives every
update (CUDA: a spawned process, buffers by CUDA IPC, staged then swapped in). Reported:

  update     best-of-repeats time of a full update and its GB/s (model bytes / time); on
             --device cuda with the default --params 1e9 this is the time to update a
             1B-parameter bf16 model;
  anchor 1   a raw torch.distributed.broadcast of the same bytes (NCCL on CUDA, gloo on CPU),
             interleaved with the updates: ratio = update GB/s / broadcast GB/s. With one rank
             the broadcast has no peer and costs only its launch, so the ratio is not the
             2+ GPU target (overlap of broadcast k+1 with loading k needs 2+ GPUs);
  anchor 2   (CUDA) a pinned host -> device copy_ of the rank's bytes, whole and in bucket-sized
             chunks: the pipeline's own H2D GB/s (CUDA events around its copies) is compared
             with it (h2d_ratio), and so is the whole update (update_vs_pinned_copy).

Every tensor is verified bitwise on every engine (BLAKE2b of its bytes). Exit status 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _table(r: dict) -> str:
    rows = [
        (
            "| device | ranks | params | GB | tensors | buckets | update s | update GB/s | raw bcast GB/s | ratio "
            "| H2D pipeline GB/s | pinned copy_ GB/s | H2D ratio | update / pinned copy | verified |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        (
            f"| {r['device_name']} | {r['ranks']} | {r['params'] / 1e6:.0f}M | {r['model_gb']:.2f} | {r['tensors']} "
            f"| {r['num_buckets']} | {r['update_s']:.3f} | {r['update_gbps']:.2f} | {r['raw_broadcast_gbps']:.2f} "
            f"| {r['ratio']:.2f} | {_fmt(r['h2d_pipeline_gbps'])} | {_fmt(r['pinned_copy_gbps'])} "
            f"| {_fmt(r['h2d_ratio'])} | {_fmt(r['update_vs_pinned_copy'])} | {'yes' if r['verified'] else 'NO'} |"
        ),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--params", type=float, default=None, help="model parameters (default: 1e9 on cuda, 2e7 on cpu)"
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks, one device each (default: 1 on cuda, the lent machine has one GPU; 2 on cpu)",
    )
    ap.add_argument(
        "--bucket-mb", type=float, default=None, help="maximum bucket MiB (default: 256 cuda, 8 cpu)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed updates (best reported; default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)

    from k2_ckpt.bench import ModelBenchConfig, run_model_bench

    cuda = args.device == "cuda"
    cfg = ModelBenchConfig(
        device=args.device,
        ranks=args.ranks or (1 if cuda else 2),
        params=args.params or (1e9 if cuda else 2e7),
        bucket_mb=args.bucket_mb or (256.0 if cuda else 8.0),
        repeats=args.repeats,
    )
    if cfg.ranks < 1 or cfg.params <= 0 or cfg.bucket_mb <= 0 or cfg.repeats < 1:
        ap.error("--ranks, --params, --bucket-mb and --repeats must be positive")
    res = run_model_bench(cfg, timeout_s=args.timeout_s)
    res["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"k2-ckpt update, {cfg.ranks} rank(s) on {args.device}, {res['params'] / 1e6:.0f}M params "
            f"({res['model_gb']:.2f} GB), best of {cfg.repeats}; register {res['register_s']:.2f}s, "
            f"verify {res['verify_s']:.2f}s"
        )
        print(_table(res))
        for note in res["notes"]:
            print(f"note: {note}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
