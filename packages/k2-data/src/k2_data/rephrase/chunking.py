"""Split a document into ~256-token chunks on sentence boundaries, keeping exact character spans.

Spans cover the document end to end (every chunk's `text` is `doc[start:end]` with its surrounding
whitespace stripped), so provenance can point at the source exactly and `stitch` can put the original
separators (a space, a paragraph break) back between the rewritten chunks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# a sentence ends at . ! ? (or CJK 。！？) plus closing quotes/brackets, followed by whitespace; or at a blank line
_BOUNDARY = re.compile(r"(?<=[.!?。！？])[\"')\]»”’]*\s+|\n\s*\n\s*")
# words that end with a period without ending the sentence
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e cf al fig eq no vol pp ca approx dept univ inc ltd co".split()
)


@dataclass(frozen=True)
class Chunk:
    """`doc[start:end]`, stripped, and its token count."""

    start: int
    end: int
    text: str
    tokens: int


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans `(start, end)` covering `text` end to end (each with its trailing whitespace)."""
    spans, start = [], 0
    for m in _BOUNDARY.finditer(text):
        before = text[start : m.start()].rsplit(None, 1)[-1] if text[start : m.start()].strip() else ""
        word = before.rstrip(".").lower()
        if "\n" not in m.group() and (word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())):
            continue  # "Dr. Smith", "J. S. Bach", "e.g. this"
        if m.end() > start:
            spans.append((start, m.end()))
            start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _split_long(
    text: str, start: int, end: int, max_tokens: int, count: Callable[[str], int]
) -> list[tuple[int, int]]:
    """A sentence longer than `max_tokens` cut at whitespace into pieces of at most about `max_tokens`."""
    pieces, piece_start, used = [], start, 0
    for m in re.finditer(r"\S+\s*", text[start:end]):
        n = count(m.group())
        if used and used + n > max_tokens:
            pieces.append((piece_start, start + m.start()))
            piece_start, used = start + m.start(), 0
        used += n
    pieces.append((piece_start, end))
    return pieces


def _chunk(text: str, start: int, end: int, count: Callable[[str], int]) -> Chunk | None:
    raw = text[start:end]
    stripped = raw.strip()
    if not stripped:
        return None
    lead = len(raw) - len(raw.lstrip())
    s = start + lead
    return Chunk(s, s + len(stripped), stripped, count(stripped))


def chunk_text(text: str, max_tokens: int = 256, count: Callable[[str], int] | None = None) -> list[Chunk]:
    """Greedy chunks of whole sentences with at most `max_tokens` tokens each (a longer sentence is cut
    at whitespace). A document under `max_tokens` is one chunk. `count` defaults to whitespace words
    x 4/3, about what a BPE gives for English prose."""
    if max_tokens < 8:
        raise ValueError(f"max_tokens must be >= 8, got {max_tokens}")
    count = count or approx_tokens
    if count(text) <= max_tokens:
        one = _chunk(text, 0, len(text), count)
        return [one] if one else []
    units: list[tuple[int, int, int]] = []
    for s, e in split_sentences(text):
        n = count(text[s:e])
        if n > max_tokens:
            units.extend((a, b, count(text[a:b])) for a, b in _split_long(text, s, e, max_tokens, count))
        else:
            units.append((s, e, n))
    chunks: list[Chunk] = []
    cur_start, cur_end, used = None, 0, 0
    for s, e, n in units:
        if cur_start is not None and used + n > max_tokens:
            if (c := _chunk(text, cur_start, cur_end, count)) is not None:
                chunks.append(c)
            cur_start, used = None, 0
        if cur_start is None:
            cur_start = s
        cur_end, used = e, used + n
    if cur_start is not None and (c := _chunk(text, cur_start, cur_end, count)) is not None:
        chunks.append(c)
    return chunks


def approx_tokens(text: str) -> int:
    """Whitespace words x 4/3: a tokenizer-free estimate for English prose."""
    return (len(text.split()) * 4 + 2) // 3


def stitch(source: str, chunks: list[Chunk], rewrites: list[str]) -> str:
    """The rewritten document: each chunk's rewrite, separated as the source chunks were (a paragraph
    break stays a paragraph break, anything else becomes one space)."""
    if len(chunks) != len(rewrites):
        raise ValueError(f"stitch: {len(chunks)} chunks but {len(rewrites)} rewrites")
    out: list[str] = []
    for i, (chunk, rewrite) in enumerate(zip(chunks, rewrites)):
        if i:
            gap = source[chunks[i - 1].end : chunk.start]
            out.append("\n\n" if gap.count("\n") >= 2 else "\n" if "\n" in gap else " ")
        out.append(rewrite.strip())
    return "".join(out)
