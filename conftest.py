"""Repository-wide pytest setup.

- `cuda` tests are skipped on machines without a GPU.
- `vllm` tests (a real vLLM beside k2 serve, tests/test_vllm.py) are deselected unless `-m` names
  them: `make test-vllm` creates .venv-vllm and runs `pytest -m vllm`. The default run never
  starts vLLM (about 30 s and a 3.5 GB venv) and never depends on it.
- With K2_REQUIRE_KERNELS=1 (CI sets it), the compiled kernels must load: the session stops at
  once if `k2_kernels._C` is missing, and a test skipped because a compiled kernel is unavailable
  fails instead. Otherwise a broken kernel build would turn the kernel tests into skips and the
  ops would fall back to the reference, and CI would stay green.
- With K2_REQUIRE_TEST_DEPS=1 (CI sets it too), a test (or module) skipped by
  `pytest.importorskip` of a dependency that a package's `test` extra declares fails instead: an
  install regression must not turn tests into skips. Optional, benchmark-only imports (trl) still skip.
"""

import os
import re
from pathlib import Path

import pytest


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tests of tiny models on shared cores, where OpenMP threads
    cost far more than they gain (8x in the engine tests). Restores the count afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


REQUIRE_KERNELS = os.environ.get("K2_REQUIRE_KERNELS", "0") == "1"
KERNEL_SKIP_MARKERS = ("k2_kernels._C", "compiled k2_kernels", "compiled rms_norm kernel", "kernel not built")
REQUIRE_TEST_DEPS = os.environ.get("K2_REQUIRE_TEST_DEPS", "0") == "1"
_IMPORT_NAMES = {"scikit_learn": "sklearn"}  # distributions whose module is named otherwise


def declared_test_modules(root: Path = Path(__file__).parent) -> set[str]:
    """Top-level module names of every `test` extra in the workspace's pyprojects (and k2's own)."""
    import tomllib

    mods = {"k2_stack", "k2_kernels", "k2_model", "k2_optim", "k2_data", "k2_train", "k2_ckpt", "k2_rl"}
    for pp in [root / "pyproject.toml", *sorted(root.glob("packages/*/pyproject.toml"))]:
        extras = tomllib.loads(pp.read_text()).get("project", {}).get("optional-dependencies", {})
        for req in extras.get("test", []):
            dist = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("-", "_").replace(".", "_")
            mods.add(_IMPORT_NAMES.get(dist, dist))
    return mods


def _missing_declared_dep(reason: str) -> str | None:
    m = re.search(r"could not import '([\w.]+)'", reason)
    if m and m.group(1).split(".")[0] in _declared():
        return m.group(1)
    return None


_DECLARED: set[str] | None = None


def _declared() -> set[str]:
    global _DECLARED
    if _DECLARED is None:
        _DECLARED = declared_test_modules()
    return _DECLARED


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

    if "vllm" not in (config.option.markexpr or ""):
        vllm = [item for item in items if item.get_closest_marker("vllm")]
        if vllm:
            config.hook.pytest_deselected(items=vllm)
            items[:] = [item for item in items if not item.get_closest_marker("vllm")]
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
    if not report.skipped or "cuda" in item.keywords:
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if REQUIRE_KERNELS and any(m in reason for m in KERNEL_SKIP_MARKERS):
        report.outcome = "failed"
        report.longrepr = f"K2_REQUIRE_KERNELS=1: skipped for a missing compiled kernel ({reason})"
    elif REQUIRE_TEST_DEPS and (dep := _missing_declared_dep(reason)):
        report.outcome = "failed"
        report.longrepr = (
            f"K2_REQUIRE_TEST_DEPS=1: {dep!r} is a declared test dependency, not installed ({reason})"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module-level importorskip of a declared test dependency fails collection under CI."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_TEST_DEPS and report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if dep := _missing_declared_dep(reason):
            report.outcome = "failed"
            report.longrepr = (
                f"K2_REQUIRE_TEST_DEPS=1: {dep!r} is a declared test dependency, not installed ({reason})"
            )
