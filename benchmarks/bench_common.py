"""Helpers the benchmark scripts share: the machine they ran on, and k2 commands in a subprocess.

Imported as `from bench_common import ...`: `python benchmarks/x.py` puts this directory first on
sys.path.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


# The flags that decide a CPU's dtypes and kernels (bf16 GEMMs native with AVX512-BF16 or AMX).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (empty where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return []
    return [f for f in CPU_FLAGS if f in flags]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine(load: bool = False) -> str:
    """ "<CPU>, N cores" (with the 1-minute load average: other work on the machine shows there)."""
    text = f"{cpu_name()}, {usable_cores()} cores"
    if load and hasattr(os, "getloadavg"):
        text += f", load average {os.getloadavg()[0]:.1f}"
    return text


def run_k2(*args: str) -> str:
    """`k2 ARGS...` in a subprocess; its stdout. Raises with the output's tail when it fails."""
    proc = subprocess.run([sys.executable, "-m", "k2_stack", *args], text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"k2 {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout
