"""Incremental tool-call parsing: text deltas in, OpenAI chat-completion deltas out.

    parser = ToolCallStreamParser()
    for piece in generated_text_pieces:          # split anywhere, even inside a special token
        for delta in parser.feed(piece):
            send({"choices": [{"index": 0, "delta": delta}]})
    deltas, tools_called = parser.finish()       # flush; finish_reason "tool_calls" if tools_called

Content streams as it arrives, holding back only a tail that could be the start of
`<|tool_calls_section_begin|>`. A section is held until `<|tool_calls_section_end|>`, then validated by the
same code as `parse_tool_calls` and emitted per call: first `{index, id, type, function: {name,
arguments: ""}}`, then the arguments in the fragments they arrived in. Holding the section is what makes
the stream agree with `parse_tool_calls(whole text)` for every split, malformed sections included: a call
cannot be un-sent, and a section is only known to be well-formed at its end marker (or, if it never comes,
at `finish()`, when it degrades to content). Clients cannot run a call before its arguments are complete, so
the hold costs them nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any, NamedTuple

from k2_data.chat.markers import SECTION_BEGIN, SECTION_END
from k2_data.chat.parse import MalformedSection, ToolCall, parse_section_spans, warn_malformed

Delta = dict[str, Any]


class StreamEnd(NamedTuple):
    deltas: list[Delta]
    tools_called: bool


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may complete later)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """Feed text deltas with `feed`, end with `finish`; both return lists of OpenAI `delta` objects."""

    def __init__(self) -> None:
        self._pending = ""  # content not yet emitted (a possible partial section marker)
        self._in_section = False
        self._section = ""  # text after <|tool_calls_section_begin|>, until its end marker
        self._cuts: list[int] = []  # offsets in `_section` where a fed delta started
        self._num_calls = 0
        self._finished = False

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("ToolCallStreamParser.feed called after finish()")
        if not isinstance(text, str):
            raise TypeError(f"feed expects a str delta, got {type(text).__name__}")
        out: list[Delta] = []
        if self._in_section:
            self._add_section_text(text, out)
        else:
            self._pending += text
            self._scan_content(out)
        return out

    def finish(self) -> StreamEnd:
        """Flush what is held: pending content, or an unterminated section (as content, with a warning)."""
        if self._finished:
            raise RuntimeError("ToolCallStreamParser.finish called twice")
        self._finished = True
        out: list[Delta] = []
        if self._in_section:
            raw = SECTION_BEGIN + self._section
            warn_malformed("unterminated section: no <|tool_calls_section_end|>", raw)
            out.append({"content": raw})
        elif self._pending:
            out.append({"content": self._pending})
        self._pending, self._section = "", ""
        return StreamEnd(out, self.tools_called)

    # ------------------------------------------------------------------ internals

    def _scan_content(self, out: list[Delta]) -> None:
        begin = self._pending.find(SECTION_BEGIN)
        if begin < 0:
            keep = _held_prefix(self._pending, SECTION_BEGIN)
            emit = self._pending[: len(self._pending) - keep]
            if emit:
                out.append({"content": emit})
            self._pending = self._pending[len(self._pending) - keep :]
            return
        if begin > 0:
            out.append({"content": self._pending[:begin]})
        rest = self._pending[begin + len(SECTION_BEGIN) :]
        self._pending = ""
        self._in_section = True
        self._section, self._cuts = "", []
        self._add_section_text(rest, out)

    def _add_section_text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        search_from = max(0, len(self._section) - len(SECTION_END) + 1)
        self._cuts.append(len(self._section))
        self._section += text
        end = self._section.find(SECTION_END, search_from)
        if end < 0:
            return
        body, rest = self._section[:end], self._section[end + len(SECTION_END) :]
        self._emit_section(body, out)
        self._in_section = False
        self._section, self._cuts = "", []
        self._pending = rest
        self._scan_content(out)

    def _emit_section(self, body: str, out: list[Delta]) -> None:
        try:
            spans = parse_section_spans(body)
        except MalformedSection as e:
            raw = SECTION_BEGIN + body + SECTION_END
            warn_malformed(e, raw)
            out.append({"content": raw})
            return
        for call_id, name, a0, a1 in spans:
            index = self._num_calls
            self._num_calls += 1
            out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            # the arguments in the pieces they arrived in
            lo = bisect.bisect_right(self._cuts, a0)
            bounds = [a0, *(c for c in self._cuts[lo:] if c < a1), a1]
            for s, t in zip(bounds, bounds[1:]):
                if t > s:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": body[s:t]}}]})


def accumulate_deltas(deltas: Iterable[Delta]) -> tuple[str, list[ToolCall]]:
    """Merge streamed deltas the way OpenAI clients do: `(content, tool_calls)` in `parse_tool_calls`'s shape."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.get("content"):
            content.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            call = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                call["id"] = tc["id"]
            if tc.get("type"):
                call["type"] = tc["type"]
            fn = tc.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return "".join(content), [calls[i] for i in sorted(calls)]
