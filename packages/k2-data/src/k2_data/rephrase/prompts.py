"""The prompt library: one instruction per `*.txt` file, chosen per document and round with a seed.

A prompt file is a style or perspective instruction, led by `# key: value` header lines; `kind` is
`knowledge` (WRAP's four styles and more perspectives), `math` (learning notes) or `translate`. The file
name is the prompt id. The shipped files live in `k2_data/rephrase/prompts/`; `load_prompts(dir)` reads a
directory of your own instead (same format), so prompts are data, not code.

The messages of one chunk request are the instruction plus fixed rules (system), then the preceding
source chunk and the preceding rewrite as context, then the passage (user), in tagged blocks that a
scripted test server can parse back (`passage_of`).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

KINDS = ("knowledge", "math", "translate")
RULES = (
    "Rules: keep every fact, number, formula and name of the passage exactly; add no fact that is not in "
    "it. The context blocks are only for continuity: rewrite only the passage. Reply with the rewritten "
    "passage alone, with no preface or comment."
)


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    instruction: str
    meta: dict[str, str] = field(default_factory=dict)


def parse_prompt(text: str, prompt_id: str, where: str = "") -> Prompt:
    """A prompt from a file's text: `# key: value` header lines, then the instruction."""
    meta: dict[str, str] = {}
    lines = text.splitlines()
    while lines and (m := re.match(r"#\s*([\w-]+)\s*:\s*(.*)$", lines[0])):
        meta[m.group(1).lower()] = m.group(2).strip()
        lines.pop(0)
    instruction = "\n".join(lines).strip()
    kind = meta.get("kind", "knowledge")
    if kind not in KINDS:
        raise ValueError(f"{where or prompt_id}: kind {kind!r}, expected one of {', '.join(KINDS)}")
    if not instruction:
        raise ValueError(f"{where or prompt_id}: no instruction after the header lines")
    return Prompt(prompt_id, kind, instruction, meta)


def load_prompts(directory: str | Path | None = None) -> dict[str, Prompt]:
    """Every `*.txt` prompt of `directory` (default: the shipped library), by id."""
    if directory is None:
        root = resources.files("k2_data.rephrase") / "prompts"
        files = sorted(
            (p.name, p.read_text(encoding="utf-8")) for p in root.iterdir() if p.name.endswith(".txt")
        )
        where = "k2_data/rephrase/prompts"
    else:
        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"prompt directory {d} does not exist")
        files = [(p.name, p.read_text(encoding="utf-8")) for p in sorted(d.glob("*.txt"))]
        where = str(d)
    prompts = {name[:-4]: parse_prompt(text, name[:-4], f"{where}/{name}") for name, text in files}
    if not prompts:
        raise ValueError(f"{where}: no *.txt prompt files")
    return prompts


def of_kind(prompts: dict[str, Prompt], kind: str) -> list[Prompt]:
    chosen = sorted((p for p in prompts.values() if p.kind == kind), key=lambda p: p.id)
    if not chosen:
        raise ValueError(f"the prompt library has no prompt of kind {kind!r} (have: {sorted(prompts)})")
    return chosen


def choose(prompts: list[Prompt], seed: int, doc_key: str, round_: int) -> Prompt:
    """The prompt for round `round_` of a document: a seeded permutation per document, so rounds of one
    document use different prompts and the choice never depends on run order or worker count."""
    digest = hashlib.sha256(f"{seed}\0{doc_key}".encode()).digest()
    order = list(prompts)
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
    return order[round_ % len(order)]


def messages(
    prompt: Prompt, passage: str, prev_source: str = "", prev_rewrite: str = ""
) -> list[dict[str, str]]:
    """The chat messages that rewrite `passage`, continuing from the preceding chunk and its rewrite."""
    parts = []
    if prev_source:
        parts.append(
            f"Preceding source text (context only, do not rewrite it):\n<context>\n{prev_source}\n</context>"
        )
        parts.append(
            "Your rewrite of that preceding text (continue seamlessly from it):\n"
            f"<previous_rewrite>\n{prev_rewrite}\n</previous_rewrite>"
        )
    parts.append(f"Passage to rewrite:\n<passage>\n{passage}\n</passage>")
    return [
        {"role": "system", "content": f"{prompt.instruction}\n\n{RULES}"},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _block(messages_: list[dict], tag: str) -> str | None:
    user = next((m["content"] for m in reversed(messages_) if m.get("role") == "user"), "")
    m = re.search(rf"<{tag}>\n(.*)\n</{tag}>", user, re.DOTALL)
    return m.group(1) if m else None


def passage_of(messages_: list[dict]) -> str | None:
    """The passage a chunk request asks to rewrite (for scripted servers and request logs)."""
    return _block(messages_, "passage")


def context_of(messages_: list[dict]) -> tuple[str | None, str | None]:
    """(preceding source, preceding rewrite) a chunk request carries, None when it is a first chunk."""
    return _block(messages_, "context"), _block(messages_, "previous_rewrite")


_EN_WORDS = frozenset(
    "the of and to in is that for it as with are be this by on from or an which we at not if then let so".split()
)


def looks_english(text: str, threshold: float = 0.08) -> bool:
    """A cheap language guess for math mode (no language-id model is shipped): English function words are
    at least `threshold` of the words, and letters are mostly Latin."""
    letters = [c for c in text if c.isalpha()]
    if letters and sum(c.isascii() for c in letters) / len(letters) < 0.7:
        return False
    words = re.findall(r"[A-Za-z]+", text.lower())
    if len(words) < 5:
        return True  # too little prose to tell (a formula-only document): rewrite, do not translate
    return sum(w in _EN_WORDS for w in words) / len(words) >= threshold
