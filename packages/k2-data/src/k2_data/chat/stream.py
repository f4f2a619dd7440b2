"""Incremental tool-call parsing: text deltas in, OpenAI chat-completion deltas out.

    parser = ToolCallStreamParser(tools=tools)   # or (strict=True), or (eager=True)
    for piece in generated_text_pieces:          # split anywhere, even inside a special token
        for delta in parser.feed(piece):
            send({"choices": [{"index": 0, "delta": delta}]})
    end = parser.finish()                        # flush; finish_reason "tool_calls" if end.tools_called

Content streams as it arrives, holding back only a tail that could be the start of
`<|tool_calls_section_begin|>`. Each call is emitted as OpenAI does: first `{index, id, type, function:
{name, arguments: ""}}`, then `function.arguments` fragments.

Default (held) mode: a section is held until `<|tool_calls_section_end|>`, parsed by the same code as
`parse_tool_calls(text, tools, strict)`, then emitted, the arguments in the fragments they arrived in. This
is what makes the stream agree with `parse_tool_calls(whole text, tools, strict)` for every split, malformed
sections included: a call cannot be un-sent, and a section is only known to be well-formed at its end
marker (or, if it never comes, at `finish()`: its complete calls by default, raw content with
`strict=True`). By default no tool-call marker is ever sent as content (a stray one is dropped; content
holds back a tail that could start any marker). Clients cannot run a call before its arguments are complete.

Eager mode (`eager=True`, what vLLM does; always strict; a bare-counter header resolves only when `tools`
holds one function, since the arguments that would tell are not there yet): a call is announced as soon as its `<|tool_call_argument_begin|>`
arrives and its arguments stream as they arrive. On well-formed output the merged stream is the same as
in held mode. When a section turns out malformed after calls were announced, the section's raw text still
goes out as content (so the content agrees with `parse_tool_calls`), those calls are listed in
`StreamEnd.malformed_calls` (a server should drop them and not report `tool_calls`), and they do not count
towards `tools_called`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any, NamedTuple

from k2_data.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END
from k2_data.chat.parse import (
    TOOL_MARKERS,
    MalformedSection,
    ToolCall,
    check_arguments,
    lenient_section_spans,
    logger,
    parse_header,
    parse_section_spans,
    strip_markers,
    warn_malformed,
)

Delta = dict[str, Any]

_IN_SECTION = (CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END)
_LONGEST = max(map(len, _IN_SECTION))


class StreamEnd(NamedTuple):
    deltas: list[Delta]
    tools_called: bool  # some well-formed call was emitted: finish_reason "tool_calls"
    malformed_calls: tuple[int, ...] = ()  # eager mode: indices announced in sections that proved malformed


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may complete later)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _first_marker(text: str, start: int) -> tuple[int, str | None]:
    """The earliest in-section marker at or after `start`: (position, marker), or (-1, None)."""
    best, found = -1, None
    for m in _IN_SECTION:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, m
    return best, found


def _call_delta(index: int, call_id: str, name: str) -> Delta:
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        ]
    }


def _args_delta(index: int, fragment: str) -> Delta:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class ToolCallStreamParser:
    """Feed text deltas with `feed`, end with `finish`; both return lists of OpenAI `delta` objects."""

    def __init__(self, eager: bool = False, tools: Any = None, strict: bool | None = None) -> None:
        if strict is None:
            strict = eager
        if eager and not strict:
            raise ValueError("eager mode is strict (calls are announced before their section is known good)")
        self.eager = eager
        self.strict = strict
        self.tools = tools
        self._pending = ""  # content not yet emitted (a possible partial section marker)
        self._in_section = False
        self._section = ""  # text after <|tool_calls_section_begin|>, until its end marker
        self._cuts: list[int] = []  # held mode: offsets in `_section` where a fed delta started
        self._num_calls = 0  # indices handed out
        self._num_good = 0  # calls in sections that proved well-formed
        self._malformed: list[int] = []
        self._finished = False
        self._reset_eager()

    @property
    def tools_called(self) -> bool:
        return self._num_good > 0

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
        if self._in_section and not self.strict:
            logger.warning("unterminated tool-call section: its complete calls are kept, the rest dropped")
            self._emit_spans(self._section, lenient_section_spans(self._section, self.tools, False), out)
        elif self._in_section:
            raw = SECTION_BEGIN + self._section
            warn_malformed("unterminated section: no <|tool_calls_section_end|>", raw)
            self._malformed += self._section_calls
            out.append({"content": raw})
        elif self._pending:
            self._content(self._pending, out)
        self._pending, self._section = "", ""
        return StreamEnd(out, self.tools_called, tuple(self._malformed))

    # ------------------------------------------------------------------ content

    def _content(self, text: str, out: list[Delta]) -> None:
        if not self.strict:
            text = strip_markers(text)
        if text:
            out.append({"content": text})

    def _scan_content(self, out: list[Delta]) -> None:
        begin = self._pending.find(SECTION_BEGIN)
        if begin < 0:
            markers = (SECTION_BEGIN,) if self.strict else TOOL_MARKERS
            keep = max(_held_prefix(self._pending, m) for m in markers)
            self._content(self._pending[: len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep :]
            return
        if begin > 0:
            self._content(self._pending[:begin], out)
        rest = self._pending[begin + len(SECTION_BEGIN) :]
        self._pending = ""
        self._in_section = True
        self._section, self._cuts = "", []
        self._reset_eager()
        self._add_section_text(rest, out)

    def _close_section(self, end: int, out: list[Delta]) -> None:
        """The section ended at `_section[end]` (its end marker); continue with the text after it."""
        rest = self._section[end + len(SECTION_END) :]
        self._in_section = False
        self._section, self._cuts = "", []
        self._pending = rest
        self._scan_content(out)

    def _add_section_text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self.eager:
            self._section += text
            self._eager_step(out)
            return
        search_from = max(0, len(self._section) - len(SECTION_END) + 1)
        self._cuts.append(len(self._section))
        self._section += text
        end = self._section.find(SECTION_END, search_from)
        if end >= 0:
            self._emit_held_section(self._section[:end], out)
            self._close_section(end, out)

    # ------------------------------------------------------------------ held mode

    def _emit_held_section(self, body: str, out: list[Delta]) -> None:
        if not self.strict:
            self._emit_spans(body, lenient_section_spans(body, self.tools), out)
            return
        try:
            spans = parse_section_spans(body, self.tools)
        except MalformedSection as e:
            raw = SECTION_BEGIN + body + SECTION_END
            warn_malformed(e, raw)
            out.append({"content": raw})
            return
        self._emit_spans(body, spans, out)

    def _emit_spans(self, body: str, spans: list[tuple[str, str, int, int]], out: list[Delta]) -> None:
        for call_id, name, a0, a1 in spans:
            index = self._num_calls
            self._num_calls += 1
            self._num_good += 1
            out.append(_call_delta(index, call_id, name))
            # the arguments in the pieces they arrived in
            lo = bisect.bisect_right(self._cuts, a0)
            bounds = [a0, *(c for c in self._cuts[lo:] if c < a1), a1]
            out += [_args_delta(index, body[s:t]) for s, t in zip(bounds, bounds[1:]) if t > s]

    # ------------------------------------------------------------------ eager mode

    def _reset_eager(self) -> None:
        self._phase = "between"  # between calls | header | args | failed
        self._cur = 0  # where the current phase's text starts in `_section`
        self._scan = 0  # no marker starts before this offset (saves rescanning long arguments)
        self._sent = 0  # args phase: arguments sent up to this offset
        self._call: tuple[int, str] | None = None  # (index, id) of the call whose arguments stream
        self._section_calls: list[int] = []

    def _fail(self, reason: object) -> None:
        warn_malformed(reason, SECTION_BEGIN + self._section)
        self._phase = "failed"

    def _eager_step(self, out: list[Delta]) -> None:
        s = self._section
        while True:
            if self._phase == "failed":
                end = s.find(SECTION_END)  # the section is everything up to its first end marker
                if end < 0:
                    return
                self._malformed += self._section_calls
                out.append({"content": SECTION_BEGIN + s[: end + len(SECTION_END)]})
                self._close_section(end, out)
                return
            if self._phase == "between":
                i = self._cur
                while i < len(s) and s[i].isspace():
                    i += 1
                self._cur = i
                rest = s[i:]
                if rest.startswith(CALL_BEGIN):
                    self._phase, self._cur = "header", i + len(CALL_BEGIN)
                    self._scan = self._cur
                elif rest.startswith(SECTION_END):
                    if not self._section_calls:
                        self._fail("a section with no calls")
                        continue
                    self._num_good += len(self._section_calls)
                    self._close_section(i, out)
                    return
                elif not rest or CALL_BEGIN.startswith(rest) or SECTION_END.startswith(rest):
                    return  # wait for more
                else:
                    self._fail(f"text {rest[:40]!r} between calls")
                continue
            pos, marker = _first_marker(s, self._scan)
            if marker is None:
                self._scan = max(self._cur, len(s) - _LONGEST + 1)
                if self._phase == "args":
                    self._send_args(len(s) - max(_held_prefix(s, m) for m in _IN_SECTION), out)
                return
            if self._phase == "header":
                if marker != ARGUMENT_BEGIN:
                    self._fail(f"{marker} before <|tool_call_argument_begin|>")
                    continue
                try:
                    call_id, name = parse_header(s[self._cur : pos], self.tools)
                except MalformedSection as e:
                    self._fail(e)
                    continue
                index = self._num_calls
                self._num_calls += 1
                self._section_calls.append(index)
                out.append(_call_delta(index, call_id, name))
                self._call = (index, call_id)
                self._phase, self._cur = "args", pos + len(ARGUMENT_BEGIN)
                self._scan = self._sent = self._cur
                continue
            # args phase: only <|tool_call_end|> may come next
            if marker != CALL_END:
                self._fail(f"{marker} inside the arguments of a call")
                continue
            assert self._call is not None
            try:
                check_arguments(self._call[1], s[self._cur : pos].strip())
            except MalformedSection as e:
                self._fail(e)
                continue
            self._send_args(pos, out)
            self._phase, self._cur = "between", pos + len(CALL_END)

    def _send_args(self, limit: int, out: list[Delta]) -> None:
        """Send the argument text in `_section[_cur:limit]` not sent yet, without outer whitespace."""
        assert self._call is not None
        s = self._section
        start = self._sent
        if start == self._cur:  # nothing sent yet: leading whitespace of the arguments is never sent
            while start < limit and s[start].isspace():
                start += 1
        end = limit
        while end > start and s[end - 1].isspace():
            end -= 1  # trailing whitespace waits: it is sent only if more argument text follows
        if end > start:
            out.append(_args_delta(self._call[0], s[start:end]))
            self._sent = end


def accumulate_deltas(deltas: Iterable[Delta]) -> tuple[str, list[ToolCall]]:
    """Merge streamed deltas the way OpenAI clients do: `(content, tool_calls)` in `parse_tool_calls`'s shape."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.get("content"):
            content.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            call = calls.setdefault(
                tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.get("id"):
                call["id"] = tc["id"]
            if tc.get("type"):
                call["type"] = tc["type"]
            fn = tc.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return "".join(content), [calls[i] for i in sorted(calls)]
