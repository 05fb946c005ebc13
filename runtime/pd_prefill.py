"""A prefill instance's connector: computes each room's prompt and sends its KV to the decode.

Per request (`PrefillState`): COMPUTING (the prompt runs; the request ends at its first token,
`max_new_tokens`, and `request_finished` holds its pages) -> WAITING (for the decode's
registration of its pages for the room) -> TRANSFERRING (the agents push the pages and the
`Handoff`) -> ended, pages released. The answer goes out when the KV has left (or failed).

Each wait has a deadline: WAITING the bootstrap timeout, TRANSFERRING the agents' reports (an
agent reports by `transfer_timeout_s` after it took the push) plus `transfer_report_margin_s`.
Past it (an agent wedged or dead, a report lost) the room fails as a failed transfer does, its
pages are freed and the warning names the agents whose report is missing; their reports, if
they come, are ignored (`TransferManager.give_up`). By then the agents' own deadline has passed,
so a live one reads the pages no more, and a decode with the same transfer timeout has given up
its receives (the router also drops the decode's request when the prefill fails).

With KV streaming a COMPUTING room whose registration came sends parts as the prompt's chunks
are written (`_stream`); the final push sends the rest and the handoff. A request preempted
while a part of it is being sent keeps its pages under a `stream` hold until its agents report
the part sent (`request_preempted`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum

from dserve.runtime.connector import Prefilled
from dserve.runtime.pd import Handoff, PDConnector, PrefillMarks, check_carried
from dserve.scheduler.request import Request
from dserve.transfer.commands import Transfer
from dserve.transfer.descriptor import InstanceDescriptor, check_compatible
from dserve.transfer.manager import RoomOutcome

log = logging.getLogger("dserve.pd")


class PrefillState(Enum):
    COMPUTING = "computing"
    WAITING = "waiting"
    TRANSFERRING = "transferring"


@dataclass
class Registration:
    """Where the decode wants a room's KV (it came over the bootstrap server)."""

    peer: InstanceDescriptor
    dp_rank: int
    pages: list[int]
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class PrefillRoom:
    req: Request
    id: int  # the bootstrap room
    state: PrefillState = PrefillState.COMPUTING
    key: str | None = None
    """The holder of the request's pages once its first token ended it."""
    deadline: float = float("inf")
    """WAITING: for the decode's registration; TRANSFERRING: for the agents' reports."""
    registration: Registration | None = None
    group: int = 0
    """The DP group that computes it (known once it streams)."""
    streamed_pages: int = 0
    """Pages already pushed while the prompt was computed (streaming)."""
    stream_keys: list[str] = field(default_factory=list)
    """Pages kept when the request was preempted while an agent was still sending some of
    them: freed once every part has gone."""


class PrefillConnector(PDConnector):
    role = "prefill"

    def __init__(self, engine, manager, config, metrics):
        super().__init__(engine, manager, config, metrics)
        self.rooms: dict[str, PrefillRoom] = {}
        self.registrations: dict[int, Registration] = {}
        self.cancelled: dict[int, float] = {}  # room id -> when
        self.peers: dict[str, InstanceDescriptor] = {}

    # ---- the HTTP front and the bootstrap server (run on the engine thread) ----------------------
    async def starts(self, bootstrap, reqs, rooms, loop) -> list[tuple]:
        for req in reqs:
            check_carried(req)
        return [(req, self._starter(room_id)) for req, room_id in zip(reqs, rooms)]

    def _starter(self, room_id: int):
        return lambda req: self.start(req, room_id)

    def start(self, req: Request, room_id: int) -> None:
        self._claim(room_id, req.rid)
        self.rooms[req.rid] = PrefillRoom(req, room_id)
        self.engine.submit(req)

    def add_peer(self, peer_id: str, peer: InstanceDescriptor) -> None:
        check_compatible(self.descriptor, peer, local_role="prefill", remote_role="decode")
        self.peers[peer_id] = peer

    def register(
        self,
        room_id: int,
        peer_id: str,
        dp_rank: int,
        pages: list[int],
        arrived: float | None = None,
    ) -> None:
        """`arrived`: when the bootstrap server got it (perf_counter; default now)."""
        peer = self.peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown decode peer {peer_id!r}: register it first")
        if not 0 <= dp_rank < peer.dp_size:
            raise ValueError(
                f"dp_rank {dp_rank} out of range for a peer with dp_size {peer.dp_size}"
            )
        log.debug("room %d: decode registered %d pages", room_id, len(pages))
        when = time.perf_counter() if arrived is None else arrived
        self.registrations[room_id] = Registration(peer, dp_rank, pages, when)

    def cancel(self, room_id: int) -> None:
        self.cancelled[room_id] = time.perf_counter()

    # ---- asked and told by the engine -----------------------------------------------------------
    def max_new_tokens(self, req: Request) -> int | None:
        return 1 if req.rid in self.rooms else None  # the decode generates the rest

    def request_finished(self, req: Request) -> None:
        room = self.rooms.get(req.rid)
        if room is not None:  # its pages wait to be sent
            room.key = self.engine.hold(req.rid, "send")

    def request_preempted(self, req: Request) -> bool:
        """A request preempted while parts of its room are being sent: keep its pages (an
        agent still reads them) until those parts have gone. The recomputed prompt sends the
        rest."""
        room = self.rooms.get(req.rid)
        if room is None or not self.manager.parts_in_flight.get(room.id):
            return False
        log.info("room %d: preempted while parts of it are sent; its pages wait", room.id)
        why = f"stream{len(room.stream_keys)}"
        room.stream_keys.append(self.engine.hold(req.rid, why))
        return True

    # ---- the engine thread, between steps -------------------------------------------------------
    def busy(self, rid: str) -> bool:
        return rid in self.rooms  # the answer waits until the KV has left (or failed to)

    def abort(self, rid: str) -> bool:
        room = self.rooms.get(rid)
        if room is None:
            return False  # the engine aborts it
        computed = room.key is not None
        if room.state is PrefillState.COMPUTING and computed:
            room.state = PrefillState.WAITING  # computed, not yet polled: end it as waiting
        if room.state is PrefillState.COMPUTING:
            return False  # the engine aborts it; poll() drops the room
        if room.state is PrefillState.WAITING:
            self._end(room, "aborted by the client")
        # a transfer in flight ends on its own (by its deadline at the latest), freeing the pages
        return True

    def _tick(self, now: float) -> None:
        for room in list(self.rooms.values()):
            if room.registration is None:
                room.registration = self.registrations.pop(room.id, None)
            if room.stream_keys and not self.manager.parts_in_flight.get(room.id):
                self._release_stream_keys(room)
            if room.state is PrefillState.COMPUTING:
                self._stream(room)
                self._after_compute(room, now)
            if room.state is PrefillState.WAITING:
                self._try_push(room, now)
            elif room.state is PrefillState.TRANSFERRING and now > room.deadline:
                self._reports_missing(room)
        self._forget_stale(now)

    def _forget_stale(self, now: float) -> None:
        """Registrations and cancellations of rooms this instance never saw."""
        limit = 2 * self.config.bootstrap_timeout_s
        for room_id, reg in list(self.registrations.items()):
            if now - reg.arrived > limit:
                del self.registrations[room_id]
        for room_id, when in list(self.cancelled.items()):
            if now - when > limit:
                del self.cancelled[room_id]

    def _after_compute(self, room: PrefillRoom, now: float) -> None:
        if not room.req.finished:
            return
        if room.key is None:  # aborted or failed before its first token: nothing to send
            self._drop(room)
            return
        room.state = PrefillState.WAITING
        room.deadline = now + self.config.bootstrap_timeout_s

    def _stream(self, room: PrefillRoom) -> None:
        """Push the pages the steps read back so far have written, while the rest of the
        prompt computes (the agent sends the messages whose pages are all among them)."""
        reg, req = room.registration, room.req
        if reg is None or req.finished or room.id in self.cancelled:
            return
        page_size = self.engine.config.page_size
        if len(reg.pages) != -(-len(req.prompt_ids) // page_size):
            return  # the final push fails the room, naming the sizes
        written = min(self.engine.written_tokens(req), len(req.prompt_ids))
        ready = written // page_size
        if ready <= room.streamed_pages:
            return
        pages = self.engine.pages_of(req.rid)[:ready]
        room.group = self.engine.dp_group(req.rid)
        timeout = self.config.transfer_timeout_s
        self.manager.push(
            room.id,
            room.group,
            reg.peer,
            reg.dp_rank,
            pages,
            reg.pages,
            timeout,
            ready_pages=ready,
        )
        room.streamed_pages = ready

    def _release_stream_keys(self, room: PrefillRoom) -> None:
        for key in room.stream_keys:
            self.engine.release(key)
        room.stream_keys.clear()

    def _try_push(self, room: PrefillRoom, now: float) -> None:
        if room.id in self.cancelled:
            self._end(room, "the decode instance cancelled the request")
            return
        reg = room.registration
        if reg is None:
            if now > room.deadline:
                self._end(
                    room,
                    f"no decode instance registered pages for bootstrap_room {room.id} within "
                    f"{self.config.bootstrap_timeout_s:.0f}s (bootstrap timeout)",
                )
            return
        req = room.req
        prompt_pages = -(-len(req.prompt_ids) // self.engine.config.page_size)
        # past the prompt: the drafts' own scratch
        src = self.engine.held_pages(room.key)[:prompt_pages]
        if len(src) != len(reg.pages):
            self._end(
                room,
                f"the decode registered {len(reg.pages)} pages for a prompt of {len(src)} pages",
            )
            return
        group = self.engine.dp_group(req.rid)
        log.debug("room %d: pushing %d pages to decode dp group %d", room.id, len(src), reg.dp_rank)
        marks = PrefillMarks(
            req.arrival_time, req.first_token_time, reg.arrived, time.perf_counter()
        )
        handoff = Handoff(Prefilled.of(req), marks, room.streamed_pages)
        self.manager.push(
            room.id,
            group,
            reg.peer,
            reg.dp_rank,
            src,
            reg.pages,
            self.config.transfer_timeout_s,
            handoff.pack(),
        )
        room.state = PrefillState.TRANSFERRING
        room.deadline = now + self._report_wait()

    def _report_wait(self) -> float:
        """How long the front waits for the agents' reports of a room's push."""
        return self.config.transfer_timeout_s + self.config.transfer_report_margin_s

    def _reports_missing(self, room: PrefillRoom) -> None:
        """The room's push deadline passed without every agent's report: the room fails."""
        missing = ", ".join(self.manager.give_up(Transfer.PUSH, room.id))
        self.metrics.transfer(False, 0, self._report_wait())
        self._end(
            room,
            f"KV transfer failed: no report from transfer agent(s) {missing} (dp-stage-rank) "
            f"on the push of bootstrap_room {room.id} within {self._report_wait():.0f}s "
            "(transfer timeout + report margin)",
        )

    def _on_outcome(self, room: PrefillRoom, outcome: RoomOutcome) -> None:
        self._record(room.req, outcome)
        if outcome.seconds > self.config.transfer_timeout_s:
            log.info(
                "room %d: its push was reported after %.1fs, past the transfer timeout "
                "(within the report margin)",
                room.id,
                outcome.seconds,
            )
        self._end(room, None if outcome.ok else f"KV transfer failed: {outcome.error}")

    def _end(self, room: PrefillRoom, error: str | None) -> None:
        if room.key is not None:
            self.engine.release(room.key)
            room.key = None
        if room.streamed_pages and room.state is not PrefillState.TRANSFERRING:
            self._abandon(room, error or "the prefill gave the room up")
        if error is not None:
            log.warning("room %d: %s", room.id, error)
            room.req.finish("abort", error=error)
        self._drop(room)

    def _abandon(self, room: PrefillRoom, error: str) -> None:
        """A room whose parts went out and that ends without its final push: a final push with
        the error, so the decode stops waiting and the agents forget the room."""
        reg = room.registration
        timeout = self.config.transfer_timeout_s
        self.manager.push(
            room.id, room.group, reg.peer, reg.dp_rank, [], reg.pages, timeout, error=error
        )
        # its outcome arrives for a room already gone: ignored
        room.state = PrefillState.TRANSFERRING

    def _drop(self, room: PrefillRoom) -> None:
        streaming = room.state is PrefillState.COMPUTING
        if room.streamed_pages and streaming:  # aborted while streaming
            self._abandon(room, "the prefill request ended before its prompt was computed")
        self._release_stream_keys(room)  # its parts may still read them: the room failed
        self._forget_room(room.req.rid, room.id)
        self.cancelled.pop(room.id, None)
