"""The front's side of its ranks' transfer agents: one ZMQ ROUTER socket, used only by the engine thread.

Agents say hello with their descriptor when they start; the front then sends them `Push`, `Expect`
and `Cancel` commands for a room (`commands.py`), and gathers their per-rank `RoomReport`s into one
`RoomOutcome` per room once every rank of the room's group has reported. A room the front gives
up waiting for (`give_up`: its report deadline passed) is forgotten; the reports of it that come
later are logged as late and ignored.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import zmq

from dserve.transfer.commands import (
    Cancel,
    Expect,
    Hello,
    PartSent,
    Push,
    RoomReport,
    Stop,
    Transfer,
    pack,
    unpack,
)
from dserve.transfer.descriptor import (
    InstanceDescriptor,
    RankDescriptor,
    all_pools,
    stage_layers,
)
from dserve.transfer.mapping import Route, plan_pipeline_routes

log = logging.getLogger("dserve.transfer")
GIVEN_UP_KEPT = 1024  # rooms given up whose late reports are still told from unknown ones


@dataclass(frozen=True)
class RoomOutcome:
    """A room's end over every rank of its DP group."""

    room: int
    transfer: Transfer
    ok: bool
    error: str | None
    payload: bytes | None  # decode: what the prefill sent with the pages
    bytes: int
    seconds: float
    settled: bool = True  # decode: False when a receive could still land in the room's pages
    # perf_counter (one clock per host) when the first rank's agent took the command
    started: float = 0.0
    finished: float = 0.0  # ... and when the last rank's agent had sent / received everything


@dataclass
class _Pending:
    transfer: Transfer
    ranks: set[tuple[int, int, int]]  # RankDescriptor.key of those yet to report
    started: float
    reports: list[RoomReport] = field(default_factory=list)


def identity(rank: RankDescriptor) -> bytes:
    """The agent's ZMQ identity (agent.Placement.identity)."""
    return agent_name(rank.key).encode()


def agent_name(key: tuple[int, int, int]) -> str:
    """A rank's agent in messages: its DP rank, stage and attention rank (as its identity)."""
    return "-".join(map(str, key))


class TransferManager:
    def __init__(self, tcp_host: str | None = None):
        """With every rank on this host, commands and events go over a Unix socket (measured on
        2x H200: ~0.2 ms less per room than TCP on the loopback); an instance spanning hosts
        binds TCP on `tcp_host`, the front's address as the other hosts reach it. An agent in
        this process (a rank of one) uses `local_address`, in-process: no I/O thread on the
        way, ~0.1 ms less each way (a command out, its report back) on a 2-core CPU host."""
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # an unknown rank is an error, not a silent drop
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ipc_dir = tempfile.TemporaryDirectory(prefix="dserve-transfer-")
        if tcp_host is None:
            self.address = f"ipc://{self.ipc_dir.name}/front"
            self.sock.bind(self.address)
        else:
            port = self.sock.bind_to_random_port(f"tcp://{tcp_host}")
            self.address = f"tcp://{tcp_host}:{port}"
        # on zmq.Context.instance(), which an agent in this process shares
        self.local_address = f"inproc://dserve-transfer-{uuid.uuid4().hex}"
        self.sock.bind(self.local_address)
        self.ranks: dict[tuple[int, int, int], RankDescriptor] = {}  # by RankDescriptor.key
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.given_up: dict[tuple[Transfer, int], set[tuple[int, int, int]]] = {}
        """Rooms given up before every rank reported: the ranks whose report is still due."""
        self.parts_in_flight: dict[int, int] = {}
        """Prefill: per room, parts of it some rank's agent has not finished sending."""

    def wait_for_agents(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ranks) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise RuntimeError(f"only {len(self.ranks)} of {count} transfer agents started")
            self._receive_one()

    def descriptor(self, model: dict, dp_size: int, attn_tp: int) -> InstanceDescriptor:
        return InstanceDescriptor(
            model, dp_size, attn_tp, [self.ranks[k] for k in sorted(self.ranks)]
        )

    def group(self, dp_rank: int) -> list[RankDescriptor]:
        """A DP group's ranks over every stage, in slot order."""
        return [self.ranks[k] for k in sorted(self.ranks) if k[0] == dp_rank]

    # ---- commands ---------------------------------------------------------------------------------
    def _send(self, rank: RankDescriptor, command) -> None:
        self.sock.send_multipart([identity(rank), pack(command)])

    def push(
        self,
        room: int,
        dp_rank: int,
        peer: InstanceDescriptor,
        peer_dp: int,
        src_pages: list[int],
        dst_pages: list[int],
        timeout_s: float,
        payload: bytes | None = None,
        ready_pages: int | None = None,
        error: str | None = None,
    ) -> None:
        """Send a room's pages. With `ready_pages` a part: the messages whose pages are all
        among the first `ready_pages` (and not sent yet) leave now, and nothing is reported;
        without it the rest and the control message (the `payload`, or the sender's `error`),
        reported as one outcome for the whole room."""
        mine = self.group(dp_rank)
        theirs = peer.group(peer_dp)
        command = Push(
            room,
            src_pages,
            dst_pages,
            timeout_s,
            routes=self._routes(room, mine, theirs),
            dst_ranks=[r.address for r in theirs],
            dst_heads_held=[len(p.held_heads) for p in all_pools(theirs)],
            message_pages=agreed_message_pages(mine, theirs),
            payload=payload,
            ready_pages=ready_pages,
            error=error,
        )
        if ready_pages is None:
            self._start(Transfer.PUSH, room, mine, command)
            return
        for r in mine:
            self._send(r, command)
        self.parts_in_flight[room] = self.parts_in_flight.get(room, 0) + len(mine)

    def expect(
        self,
        room: int,
        dp_rank: int,
        peer: InstanceDescriptor,
        dst_pages: list[int],
        timeout_s: float,
    ) -> None:
        mine = self.group(dp_rank)
        theirs = peer.group(0)
        command = Expect(
            room,
            dst_pages,
            timeout_s,
            routes=self._routes(room, theirs, mine),
            src_heads_held=[len(p.held_heads) for p in all_pools(theirs)],
            message_pages=agreed_message_pages(theirs, mine),
        )
        self._start(Transfer.RECEIVE, room, mine, command)

    def give_up(self, transfer: Transfer, room: int) -> list[str]:
        """Stop waiting for a room's reports (its deadline passed): the agents (identities) whose
        report had not come. Their reports, if they come, are ignored."""
        key = (transfer, room)
        pending = self.pending.pop(key, None)
        self.parts_in_flight.pop(room, None)
        if pending is None:
            return []
        if len(self.given_up) >= GIVEN_UP_KEPT:
            del self.given_up[next(iter(self.given_up))]  # the oldest
        self.given_up[key] = set(pending.ranks)
        return [agent_name(rank) for rank in sorted(pending.ranks)]

    def cancel(self, room: int, dp_rank: int) -> None:
        for r in self.group(dp_rank):
            self._send(r, Cancel(room))

    @staticmethod
    def _routes(
        room: int, prefill: list[RankDescriptor], decode: list[RankDescriptor]
    ) -> list[list[Route]]:
        """Per pool, the room's routes between a prefill DP group and a decode DP group (each
        over all its stages)."""
        out = []
        for i, pool in enumerate(all_pools(decode)):
            routes = plan_pipeline_routes(
                pool.kind,
                prefill[0].attn_tp,
                stage_layers(prefill, i),
                decode[0].attn_tp,
                stage_layers(decode, i),
                room,
                pool.total_kv_heads,
            )
            out.append(routes)
        return out

    def _start(self, transfer: Transfer, room: int, ranks: list[RankDescriptor], command) -> None:
        key = (transfer, room)
        if key in self.pending:
            doing = "sending" if transfer is Transfer.PUSH else "receiving"
            raise ValueError(f"room {room} is already {doing}")
        ranks_left = {r.key for r in ranks}
        self.given_up.pop(key, None)  # the room id again: an old late report is not told apart
        self.pending[key] = _Pending(transfer, ranks_left, time.perf_counter())
        for r in ranks:
            self._send(r, command)

    # ---- events -----------------------------------------------------------------------------------
    def _receive_one(self) -> tuple[tuple[int, int, int], object]:
        """The next event and the key of the rank that sent it."""
        ident, raw = self.sock.recv_multipart()
        event = unpack(raw)
        if isinstance(event, Hello):
            self.ranks[event.descriptor.key] = event.descriptor
        rank = tuple(int(x) for x in ident.decode().split("-"))
        return rank, event

    def poll(self, timeout_ms: int = 0) -> list[RoomOutcome]:
        """Outcomes of rooms whose every rank has reported since the last call."""
        outcomes = []
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            rank, event = self._receive_one()
            if isinstance(event, PartSent):
                self._part_sent(event.room)
            elif isinstance(event, RoomReport):
                outcome = self._reported(rank, event)
                if outcome is not None:
                    outcomes.append(outcome)
        return outcomes

    def _reported(self, rank: tuple[int, int, int], report: RoomReport) -> RoomOutcome | None:
        """Count one rank's report; the room's outcome once it was the last."""
        key = (report.transfer, report.room)
        pending = self.pending.get(key)
        if pending is None:
            self._unexpected(rank, report)
            return None
        pending.reports.append(report)
        pending.ranks.discard(rank)
        if pending.ranks:
            return None
        del self.pending[key]
        return _merge(report.room, pending)

    def _unexpected(self, rank: tuple[int, int, int], report: RoomReport) -> None:
        """A report of no room pending: a late one of a room given up, or a stray one."""
        key = (report.transfer, report.room)
        due = self.given_up.get(key)
        if due is None or rank not in due:
            log.warning("transfer event for unknown room %s: %s", report.room, report)
            return
        due.discard(rank)
        if not due:
            del self.given_up[key]
        said = "ok" if report.ok else f"failed: {report.error}"
        name = agent_name(rank)
        log.info(
            "room %d: late report of agent %s (room given up), ignored: %s", report.room, name, said
        )

    def _part_sent(self, room: int) -> None:
        left = self.parts_in_flight.get(room, 0) - 1
        if left > 0:
            self.parts_in_flight[room] = left
        else:
            self.parts_in_flight.pop(room, None)

    def close(self) -> None:
        for rank in self.ranks.values():
            with contextlib.suppress(zmq.ZMQError):
                self._send(rank, Stop())
        self.sock.close()
        self.ipc_dir.cleanup()


def agreed_message_pages(prefill: list[RankDescriptor], decode: list[RankDescriptor]) -> list[int]:
    """Per pool, the most pages one message of a room carries: the smaller cap of the two
    sides (the decode's staging limit, the prefill's streaming part), 0 when neither caps.
    Both sides compute it from both descriptors, so they cut a room alike."""
    caps = []
    for p, d in zip(all_pools(prefill), all_pools(decode)):
        given = [c for c in (p.message_pages, d.message_pages) if c]
        caps.append(min(given, default=0))
    return caps


def _merge(room: int, pending: _Pending) -> RoomOutcome:
    reports = pending.reports
    errors = [r.error for r in reports if not r.ok]
    payload = next((r.payload for r in reports if r.payload), None)
    started = [r.started for r in reports if r.started]
    finished = [r.finished for r in reports if r.finished]
    return RoomOutcome(
        room,
        pending.transfer,
        not errors,
        "; ".join(dict.fromkeys(errors)) or None,
        payload,
        sum(r.bytes for r in reports),
        time.perf_counter() - pending.started,
        all(r.settled for r in reports),
        min(started, default=0.0),
        max(finished, default=0.0),
    )
