"""Reasoning parsers (`--reasoning-parser`): a chat answer's thinking, `<think>` ... `</think>`,
split from its content as it streams.

`deepseek-r1`: the R1 templates open the thinking in the prompt, so the answer starts in it (an
opening `<think>` is dropped) unless the request turned thinking off (`chat_template_kwargs`
`thinking` or `enable_thinking` false). `glm45`: thinking only where the answer opens it.
Text that may be the start of a tag waits for the next piece.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek-r1", "glm45")


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """Pieces of text in, (kind, text) pieces out, kind "reasoning" or "content"."""

    def __init__(self, forced: bool):
        self.forced = forced
        self.state = "start"
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            self._open()
        if self.state == "reasoning":
            self._reason(out)
        if self.state == "content" and self.buffer:
            out.append(("content", self.buffer))
            self.buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back (a tag that never completed is text)."""
        kind = "reasoning" if self.state == "reasoning" else "content"
        if self.state == "start" and self.forced:
            kind = "reasoning"
        text, self.buffer = self.buffer, ""
        return [(kind, text)] if text else []

    def _open(self) -> None:
        stripped = self.buffer.lstrip()
        if stripped.startswith(START):
            self.buffer, self.state = stripped[len(START) :], "reasoning"
        elif START.startswith(stripped) and stripped:
            return  # may still become the tag
        elif stripped or self.buffer:
            self.state = "reasoning" if self.forced else "content"

    def _reason(self, out: list) -> None:
        at = self.buffer.find(END)
        if at >= 0:
            if at:
                out.append(("reasoning", self.buffer[:at]))
            self.buffer, self.state = self.buffer[at + len(END) :], "content"
            return
        keep = held_back(self.buffer, END)
        text = self.buffer[: len(self.buffer) - keep]
        if text:
            out.append(("reasoning", text))
        self.buffer = self.buffer[len(text) :]


def make_split(parser: str, template_kwargs: dict) -> ReasoningSplit:
    if parser == "deepseek-r1":
        off = template_kwargs.get("thinking") is False
        off = off or template_kwargs.get("enable_thinking") is False
        return ReasoningSplit(forced=not off)
    return ReasoningSplit(forced=False)
