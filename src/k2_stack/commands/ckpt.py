"""`k2 ckpt ...`: the checkpoint engine (k2-ckpt).

k2 ckpt bench --ranks 2 --size-mb 256 [--bucket-mb 32] [--repeats 10] [--direct] [--copy-commit] [--json] [--out DIR]
k2 ckpt serve (--uds PATH | --port N)      # one per training rank, under torchrun
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ckpt",
        help="checkpoint engine: benchmark the weight update, serve the parameter-server API",
        description="Checkpoint engine commands (k2-ckpt): bucketed, pipelined weight sync to inference engines.",
    )
    sub = parser.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
    sub.required = True

    bench = sub.add_parser(
        "bench",
        help="update throughput vs a raw torch.distributed.broadcast of the same bytes, verified bitwise",
        description=(
            "Spawn N local gloo ranks, each holding size-mb/N MB of random named tensors and a stand-in "
            "inference engine; time full updates and, interleaved in the same run, a raw broadcast of the "
            "same bytes; verify every tensor on every engine bitwise. Prints the ratio update/raw GB/s."
        ),
    )
    bench.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    bench.add_argument(
        "--size-mb", type=float, default=256.0, help="total checkpoint size in MiB (default 256)"
    )
    bench.add_argument(
        "--bucket-mb", type=float, default=32.0, help="maximum bucket size in MiB (default 32)"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed updates, each followed by a raw broadcast (best and median reported; default 10)",
    )
    bench.add_argument(
        "--direct",
        action="store_true",
        help="receivers load each bucket at once (exact reporting) instead of staging",
    )
    bench.add_argument(
        "--copy-commit",
        action="store_true",
        help="staged commit by copy instead of swapping tensors in (ModuleAdapter(assign=False))",
    )
    bench.add_argument(
        "--agree-every",
        type=int,
        default=4,
        help="ranks vote on failures before every n-th bucket (default 4)",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--out", type=Path, default=None, help="run directory for bench.json (default runs/ckpt-bench-TIME)"
    )
    bench.set_defaults(func=run_bench)

    serve = sub.add_parser(
        "serve",
        help="serve this rank's parameter-server HTTP API (run one per rank under torchrun)",
        description=(
            "Initialise torch.distributed from the torchrun environment, create a ParameterServer and "
            "serve its FastAPI app on a Unix socket (`{rank}` in the path is replaced) or loopback TCP "
            "(port + rank) until interrupted."
        ),
    )
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--uds", help="Unix socket path, e.g. /tmp/k2ckpt-{rank}.sock")
    where.add_argument("--port", type=int, help="base TCP port on 127.0.0.1 (rank r listens on port + r)")
    serve.add_argument("--bucket-mb", type=float, default=256.0, help="maximum bucket size in MiB")
    serve.add_argument("--timeout-s", type=float, default=60.0, help="receiver timeout per step")
    serve.set_defaults(func=run_serve)


def run_bench(args: argparse.Namespace) -> int:
    from k2_ckpt.bench import BenchConfig
    from k2_ckpt.bench import run_bench as bench

    if args.ranks < 2:
        print("k2 ckpt bench: --ranks must be at least 2 (a broadcast needs a receiver)", file=sys.stderr)
        return 2
    if args.size_mb <= 0 or args.bucket_mb <= 0:
        print("k2 ckpt bench: --size-mb and --bucket-mb must be positive", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        ranks=args.ranks,
        size_mb=args.size_mb,
        bucket_mb=args.bucket_mb,
        repeats=args.repeats,
        staged=not args.direct,
        assign=not args.copy_commit,
        agree_every=args.agree_every,
    )
    out_dir = args.out or Path("runs") / f"ckpt-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    mode = (
        "direct" if args.direct else ("staged, copy commit" if args.copy_commit else "staged, assign commit")
    )
    if not args.json:
        print(
            f"k2 ckpt bench: {cfg.ranks} gloo ranks, {cfg.size_mb:g} MiB, buckets <= {cfg.bucket_mb:g} MiB, "
            f"{cfg.repeats} repeats, receivers {mode}",
            file=sys.stderr,
        )
    if args.json:
        res = bench(cfg)
    else:
        from rich.console import Console

        with Console(stderr=True).status("spawning ranks, updating, broadcasting, verifying..."):
            res = bench(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench.json.tmp"
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, out_dir / "bench.json")
    if args.json:
        print(json.dumps(res))
    else:
        _print_table(res)
        print(f"results: {out_dir / 'bench.json'}", file=sys.stderr)
    return 0 if res["verified"] else 1


def _print_table(res: dict) -> None:
    """One row per measure (a wide table's headers get cut to "bucke..." on an 80-column terminal)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="k2 ckpt bench (same run)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for name, value in (
        ("ranks", str(res["ranks"])),
        ("MiB", f"{res['size_mb']:.0f}"),
        ("buckets", str(res["num_buckets"])),
        ("update s", f"{res['update_s']:.3f}"),
        ("update GB/s", f"{res['update_gbps']:.2f}"),
        ("raw broadcast GB/s", f"{res['raw_broadcast_gbps']:.2f}"),
        ("ratio (best)", f"{res['ratio']:.2f}"),
        ("ratio (median)", f"{res['median_ratio']:.2f}"),
        ("verified", "yes" if res["verified"] else "NO"),
    ):
        t.add_row(name, value)
    Console().print(t)


def run_serve(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from k2_ckpt.api import BackgroundServer, make_server_app
    from k2_ckpt.server import ParameterServer, ServerConfig

    if "RANK" not in os.environ:
        print("k2 ckpt serve: run under torchrun (RANK/WORLD_SIZE/MASTER_ADDR are not set)", file=sys.stderr)
        return 2
    dist.init_process_group("gloo" if not _cuda() else "nccl")
    rank = dist.get_rank()
    ps = ParameterServer(
        config=ServerConfig(max_bucket_bytes=int(args.bucket_mb * 2**20), timeout_s=args.timeout_s)
    )
    if args.uds:
        uds = args.uds.replace("{rank}", str(rank))
        srv = BackgroundServer(make_server_app(ps), uds=uds).start()
        where = f"unix:{uds}"
    else:
        srv = BackgroundServer(make_server_app(ps), port=args.port + rank).start()
        where = f"http://127.0.0.1:{args.port + rank}"
    print(f"k2 ckpt serve: rank {rank}/{ps.world_size} on {where} (Ctrl-C to stop)", file=sys.stderr)
    try:
        while srv.thread.is_alive():
            srv.thread.join(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        ps.close()
        dist.destroy_process_group()
        gc.collect()  # the group's gloo threads joined now, not in static destructors (docs/training.md)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
