"""A decode instance's connector: receives each room's KV from its prefill and joins the request.

Per request (`DecodeState`): BOOTSTRAPPING (the engine waits for free pages for the prompt:
`arriving_tokens`) -> TRANSFERRING (`allocated`: receives posted, the room registered with the
prefill) -> joined (`Engine.join`: the first token and the draft tree, then decoding as
colocated). Pages of a room that fails or is aborted while receives are posted stay QUARANTINED
until every rank confirms its receives settled, so no late byte can land in a page another
request owns.

A client that leaves while its room's KV arrives leaves the room ABANDONED: the receives stay
posted for `ABANDON_GRACE_S`, so the prefill's sends (most likely under way: with a stream the
pair shares, the client had the first token just before the prefill pushed) complete, and both
sides free the pages at once. Cancelling them instead would leave the prefill's sends to wait
for receives that never come, holding its pages until its transfer timeout. Past the grace the
receives are cancelled (QUARANTINED).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from dserve.runtime.pd import Handoff, PDConnector, check_carried, timeline
from dserve.scheduler.request import Request
from dserve.transfer.descriptor import InstanceDescriptor
from dserve.transfer.manager import RoomOutcome

log = logging.getLogger("dserve.pd")
QUARANTINE_S = 30.0  # how long a failed room's receives may take to settle
ABANDON_GRACE_S = 2.0  # how long an abandoned room's receives stay posted


class DecodeState(Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    ABANDONED = "abandoned"
    QUARANTINED = "quarantined"


class PrefillLink(Protocol):
    """The decode's line to the prefill's bootstrap server; calls return at once (work goes async)."""

    def register(self, room_id: int, dp_rank: int, pages: list[int]) -> None: ...

    def cancel(self, room_id: int) -> None: ...


@dataclass
class DecodeRoom:
    req: Request
    id: int  # the bootstrap room
    peer: InstanceDescriptor
    link: PrefillLink  # tells the prefill (from the asyncio side) where to send, or to give up
    state: DecodeState = DecodeState.BOOTSTRAPPING
    deadline: float = float("inf")
    group: int = 0
    key: str | None = None
    registered_at: float = 0.0


class DecodeConnector(PDConnector):
    role = "decode"

    def __init__(self, engine, manager, config, metrics):
        super().__init__(engine, manager, config, metrics)
        self.rooms: dict[str, DecodeRoom] = {}
        self.peers = None  # the PeerDirectory, made on the first request (on the event loop)

    # ---- the HTTP front -------------------------------------------------------------------------
    async def starts(self, bootstrap, reqs, rooms, loop) -> list[tuple]:
        """Meet the prefill (once per address), then a link per request to register its room."""
        for req in reqs:
            check_carried(req)
        if self.peers is None:
            from dserve.runtime.bootstrap import PeerDirectory

            self.peers = PeerDirectory(self.descriptor, self.config.bootstrap_timeout_s)
        host, port = bootstrap.host, bootstrap.port
        peer = await self.peers.get(host, port)

        def fail_later(rid: str, error: str) -> None:
            loop.post(self.fail, rid, error)

        started = []
        for req, room_id in zip(reqs, rooms):
            link = self.peers.link(host, port, req.rid, fail_later)
            started.append((req, self._starter(room_id, peer, link)))
        return started

    def _starter(self, room_id: int, peer: InstanceDescriptor, link: PrefillLink):
        return lambda req: self.start(req, room_id, peer, link)

    def start(
        self, req: Request, room_id: int, peer: InstanceDescriptor, link: PrefillLink
    ) -> None:
        self._claim(room_id, req.rid)
        deadline = time.perf_counter() + self.config.prealloc_timeout_s
        self.rooms[req.rid] = DecodeRoom(req, room_id, peer, link, deadline=deadline)
        self.engine.submit(req)  # visible to the stream; its pages come in `allocated`

    # ---- asked and told by the engine -----------------------------------------------------------
    def arriving_tokens(self, req: Request) -> int:
        return len(req.prompt_ids) if req.rid in self.rooms else 0

    def allocated(self, req: Request, pages: list[int]) -> None:
        room = self.rooms[req.rid]
        room.group = self.engine.dp_group(req.rid)
        timeout = self.config.transfer_timeout_s
        self.manager.expect(room.id, room.group, room.peer, pages, timeout)
        room.state = DecodeState.TRANSFERRING
        room.deadline = time.perf_counter() + timeout + 15
        room.link.register(room.id, room.group, pages)
        room.registered_at = time.perf_counter()

    # ---- the engine thread, between steps -------------------------------------------------------
    def abort(self, rid: str) -> bool:
        room = self.rooms.get(rid)
        if room is None:
            return False
        if room.state is DecodeState.TRANSFERRING:
            self._abandon(room)
        else:
            self.fail(rid, "aborted by the client")
        return True

    def _abandon(self, room: DecodeRoom) -> None:
        """The client left while the room's KV arrives (module docstring)."""
        room.link.cancel(room.id)  # a prefill that has not pushed yet gives the room up
        room.key = self.engine.hold(room.req.rid, "recv")
        room.state = DecodeState.ABANDONED
        room.deadline = time.perf_counter() + ABANDON_GRACE_S
        room.req.finish("abort", error="aborted by the client")

    def fail(self, rid: str, error: str) -> None:
        room = self.rooms.get(rid)
        if room is None or room.state is DecodeState.QUARANTINED:
            return
        if room.state is DecodeState.ABANDONED:  # the prefill was told, the pages are held
            self._quarantine(room)
            return
        room.link.cancel(room.id)
        if room.state is DecodeState.BOOTSTRAPPING:
            self._drop(room)
        else:  # receives are posted: settle them before the pages go back
            room.key = self.engine.hold(rid, "recv")
            self._quarantine(room)
        if not room.req.finished:
            log.warning("room %d: %s", room.id, error)
            room.req.finish("abort", error=error)

    def _quarantine(self, room: DecodeRoom) -> None:
        """Cancel the room's receives; its (held) pages go back once they settled."""
        self.manager.cancel(room.id, room.group)
        room.state = DecodeState.QUARANTINED
        room.deadline = time.perf_counter() + QUARANTINE_S

    def _tick(self, now: float) -> None:
        for room in list(self.rooms.values()):
            if now > room.deadline:
                self._expired(room)

    def _expired(self, room: DecodeRoom) -> None:
        if room.state is DecodeState.BOOTSTRAPPING:
            prompt = len(room.req.prompt_ids)
            waited = self.config.prealloc_timeout_s
            error = f"no free KV pages for a {prompt}-token prompt within {waited:.0f}s"
            self.fail(room.req.rid, error)
        elif room.state is DecodeState.TRANSFERRING:
            waited = self.config.transfer_timeout_s
            error = f"the KV of bootstrap_room {room.id} did not arrive within {waited:.0f}s"
            self.fail(room.req.rid, error)
        elif room.state is DecodeState.ABANDONED:
            self._quarantine(room)
        else:
            log.error("room %d: receives never settled; its pages stay out of use", room.id)
            self._drop(room)

    def _on_outcome(self, room: DecodeRoom, outcome: RoomOutcome) -> None:
        req = room.req
        if room.state is DecodeState.TRANSFERRING:
            self._record(req, outcome)
            if outcome.ok and outcome.payload:
                self._drop(room)
                self._join(room, Handoff.unpack(outcome.payload), outcome.finished)
                return
            missing = outcome.error or "no first token from the prefill"
            req.finish("abort", error=f"KV transfer failed: {missing}")
            room.key = self.engine.hold(req.rid, "recv")
        # abandoned, quarantined or failed: the pages go back only once no receive can land
        if outcome.settled:
            self.engine.release(room.key)
        else:
            log.error("room %d: receives never settled; its pages stay out of use", room.id)
        self._drop(room)

    def _join(self, room: DecodeRoom, handoff: Handoff, arrived: float) -> None:
        """`arrived`: when the last of the room's agents had its pages (their clock)."""
        received = time.perf_counter()
        req = room.req
        self.engine.join(req.rid, handoff.prefilled)
        req.extra_meta["kv_transfer"]["streamed_pages"] = handoff.streamed_pages
        marks = {"registered": room.registered_at, "received": received}
        if abs(received - arrived) < 60:  # else agents on another host: another clock
            marks["pages_arrived"] = arrived
        marks["joined"] = time.perf_counter()
        req.extra_meta["pd_timeline_ms"] = timeline(req, marks, handoff.marks)

    def _drop(self, room: DecodeRoom) -> None:
        self._forget_room(room.req.rid, room.id)
