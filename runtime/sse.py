"""Reading an instance's server-sent events in the router: a stream's first event, its error
events, and its events one read at a time (whole events only) for relaying them.

An instance's events are `data: <JSON>\n\n`; its stream ends with `STREAM_END`, after an error
event (`{"error": {...}}`) when the request failed.
"""

from __future__ import annotations

import contextlib
import json

from dserve.runtime.protocol import error_body
from dserve.runtime.upstream import Response, UpstreamError

STREAM_END = b"data: [DONE]\n\n"  # a stream's last event, the router's and the instances'


def error_event(message: str, status: int) -> bytes:
    return b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n"


async def first_event(upstream: Response) -> bytes:
    """The bytes of a stream up to the end of its first event (maybe a few more)."""
    head = b""
    while b"\n\n" not in head:
        chunk = await upstream.readany()
        if not chunk:
            raise UpstreamError("the stream ended before its first event")
        head += chunk
    return head


def event_error(head: bytes) -> str | None:
    """The message of the first error event in `head`, if any (only lines
    that hold the key are parsed: a token's event is not)."""
    for line in head.splitlines():
        if line.startswith(b"data: ") and b'"error"' in line:
            with contextlib.suppress(ValueError):
                event = json.loads(line[6:])
                if isinstance(event, dict) and "error" in event:
                    return event["error"].get("message", "error")
    return None


class EventReader:
    """A stream's whole events, a read at a time, starting with bytes already read."""

    def __init__(self, upstream: Response, head: bytes = b""):
        self.upstream, self.buffer = upstream, head

    async def batch(self) -> list[bytes]:
        """The whole events read so far (reading until there is one); [] at the stream's end."""
        while b"\n\n" not in self.buffer:
            chunk = await self.upstream.readany()
            if not chunk:
                return []
            self.buffer += chunk
        return self.ready()

    def ready(self) -> list[bytes]:
        """The whole events read so far, without reading (maybe none)."""
        whole, _, self.buffer = self.buffer.rpartition(b"\n\n")
        return [event + b"\n\n" for event in whole.split(b"\n\n")] if whole else []
