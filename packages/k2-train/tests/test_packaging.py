"""k2-train installs and imports without the server stack or the checkpoint engine, and nothing
below it in the package graph imports it (no cycles: k2-rl and k2-stack sit above)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]


def _deps(name: str) -> list[str]:
    meta = tomllib.loads((PACKAGES / name / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].strip().lower() for d in meta["dependencies"]]


def _closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        pkg = todo.pop()
        for dep in _deps(pkg) if (PACKAGES / pkg).is_dir() else []:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_declared_dependencies_exclude_the_server_stack():
    closure = _closure("k2-train")
    assert {"k2-model", "k2-optim", "k2-data", "k2-kernels", "torch"} <= closure
    assert not closure & {"k2-ckpt", "k2-rl", "k2-stack", "fastapi", "uvicorn", "pyzmq", "llguidance"}, (
        closure
    )


def test_lower_packages_do_not_depend_on_k2_train():
    for lower in ("k2-kernels", "k2-model", "k2-optim", "k2-data", "k2-ckpt"):
        assert "k2-train" not in _closure(lower), lower


def test_import_pulls_in_no_server_or_cli_module():
    code = (
        "import sys, k2_train, k2_train.run, k2_train.export\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('k2_ckpt', 'k2_stack', 'k2_rl', 'fastapi', 'uvicorn', 'zmq', 'rich'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", out
