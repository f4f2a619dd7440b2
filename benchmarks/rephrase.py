"""Throughput of the pipelines' LLM client against a loopback endpoint with a fixed latency.

    python benchmarks/rephrase.py                      # 200 ms latency, concurrency 8/32/64
    python benchmarks/rephrase.py --latency-ms 200 --concurrency 32 --requests 960

The endpoint (`python -m k2_data.loopback`) runs in its own process and answers every request
after exactly `--latency-ms`, so the ideal rate at concurrency C is C / latency (160 requests/s at 32 and
200 ms). The anchor is a plain sequential loop (`HTTPChatClient`, one request at a time), measured in
the same run. Reported per row: requests/s, the share of the ideal rate, the speedup over the loop,
and the requests in flight over time (sampled every 50 ms: mean over the run and a per-time-slice strip).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time

from bench_common import cpu_name
from k2_data.agent.client import AsyncHTTPChatClient, HTTPChatClient


def request(i: int) -> dict:
    # distinct contents: nothing here could be served from a cache
    return {"model": "loopback", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8}


def start_server(latency_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "k2_data.loopback", "--latency-ms", str(latency_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise RuntimeError(f"loopback server did not start: {url!r}")
    return proc, url


def sequential(url: str, n: int) -> float:
    with HTTPChatClient(url) as client:
        client(request(-1))  # connect
        t0 = time.perf_counter()
        for i in range(n):
            client(request(i))
        return n / (time.perf_counter() - t0)


async def concurrent(url: str, n: int, concurrency: int) -> tuple[float, list[int], int]:
    async with AsyncHTTPChatClient(url, max_concurrency=concurrency, timeout_s=30) as client:
        await client(request(-1))
        samples: list[int] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                samples.append(client.stats.in_flight)
                await asyncio.sleep(0.05)

        sampler = asyncio.ensure_future(sample())
        t0 = time.perf_counter()
        await client.map([request(i) for i in range(n)])
        dt = time.perf_counter() - t0
        done.set()
        await sampler
        return n / dt, samples, client.stats.max_in_flight


def strip(samples: list[int], slots: int = 12) -> str:
    """Mean requests in flight in `slots` equal time slices of the run."""
    if not samples:
        return "-"
    k = max(1, len(samples) // slots)
    return " ".join(
        f"{sum(samples[i : i + k]) / len(samples[i : i + k]):.0f}" for i in range(0, len(samples), k)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency-ms", type=float, default=200.0)
    ap.add_argument("--concurrency", default="8,32,64", help="comma-separated")
    ap.add_argument("--requests", type=int, default=0, help="per row (default: 6 s worth at the ideal rate)")
    ap.add_argument("--sequential", type=int, default=15, help="requests in the sequential loop")
    args = ap.parse_args()
    lat = args.latency_ms / 1000
    proc, url = start_server(args.latency_ms)
    try:
        seq = sequential(url, args.sequential)
        print(
            f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
        )
        print(f"loopback endpoint with {args.latency_ms:.0f} ms latency, server in its own process\n")
        print(
            "| client | concurrency | requests | requests/s | of ideal | vs sequential | max in flight | in flight over time |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| sequential loop (anchor) | 1 | {args.sequential} | {seq:.1f} | {seq * lat:.0%} | 1.0x | 1 | 1 |"
        )
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.requests or int(6 * c / lat)
            rate, samples, peak = asyncio.run(concurrent(url, n, c))
            ideal = c / lat
            print(
                f"| AsyncHTTPChatClient | {c} | {n} | {rate:.1f} | {rate / ideal:.0%} | {rate / seq:.1f}x | {peak} "
                f"| {strip(samples)} |"
            )
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
