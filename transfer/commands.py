"""What the front and its ranks' transfer agents say to each other (ZMQ, msgpack).

The front (`manager.py`) sends commands: `Push` (prefill: send a room's pages, whole or a part),
`Expect` (decode: post the room's receives), `Cancel` (decode: settle them now) and `Stop`. An
agent (`agent.py`) answers with events: `Hello` once (its descriptor), `PartSent` after each part
of a streamed room, and one `RoomReport` per room pushed or received. Each is a frozen dataclass;
`pack` and `unpack` are the one serializer of them all.

A room's `payload` is opaque bytes to the transfer layer: the prefill's front packs it, the
decode's front unpacks it (runtime/pd.py's `Handoff`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

import msgpack

from dserve.transfer.descriptor import RankDescriptor
from dserve.transfer.mapping import Route


class Transfer(Enum):
    """Which way a room's pages move on this side: what a `RoomReport` reports."""

    PUSH = "push"  # prefill
    RECEIVE = "receive"  # decode


# ---- commands: front -> agent ---------------------------------------------------------------


@dataclass(frozen=True)
class Push:
    """Send a room's pages. With `ready_pages` a part: the messages whose pages are all among
    the first `ready_pages` (and not sent yet); without it the rest and the control message."""

    room: int
    src_pages: list[int]
    dst_pages: list[int]
    timeout_s: float
    routes: list[list[Route]]  # per pool, the room's routes between the two DP groups
    dst_ranks: list[str]  # the decode ranks' UCX worker addresses, by slot
    dst_heads_held: list[int]  # per pool, the KV heads a decode rank holds (0: MLA)
    message_pages: list[int]  # per pool, the most pages of one message (0: a whole run)
    payload: bytes | None = None  # for the decode's front, in the control message
    ready_pages: int | None = None
    error: str | None = None  # the prefill gives the room up: sent instead of data

    @classmethod
    def from_dict(cls, body: dict) -> Push:
        return cls(**{**body, "routes": _routes(body["routes"])})


@dataclass(frozen=True)
class Expect:
    """Post a receive for every message and control message of the room."""

    room: int
    dst_pages: list[int]
    timeout_s: float
    routes: list[list[Route]]
    src_heads_held: list[int]  # per pool, the KV heads a prefill rank holds (0: MLA)
    message_pages: list[int]

    @classmethod
    def from_dict(cls, body: dict) -> Expect:
        return cls(**{**body, "routes": _routes(body["routes"])})


@dataclass(frozen=True)
class Cancel:
    """Complete the room's receives still posted, so no late byte lands in its pages."""

    room: int


@dataclass(frozen=True)
class Stop:
    """The front is closing: the agent stops."""


# ---- events: agent -> front -----------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An agent has started: where its rank sits and what it holds."""

    descriptor: RankDescriptor

    @classmethod
    def from_dict(cls, body: dict) -> Hello:
        return cls(RankDescriptor.from_dict(body["descriptor"]))


@dataclass(frozen=True)
class PartSent:
    """A part of a streamed room has left: the front may reuse its pages."""

    room: int


@dataclass(frozen=True)
class RoomReport:
    """One rank's end of a room: pushed (prefill) or received (decode)."""

    room: int
    transfer: Transfer
    ok: bool
    error: str | None = None
    payload: bytes | None = None  # decode: what the prefill sent with the pages
    bytes: int = 0
    settled: bool = True  # decode: False when a receive could still land in the pages
    started: float = 0.0  # perf_counter when the agent took the command
    finished: float = 0.0  # ... and when it had sent / received everything

    @classmethod
    def from_dict(cls, body: dict) -> RoomReport:
        return cls(**{**body, "transfer": Transfer(body["transfer"])})


# ---- the serializer -------------------------------------------------------------------------

TYPES = {cls.__name__: cls for cls in (Push, Expect, Cancel, Stop, Hello, PartSent, RoomReport)}


def pack(message) -> bytes:
    """A command or an event as msgpack: its fields and its type's name."""
    body = asdict(message)
    for name, value in body.items():
        if isinstance(value, Enum):
            body[name] = value.value
    body["type"] = type(message).__name__
    return msgpack.packb(body)


def unpack(raw: bytes):
    """The command or event `pack` made."""
    body = msgpack.unpackb(raw)
    cls = TYPES[body.pop("type")]
    if hasattr(cls, "from_dict"):
        return cls.from_dict(body)
    return cls(**body)


def _routes(per_pool: list[list[dict]]) -> list[list[Route]]:
    return [[Route(**route) for route in routes] for routes in per_pool]
