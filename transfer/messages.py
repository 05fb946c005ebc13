"""The UCX messages that move one room, as both sides derive them.

Pools are page-major (memory/kv_pool.py), so a message carries every layer the route moves: for
every real route and pool, one message per run of consecutive destination pages. Its bytes are the
pages as the receiver lays them out when it holds exactly the route's heads and layers: per page,
per layer and buffer, the page's slots of those heads. With all heads and layers on both sides that
is the pages themselves; a head or layer slice is gathered by the sender or scattered by the receiver through a staging buffer. The prefill side
derives the same list from the destination pages it was given, reading its own pages in the same
order. A message's tag is a hash of where it belongs, so both sides agree without talking, and no two
rooms collide.

Every (prefill rank, decode rank) pair of a room also exchanges one control message (msgpack, at most
`CTRL_BYTES`) after its data: success or the sender's error, plus the payload for the decode's front (`Control`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import asdict, dataclass

import msgpack

from dserve.transfer.mapping import Route

CTRL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Message:
    tag: int
    pool: int
    dst_pages: tuple[int, int]  # first destination page and count
    src_pages: tuple[int, ...]  # source pages, in order
    src_heads: tuple[int, int] | None  # MHA slice (first local head, count); None: all heads
    dst_heads: tuple[int, int] | None
    layers: tuple[int, int]  # the model's layers [first, stop): each side finds them in its pool
    index: int = 0  # where its first page is in the room's pages (the prompt's page order)

    def ready(self, pages: int) -> bool:
        """Whether its pages are all among the room's first `pages` (computed and sendable)."""
        return self.index + self.dst_pages[1] <= pages


def tag_of(room: int, *where: int) -> int:
    raw = struct.pack(f"<q{len(where)}q", room, *where)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def ctrl_tag(room: int, prefill_rank: int, decode_rank: int) -> int:
    return tag_of(room, prefill_rank, decode_rank, -1)


def page_runs(pages: list[int], longest: int = 0) -> list[tuple[int, int]]:
    """(start index in `pages`, length) of each run of consecutive page ids, cut into pieces of at
    most `longest` pages (0: no limit)."""
    runs, start = [], 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1 or i - start == longest:
            runs.append((start, i - start))
            start = i
    return runs


def route_messages(
    room: int,
    route: Route,
    pool_index: int,
    dst_pages: list[int],
    src_pages: list[int] | None,
    src_heads_held: int,
    dst_heads_held: int,
    message_pages: int = 0,
) -> list[Message]:
    """Messages of one real route for one pool. `src_pages` is None on the decode side (unknown
    there, not needed); `*_heads_held` are the KV heads each side holds (0 for MLA); the decode
    pool's `message_pages` caps the pages of one message."""
    if route.dummy:
        return []
    src_slice = _head_slice(route.src_head, route.num_heads, src_heads_held)
    dst_slice = _head_slice(route.dst_head, route.num_heads, dst_heads_held)
    out = []
    for run, (start, n) in enumerate(page_runs(dst_pages, message_pages)):
        tag = tag_of(room, route.prefill_rank, route.decode_rank, pool_index, run)
        src = tuple(src_pages[start : start + n]) if src_pages is not None else ()
        first = (dst_pages[start], n)
        layers = (route.first_layer, route.stop_layer)
        msg = Message(tag, pool_index, first, src, src_slice, dst_slice, layers, start)
        out.append(msg)
    return out


def _head_slice(first: int, count: int, held: int) -> tuple[int, int] | None:
    if held == 0 or (first == 0 and count == held):
        return None
    return (first, count)


@dataclass(frozen=True)
class Control:
    """The control message a prefill rank sends a decode rank after a room's data: success or
    the sender's error, and the payload for the decode's front (`commands.Push.payload`)."""

    ok: bool
    error: str | None = None
    payload: bytes | None = None

    def pack(self) -> bytes:
        """Its length (4 bytes) and msgpack body; one over `CTRL_BYTES` becomes a failure."""
        body = msgpack.packb(asdict(self))
        if len(body) + 4 > CTRL_BYTES:
            error = f"control message of {len(body)} bytes is over the limit"
            body = msgpack.packb(asdict(Control(False, error)))
        return struct.pack("<I", len(body)) + body

    @classmethod
    def unpack(cls, buffer: bytes) -> Control:
        """A received control message; a malformed one reads as a failed transfer."""
        try:
            (n,) = struct.unpack_from("<I", buffer)
            if not 0 < n <= CTRL_BYTES - 4:
                raise ValueError(f"length {n}")
            body = msgpack.unpackb(bytes(buffer[4 : 4 + n]))
            if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
                raise ValueError("not a control record")
            return cls(**body)
        except Exception as e:  # noqa: BLE001 - any garbage means the room failed
            return cls(False, f"malformed control message ({e})")
