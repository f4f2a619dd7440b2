"""K2_REQUIRE_KERNELS=1 (set by .ci/run) turns a skip for a missing compiled kernel into a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import pytest

@pytest.mark.skipif(True, reason="compiled k2_kernels._C not available")
def test_kernel():
    pass

@pytest.mark.skipif(True, reason="needs transformers")
def test_other_skip():
    pass
"""


def _run(tmp_path: Path, require: str) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")  # the repository's hooks, as they are
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = dict(os.environ, K2_REQUIRE_KERNELS=require)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def test_kernel_skips_fail_when_kernels_are_required(tmp_path):
    required = _run(tmp_path, "1")
    assert required.returncode == 1, required.stdout[-2000:]
    assert "1 skipped, 1 error" in required.stdout  # the skip happens at setup: it becomes an error
    assert "K2_REQUIRE_KERNELS=1: skipped for a missing compiled kernel" in required.stdout
    relaxed = _run(tmp_path, "0")
    assert relaxed.returncode == 0 and "2 skipped" in relaxed.stdout
