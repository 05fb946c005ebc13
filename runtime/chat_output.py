"""A chat answer's text -> the message the client sees: `content`, and with the server's parsers
`reasoning_content` (`reasoning.py`) and `tool_calls` (`tool_calls.py`).

Text arrives in pieces (`feed`, then `finish` once the request ended) and leaves as OpenAI delta
objects; a whole answer is the same deltas merged (`merge_deltas`), so a streamed answer and a
whole one always agree.
"""

from __future__ import annotations

from dserve.runtime.reasoning import ReasoningSplit
from dserve.runtime.tool_calls import ToolCallParser


class ChatText:
    """Reasoning split off first, then tool calls read from the content (either parser may be
    absent: then the text is content). Without parallel tool calls, only the first call is
    kept."""

    def __init__(
        self,
        reasoning: ReasoningSplit | None = None,
        tools: ToolCallParser | None = None,
        parallel: bool = True,
    ):
        self.reasoning, self.tools, self.parallel = reasoning, tools, parallel

    @property
    def called(self) -> bool:
        """Whether a tool call was found."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        pieces = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._route(pieces)

    def finish(self) -> list[dict]:
        out = self._route(self.reasoning.finish()) if self.reasoning else []
        if self.tools is not None:
            out += self._keep(self.tools.finish())
        return out

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.tools is not None:
                out += self._keep(self.tools.feed(text))
            else:
                out.append({"content": text})
        return out

    def _keep(self, deltas: list[dict]) -> list[dict]:
        if self.parallel:
            return deltas
        return [d for d in deltas if all(c["index"] == 0 for c in d.get("tool_calls", []))]


def merge_deltas(deltas: list[dict]) -> dict:
    """Delta objects -> one assistant message (`content` None when there is none beside tool
    calls; a tool call's arguments are the concatenation of its pieces)."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls", []):
            slot = calls.setdefault(call["index"], {"function": {"arguments": ""}})
            if "id" in call:
                slot.update(id=call["id"], type="function")
            fn = call.get("function", {})
            if "name" in fn:
                slot["function"]["name"] = fn["name"]
            slot["function"]["arguments"] += fn.get("arguments", "")
    message = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
        message["content"] = message["content"] or None
    return message
