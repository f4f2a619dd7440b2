"""Every relative link in the repository's Markdown resolves: the file exists, and an anchor
into a Markdown file names one of its headings (GitHub's slug rule)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", "node_modules", "gpu-check-out"}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def markdown_files(root: Path = ROOT) -> list[Path]:
    out = []
    for path in root.rglob("*.md"):
        parts = path.relative_to(root).parts
        if any(p in SKIP_DIRS or (p.startswith(".") and p != ".") for p in parts[:-1]):
            continue
        out.append(path)
    return sorted(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return LINK.findall(text)


def broken_links(root: Path = ROOT) -> list[str]:
    bad = []
    for md in markdown_files(root):
        for target in links(md):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md
            where = f"{md.relative_to(root)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading '#{anchor}' in {dest.name})")
    return bad


def test_slug_follows_github():
    assert slug("Fused attention with the max logit") == "fused-attention-with-the-max-logit"
    assert slug("A K2-shaped model, CPU and GPU: `benchmarks/ckpt_update.py`") == (
        "a-k2-shaped-model-cpu-and-gpu-benchmarksckpt_updatepy"
    )


def test_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Part one\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#part-one) [web](https://example.com)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#part-two)\n"
        "```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#part-two (no heading '#part-two' in a.md)",
    ]


def test_every_relative_link_resolves():
    assert markdown_files(), "no Markdown files found"
    assert broken_links() == []
