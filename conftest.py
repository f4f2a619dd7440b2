"""Repository-wide pytest setup.

- `cuda` tests are skipped on machines without a GPU.
- With K2_REQUIRE_KERNELS=1 (CI sets it), the compiled kernels must load: the session stops at
  once if `k2_kernels._C` is missing, and a test skipped because a compiled kernel is unavailable
  fails instead. Otherwise a broken kernel build would turn the kernel tests into skips and the
  ops would fall back to the reference, and CI would stay green.
"""

import os

import pytest

REQUIRE_KERNELS = os.environ.get("K2_REQUIRE_KERNELS", "0") == "1"
KERNEL_SKIP_MARKERS = ("k2_kernels._C", "compiled k2_kernels", "compiled rms_norm kernel", "kernel not built")


def pytest_sessionstart(session):
    if not REQUIRE_KERNELS:
        return
    from k2_kernels import _lib

    if not _lib.has_cpu():
        pytest.exit(
            f"K2_REQUIRE_KERNELS=1 but k2_kernels._C did not load: {_lib.info().get('load_error')}",
            returncode=3,
        )


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torchrun():
    """`torchrun(*k2_args, nproc=2, env=None)`: `k2 K2_ARGS --json` under `torch.distributed.run
    --standalone` (one OpenMP thread per process, `env` added to the environment); returns the
    CompletedProcess (stdout, stderr as text) for the test to check."""
    import subprocess
    import sys

    def run(*k2_args: str, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
             "-m", "k2_stack", *k2_args, "--json"],
            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
            timeout=600,
        )  # fmt: skip

    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_KERNELS and report.skipped and "cuda" not in item.keywords:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(m in reason for m in KERNEL_SKIP_MARKERS):
            report.outcome = "failed"
            report.longrepr = f"K2_REQUIRE_KERNELS=1: skipped for a missing compiled kernel ({reason})"
