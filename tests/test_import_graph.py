"""The import graph of the whole workspace, read from the sources (every import statement, those
inside functions and under TYPE_CHECKING included: an import moved into a function still makes a
cycle of the design): no module cycles, and each package imports only the k2 packages its
pyproject declares (ARCHITECTURE.md: one-directional packages)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILED = {"k2_kernels._C"}  # extension modules: built, not in the sources


def _source_modules() -> dict[str, tuple[Path, str]]:
    """module name -> (file, distribution directory) for every package's src/ and the root's src/."""
    out: dict[str, tuple[Path, str]] = {}
    for src in [*sorted(ROOT.glob("packages/*/src")), ROOT / "src"]:
        dist = src.parent.name if src.parent != ROOT else "k2-stack"
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = (f, dist)
    return out


MODULES = _source_modules()


def _imports(name: str, path: Path) -> set[str]:
    """The workspace modules `name` imports (the longest known prefix of each imported name)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import submodule` depends on the submodule, not pkg/__init__
                sub = f"{base}.{a.name}"
                named.add(sub if sub in MODULES or sub in COMPILED else base)
    out = set()
    for m in named - COMPILED:
        parts = m.split(".")
        while parts and ".".join(parts) not in MODULES:
            parts.pop()
        if parts and ".".join(parts) != name:
            out.add(".".join(parts))
    return out


GRAPH = {name: _imports(name, path) for name, (path, _) in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles() == []


def _declared_k2_deps(dist: str) -> set[str]:
    pp = ROOT / "pyproject.toml" if dist == "k2-stack" else ROOT / "packages" / dist / "pyproject.toml"
    deps = tomllib.loads(pp.read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].strip().lower() for d in deps}
    return {n for n in names if n.startswith("k2-")}


def test_packages_import_only_what_they_declare():
    wrong = []
    for name, (_, dist) in MODULES.items():
        for target in GRAPH[name]:
            tdist = MODULES[target][1]
            if tdist != dist and tdist not in _declared_k2_deps(dist):
                wrong.append(f"{name} ({dist}) imports {target} ({tdist}), not a declared dependency")
    assert wrong == []


def test_the_scanner_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from k2_model.model import K2ForCausalLM\n")
    assert "k2_model.model" in _imports("k2_model.checkpoint", f)


def test_k2_data_pipelines_do_not_reach_into_each_other():
    """rephrase and agentic share only k2-data's common modules (format, shards, client, embedder,
    loopback server); the common modules import neither pipeline."""
    pipelines = ("k2_data.rephrase", "k2_data.agentic")
    wrong = []
    for name, targets in GRAPH.items():
        if not name.startswith("k2_data"):
            continue
        own = next((p for p in pipelines if name == p or name.startswith(p + ".")), None)
        for t in targets:
            other = next((p for p in pipelines if t == p or t.startswith(p + ".")), None)
            if other is not None and other != own and name != "k2_data":
                wrong.append(f"{name} imports {t}")
    assert wrong == []
