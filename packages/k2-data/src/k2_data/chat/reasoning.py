"""Split a thinking model's reply into `reasoning_content` and the rest, whole or as it streams.

Kimi-K2-Thinking opens its reply with `<think>`, reasons, closes with `</think>`, then answers (text and
tool calls). A reply that does not start with `<think>` has no reasoning; one cut off before `</think>` is
all reasoning. The tool-call parser then runs on what follows `</think>`.

    reasoning, rest = split_reasoning(text)
    splitter = ReasoningSplitter()
    for piece in pieces:
        for kind, text in splitter.feed(piece):   # kind: "reasoning_content" or "content"
            ...
    splitter.finish()
"""

from __future__ import annotations

from k2_data.chat.markers import THINK_BEGIN, THINK_END


def split_reasoning(text: str) -> tuple[str, str]:
    """`(reasoning, rest)`: reasoning is "" when the reply does not open with `<think>`."""
    if not text.startswith(THINK_BEGIN):
        return "", text
    body = text[len(THINK_BEGIN) :]
    end = body.find(THINK_END)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(THINK_END) :]


class ReasoningSplitter:
    """The streaming form of `split_reasoning`: merged, its pieces equal the whole-text split."""

    def __init__(self) -> None:
        self._state = "start"  # start (is it <think>?) | reasoning | content
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._held += text
        if self._state == "start":
            if len(self._held) < len(THINK_BEGIN) and THINK_BEGIN.startswith(self._held):
                return out
            if self._held.startswith(THINK_BEGIN):
                self._state, self._held = "reasoning", self._held[len(THINK_BEGIN) :]
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(THINK_END)
            if end >= 0:
                if end:
                    out.append(("reasoning_content", self._held[:end]))
                self._state, self._held = "content", self._held[end + len(THINK_END) :]
            else:
                keep = next(
                    (k for k in range(min(len(self._held), len(THINK_END) - 1), 0, -1)
                     if self._held.endswith(THINK_END[:k])),
                    0,
                )  # fmt: skip
                if len(self._held) > keep:
                    out.append(("reasoning_content", self._held[: len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep :]
        if self._state == "content" and self._held:
            out.append(("content", self._held))
            self._held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held: a partial `<think>` (content) or a partial `</think>` (reasoning)."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning_content" if self._state == "reasoning" else "content", held)]
