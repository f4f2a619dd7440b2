"""Is a rewrite faithful to its source? Cheap exact checks, an embedding similarity, an optional LLM judge.

Per chunk, in order of cost:
- numbers: every number of the source appears in the rewrite (as digits; 0-20 also as a word), and
  with `allow_added_numbers=False` the rewrite has no number that is neither in the source nor in the
  preceding context (a new number is a new, unchecked fact). "3,5" and "3.5", "1,000" and "1000" match.
- formulas: every LaTeX span (`$..$`, `\\(..\\)`, `\\[..\\]`, environments) and plain-text equation
  (`a^2 + b^2 = c^2`) of the source appears in the rewrite, compared without whitespace.
- named entities: capitalised word sequences (a heuristic: no NER model is shipped). At least
  `min_entity_recall` of the source's survive, and the rewrite introduces none whose words occur
  nowhere in the source or its context (a hallucinated person, place or organisation).
- similarity: cosine of all-MiniLM-L6-v2 embeddings >= `min_similarity` (English only, so translation
  skips it, as it skips entities, whose spelling changes across languages).
- judge: optionally an LLM asked PASS/FAIL (see `judge.py`), run only when the cheap checks pass.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from typing import Any

NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
_NUMBER = re.compile(r"(?<![\w.,])[-−–]?\d+(?:[.,\u202f\u00a0 ]\d+)*(?:\.\d+)?(?![\w])")
_LATEX = re.compile(
    r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]|\\begin\{(\w+\*?)\}(.+?)\\end\{\5\}", re.DOTALL
)
_FUNCS = "sin|cos|tan|log|ln|exp|sqrt|max|min|lim|det|mod|gcd|lcm|sum|int|arcsin|arccos|arctan"
_OPERAND = rf"(?:(?<![\w.,])\d+(?:[.,]\d+)?|(?<![A-Za-z])(?:{_FUNCS})\b|(?<![A-Za-z])[A-Za-zα-ωΑ-Ωπ](?![A-Za-z])|[√∞])"
_OP_TOKEN = rf"(?:{_OPERAND}|[()\[\]{{}}^_²³⁴!]|[-+*/·×÷±−])"
_RELATION = r"(?:<=|>=|!=|==|[=<>≤≥≠≈])"
_EQUATION = re.compile(
    rf"{_OP_TOKEN}(?:\s*{_OP_TOKEN})*\s*{_RELATION}(?:\s*{_OP_TOKEN})+(?:\s*{_RELATION}(?:\s*{_OP_TOKEN})+)*"
)
_ENTITY = re.compile(r"[A-Z][\w'’\-]*[a-z][\w'’\-]*|[A-Z]{2,}[a-z]?s?|[A-Z]\.(?:[A-Z]\.)+")
_STOP = frozenset(
    """the a an and or but if in on at of for to from by with as is are was were be this that these those it its
    he she they we you i his her their our your there here when where while after before during since then thus
    however therefore also so such many most some each every all both one two first second finally today in
    what which who whom whose why how yes no not let consider suppose given note""".split()
)
# capitalised words that rewriting styles add without adding a fact
STYLE_WORDS = frozenset(
    """question answer q a note notes example examples definition theorem proof lemma step steps summary
    key idea ideas solution exercise remark recall lecture chapter section part overview introduction
    conclusion imagine think first second third next finally today ok okay""".split()
)


@dataclass
class FidelityConfig:
    """Thresholds; `None`/0 switches a check off. `kind` "translate" skips similarity and entities."""

    min_similarity: float = 0.7
    min_entity_recall: float = 0.9
    allow_added_numbers: bool = False
    allow_added_entities: bool = False
    check_formulas: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity must be in [0, 1], got {self.min_similarity}")
        if not 0.0 <= self.min_entity_recall <= 1.0:
            raise ValueError(f"min_entity_recall must be in [0, 1], got {self.min_entity_recall}")


@dataclass
class FidelityReport:
    """Every score and the decision for one rewrite of one chunk."""

    passed: bool = True
    reasons: list[str] = field(default_factory=list)
    similarity: float | None = None
    numbers_missing: list[str] = field(default_factory=list)
    numbers_added: list[str] = field(default_factory=list)
    formulas_missing: list[str] = field(default_factory=list)
    entities_missing: list[str] = field(default_factory=list)
    entities_added: list[str] = field(default_factory=list)
    entity_recall: float | None = None
    judge: str | None = None  # the judge's verdict line, when one ran

    def fail(self, reason: str) -> None:
        self.passed = False
        self.reasons.append(reason)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- numbers


def _interpretations(raw: str) -> set[str]:
    """Canonical values a number string may mean: "1,000" -> {"1000", "1.000"}; "3,5" -> {"3.5"}."""
    s = raw.replace("−", "-").replace("–", "-").replace("\u202f", " ").replace("\u00a0", " ")
    out = set()
    for dec, grp in ((".", ","), (",", ".")):
        t = s.replace(" ", "")
        parts = t.split(dec)
        if len(parts) > 2:
            continue
        whole = parts[0]
        groups = whole.lstrip("-").split(grp)
        if len(groups) > 1 and not all(len(g) == 3 for g in groups[1:]):
            continue
        whole = whole.replace(grp, "")
        value = whole if len(parts) == 1 else f"{whole}.{parts[1]}"
        if re.fullmatch(r"-?\d+(\.\d+)?", value):
            if "." in value:
                value = value.rstrip("0").rstrip(".") or "0"
            out.add(value.lstrip("+"))
    return out or {s}


def numbers(text: str) -> list[str]:
    """The numbers written in `text`, as written."""
    return [m.group().strip() for m in _NUMBER.finditer(text)]


def _number_values(text: str) -> set[str]:
    values: set[str] = set()
    for raw in numbers(text):
        values |= _interpretations(raw)
        values |= {v.lstrip("-") for v in _interpretations(raw)}  # "-5" written as "minus 5" / "5 below"
    low = text.lower()
    for i, w in enumerate(NUMBER_WORDS):
        if re.search(rf"\b{w}\b", low):
            values.add(str(i))
    return values


def check_numbers(source: str, rewrite: str, context: str = "") -> tuple[list[str], list[str]]:
    """(source numbers missing from the rewrite, rewrite numbers found in neither source nor context)."""
    have = _number_values(rewrite)
    missing = [raw for raw in numbers(source) if not (_interpretations(raw) | {raw.lstrip("-")}) & have]
    known = _number_values(source + "\n" + context)
    added = [raw for raw in numbers(rewrite) if not (_interpretations(raw) | {raw.lstrip("-")}) & known]
    return _dedup(missing), _dedup(added)


# ----------------------------------------------------------------------------- formulas


def formulas(text: str) -> list[str]:
    """LaTeX math spans and plain-text equations, whitespace removed."""
    out = []
    for m in _LATEX.finditer(text):
        body = next(g for g in (m.group(1), m.group(2), m.group(3), m.group(4), m.group(6)) if g is not None)
        out.append(re.sub(r"\s+", "", body))
    plain = _LATEX.sub(" ", text)
    for m in _EQUATION.finditer(plain):
        f = re.sub(r"\s+", "", m.group())
        if re.search(r"[A-Za-zα-ωπ√]", f) or re.search(
            r"[-+*/^×÷·]", f
        ):  # not "1 = 1"-free text like "p < 5"
            out.append(f)
    return _dedup(f for f in out if f)


def _flat(text: str) -> str:
    """Whitespace removed, decimal commas as points, unicode minus as "-": the form formulas compare in."""
    text = re.sub(r"\s+", "", text).replace("−", "-")
    return re.sub(r"(?<=\d),(?=\d)", ".", text)


def check_formulas(source: str, rewrite: str) -> list[str]:
    """Source formulas that do not appear, whitespace-insensitively, in the rewrite."""
    flat = _flat(rewrite)
    return [f for f in formulas(source) if _flat(f) not in flat]


# ----------------------------------------------------------------------------- entities


def entities(text: str) -> list[str]:
    """Capitalised word sequences, minus sentence-initial function words and style words."""
    out = []
    words = list(_ENTITY.finditer(text))
    i = 0
    while i < len(words):
        group = [words[i]]
        while i + 1 < len(words) and re.fullmatch(
            r"[ \t]|\s(?:of|de|von|van|der|da|del|la|le|du)\s", text[group[-1].end() : words[i + 1].start()]
        ):
            i += 1
            group.append(words[i])
        i += 1
        names = [m.group() for m in group]
        start = group[0].start()
        prefix = text[:start].rstrip(" \t\"'“‘([")
        initial = not prefix or prefix[-1] in ".!?:;\n-*•#|"
        while names and (names[0].lower() in _STOP or names[0].lower().strip(".") in STYLE_WORDS):
            names.pop(0)
            initial = False if names else initial
        if not names:
            continue
        if initial and len(names) == 1 and len(group) == 1:
            # a capitalised first word: a name only if the text also capitalises it mid-sentence
            w = names[0]
            if not re.search(rf"(?<![.!?:\n]\s)(?<!^)\b{re.escape(w)}\b", text[start + len(w) :]):
                continue
        out.append(" ".join(names))
    return _dedup(out)


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[\w'’\-]+", text)}


def check_entities(source: str, rewrite: str, context: str = "") -> tuple[list[str], list[str], float | None]:
    """(source entities missing from the rewrite, rewrite entities unknown to source and context, recall).

    An entity survives when one of its words (3+ letters, capitalised as in the source) appears in the
    rewrite: "Gustave Eiffel" is kept by "Eiffel", not by "the tower". A rewrite entity is added when none
    of its words occur, in any case, in the source or the context."""
    src = entities(source)
    have = set(re.findall(r"[\w'’\-]+", rewrite))
    missing = [e for e in src if not any(w in have for w in e.split() if len(w) >= 3 or w.isupper())]
    known = _words(source + "\n" + context)
    added = [
        e
        for e in entities(rewrite)
        if not any(w.lower() in known for w in e.split())
        and not all(w.lower() in STYLE_WORDS for w in e.split())
    ]
    recall = None if not src else 1.0 - len(missing) / len(src)
    return missing, added, recall


def _dedup(items: Any) -> list[str]:
    seen: dict[str, None] = {}
    for x in items:
        seen.setdefault(x, None)
    return list(seen)


# ----------------------------------------------------------------------------- the check


def check(
    source: str,
    rewrite: str,
    *,
    context: str = "",
    config: FidelityConfig | None = None,
    kind: str = "knowledge",
    similarity: float | None = None,
) -> FidelityReport:
    """The exact checks (and `similarity`, computed by the caller, against its threshold)."""
    cfg = config or FidelityConfig()
    r = FidelityReport(similarity=similarity)
    if not rewrite.strip():
        r.fail("empty rewrite")
        return r
    r.numbers_missing, r.numbers_added = check_numbers(source, rewrite, context)
    if r.numbers_missing:
        r.fail(f"numbers missing: {', '.join(r.numbers_missing[:5])}")
    if r.numbers_added and not cfg.allow_added_numbers:
        r.fail(f"numbers added: {', '.join(r.numbers_added[:5])}")
    if cfg.check_formulas:
        r.formulas_missing = check_formulas(source, rewrite)
        if r.formulas_missing:
            r.fail(f"formulas missing: {', '.join(r.formulas_missing[:3])}")
    if kind != "translate":
        r.entities_missing, r.entities_added, r.entity_recall = check_entities(source, rewrite, context)
        if r.entity_recall is not None and r.entity_recall < cfg.min_entity_recall:
            r.fail(f"entities missing ({r.entity_recall:.0%} kept): {', '.join(r.entities_missing[:5])}")
        if r.entities_added and not cfg.allow_added_entities:
            r.fail(f"entities added: {', '.join(r.entities_added[:5])}")
        if similarity is not None and cfg.min_similarity and similarity < cfg.min_similarity:
            r.fail(f"similarity {similarity:.3f} < {cfg.min_similarity}")
    return r


class AsyncSimilarity:
    """Batches concurrent `await sim(source, rewrite)` calls into one embedding forward in a worker
    thread, so the event loop keeps serving requests while MiniLM runs."""

    def __init__(self, embedder: Any, max_batch: int = 32, wait_s: float = 0.005):
        self.embedder, self.max_batch, self.wait_s = embedder, max_batch, wait_s
        self._pending: list[tuple[str, str, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.pairs = 0
        self.batches = 0

    async def __call__(self, source: str, rewrite: str) -> float:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((source, rewrite, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.wait_s)
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            try:
                sims = await asyncio.to_thread(
                    self.embedder.similarity, [b[0] for b in batch], [b[1] for b in batch]
                )
            except Exception as e:  # every waiter sees the failure
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            self.pairs += len(batch)
            self.batches += 1
            for (*_, fut), s in zip(batch, sims):
                if not fut.done():
                    fut.set_result(float(s))
