"""`k2 ckpt bench` at a tiny size: the report's fields, and that it verifies bitwise (no timings asserted)."""

from __future__ import annotations

import pytest
from k2_ckpt.bench import BenchConfig, run_bench

pytestmark = pytest.mark.dist


def test_bench_reports_verified_update_and_raw_broadcast():
    res = run_bench(BenchConfig(ranks=2, size_mb=6, bucket_mb=1, repeats=1), timeout_s=150)
    assert res["verified"] is True and res["mismatched"] == []
    for key in ("update_s", "update_gbps", "raw_broadcast_gbps", "ratio"):
        assert res[key] > 0, key
    assert res["ratio"] == pytest.approx(res["update_gbps"] / res["raw_broadcast_gbps"], rel=1e-9)
    assert res["num_buckets"] >= 6  # 6 MiB through 1 MiB buckets, incl. a 1.5 MiB split tensor per rank
    assert abs(res["size_mb"] - 6) < 0.01


def test_cli_parses_bench_arguments():
    cli = pytest.importorskip("k2_stack.cli")  # the `k2` command lives in the root project
    args = cli.build_parser().parse_args(["ckpt", "bench", "--ranks", "3", "--size-mb", "64", "--json"])
    assert (args.ranks, args.size_mb, args.json, args.bucket_mb) == (3, 64.0, True, 32.0)
    assert args.func.__name__ == "run_bench"
