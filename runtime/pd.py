"""The two halves of a disaggregated pair, as state machines the engine thread polls between steps.

Prefill, per request: Computing -> WaitingForInput (the prompt's KV is held until the decode
registers its pages for the room) -> Transferring -> Success | Failed. The answer goes out when the
KV has left (or failed), and the held pages are freed then.

Decode, per request: Bootstrapping (waiting for free pages for the prompt) -> Transferring (receives
posted, the room registered with the prefill) -> Success (the first token joins the running batch) |
Failed. Pages of a room that fails or is aborted while receives are posted stay quarantined until
every rank confirms its receives settled, so no late byte can land in a page another request owns.

Every state has a deadline that ends the request with an error naming what did not happen.

Each decode answer's meta carries `pd_timeline_ms`: when (ms after the decode got the request)
the decode posted its receives and registered the room, the prefill got the request, computed
it, saw the registration and started the push, and the decode had every page and joined the
first token. Both instances' clocks are the host's monotonic clock: on two hosts the prefill's
marks are offsets from its own arrival instead (`prefill_*` keys are then relative to it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgpack

from dserve.models.config import ModelConfig
from dserve.runtime.engine import Engine, hold_key
from dserve.runtime.metrics import InstanceMetrics
from dserve.runtime.server_config import ServerConfig
from dserve.scheduler.request import Request
from dserve.transfer.descriptor import InstanceDescriptor, check_compatible
from dserve.transfer.manager import RoomOutcome, TransferManager
from dserve.transfer.messages import CTRL_BYTES

log = logging.getLogger("dserve.pd")


def model_identity(cfg: ModelConfig) -> dict:
    """What must be equal for two instances' KV pages to mean the same thing."""
    keys = (
        "architecture",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "head_dim",
    )
    return {k: getattr(cfg, k) for k in keys}


def local_descriptor(engine: Engine, manager: TransferManager) -> InstanceDescriptor:
    c = engine.config
    return manager.descriptor(model_identity(engine.model_config), c.dp_size, c.attn_tp_size)


@dataclass
class Registration:
    peer: InstanceDescriptor
    dp_rank: int
    pages: list[int]
    arrived: float
    at: float = field(default_factory=time.perf_counter)


@dataclass
class PrefillRoom:
    rid: str
    room: int
    state: str = "computing"  # computing | waiting | transferring
    key: str | None = None
    deadline: float = float("inf")
    registration: Registration | None = None
    group: int = 0
    """The DP group that computes it (known once it streams)."""
    streamed_pages: int = 0
    """Pages already pushed while the prompt was computed (streaming)."""
    stream_keys: list[str] = field(default_factory=list)
    """Pages kept when the request was preempted while an agent was still sending some of
    them: freed once every part has gone."""


class PrefillSide:
    def __init__(
        self,
        engine: Engine,
        manager: TransferManager,
        config: ServerConfig,
        metrics: InstanceMetrics,
    ):
        self.engine, self.manager, self.config, self.metrics = engine, manager, config, metrics
        self.rooms: dict[str, PrefillRoom] = {}  # by rid
        self.by_room: dict[int, str] = {}
        self.registrations: dict[int, Registration] = {}
        self.cancelled: dict[int, float] = {}
        self.peers: dict[str, InstanceDescriptor] = {}
        self.descriptor = local_descriptor(engine, manager)
        for group in engine.groups:
            group.scheduler.keep_pages_of = self._keep_streamed

    # ---- from the HTTP and bootstrap handlers (run on the engine thread) ---------------------------
    def start(self, req: Request, room: int) -> None:
        if room in self.by_room:
            raise ValueError(f"bootstrap_room {room} is already in use on this prefill instance")
        self.engine.keep_pages.add(req.rid)
        self.engine.submit(req)
        self.rooms[req.rid] = PrefillRoom(req.rid, room)
        self.by_room[room] = req.rid

    def add_peer(self, peer_id: str, peer: InstanceDescriptor) -> None:
        check_compatible(self.descriptor, peer, local_role="prefill", remote_role="decode")
        self.peers[peer_id] = peer

    def register(self, room: int, peer_id: str, dp_rank: int, pages: list[int]) -> None:
        peer = self.peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown decode peer {peer_id!r}: register it first")
        if not 0 <= dp_rank < peer.dp_size:
            raise ValueError(
                f"dp_rank {dp_rank} out of range for a peer with dp_size {peer.dp_size}"
            )
        log.debug("room %d: decode registered %d pages", room, len(pages))
        self.registrations[room] = Registration(peer, dp_rank, pages, time.monotonic())

    def cancel(self, room: int) -> None:
        self.cancelled[room] = time.monotonic()

    # ---- engine loop hooks ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.rooms)

    @property
    def events_socket(self):
        """What the engine thread waits on beside its jobs: the agents' events."""
        return self.manager.sock

    def busy(self, rid: str) -> bool:
        return rid in self.rooms  # the answer waits until the KV has left (or failed to)

    def abort(self, rid: str) -> bool:
        room = self.rooms.get(rid)
        if (
            room is not None
            and room.state == "computing"
            and hold_key(rid, "send") in self.engine.held
        ):
            # computed, not yet polled: end it like a waiting one
            room.key, room.state = hold_key(rid, "send"), "waiting"
        if room is None or room.state == "computing":
            return False  # the engine aborts it; poll() drops the room
        if room.state == "waiting":
            self._end(room, "aborted by the client")
        return True  # a transfer in flight finishes (or fails) on its own and frees the pages then

    def poll(self) -> bool:
        """Transfer events and deadlines; True when a room ended (its answer may go out)."""
        outcomes = self.manager.poll()
        for outcome in outcomes:
            self._on_pushed(outcome)
        now = time.monotonic()
        for room in list(self.rooms.values()):
            if room.registration is None:
                room.registration = self.registrations.pop(room.room, None)
            if room.stream_keys and not self.manager.parts_in_flight.get(room.room):
                self._release_stream_keys(room)
            if room.state == "computing":
                self._stream(room)
                self._after_compute(room, now)
            if room.state == "waiting":
                self._try_push(room, now)
        for table in (self.registrations, self.cancelled):
            for key in [
                k
                for k, v in table.items()
                if now - _arrived(v) > 2 * self.config.bootstrap_timeout_s
            ]:
                del table[key]  # for a room this instance never saw
        return bool(outcomes)

    def _after_compute(self, room: PrefillRoom, now: float) -> None:
        req = self.engine.requests.get(room.rid)
        if req is None or not req.finished:
            return
        key = hold_key(room.rid, "send")
        if key not in self.engine.held:  # aborted or failed before its first token: nothing to send
            self._drop(room)
            return
        room.state, room.key, room.deadline = "waiting", key, now + self.config.bootstrap_timeout_s

    def _stream(self, room: PrefillRoom) -> None:
        """Push the pages the steps read back so far have written, while the rest of the
        prompt computes (the agent sends the messages whose pages are all among them)."""
        reg = room.registration
        req = self.engine.requests.get(room.rid)
        if reg is None or req is None or req.finished or room.room in self.cancelled:
            return
        page_size = self.engine.config.page_size
        if len(reg.pages) != -(-len(req.prompt_ids) // page_size):
            return  # the final push fails the room, naming the sizes
        ready = min(self.engine.written_tokens(req), len(req.prompt_ids)) // page_size
        if ready <= room.streamed_pages:
            return
        pages = self.engine.pages_of(room.rid)[:ready]
        room.group = self.engine.group_of[room.rid]
        timeout = self.config.transfer_timeout_s
        self.manager.push(
            room.room, room.group, reg.peer, reg.dp_rank, pages, reg.pages, timeout, None, ready
        )
        room.streamed_pages = ready

    def _keep_streamed(self, req: Request) -> bool:
        """A request preempted while parts of its room are being sent: keep its pages (an agent
        still reads them) until those parts have gone. The recomputed prompt sends the rest."""
        room = self.rooms.get(req.rid)
        if room is None or not self.manager.parts_in_flight.get(room.room):
            return False
        log.info("room %d: preempted while parts of it are sent; its pages wait", room.room)
        room.stream_keys.append(self.engine.hold(req.rid, f"stream{len(room.stream_keys)}"))
        return True

    def _release_stream_keys(self, room: PrefillRoom) -> None:
        for key in room.stream_keys:
            self.engine.release(key)
        room.stream_keys.clear()

    def _try_push(self, room: PrefillRoom, now: float) -> None:
        if room.room in self.cancelled:
            self._end(room, "the decode instance cancelled the request")
            return
        reg = room.registration
        if reg is None:
            if now > room.deadline:
                self._end(
                    room,
                    f"no decode instance registered pages for bootstrap_room {room.room} within "
                    f"{self.config.bootstrap_timeout_s:.0f}s (bootstrap timeout)",
                )
            return
        req = self.engine.requests[room.rid]
        prompt_pages = -(-len(req.prompt_ids) // self.engine.config.page_size)
        src = self.engine.held_pages(room.key)[
            :prompt_pages
        ]  # past the prompt: the drafts' own scratch
        if len(src) != len(reg.pages):
            self._end(
                room,
                f"the decode registered {len(reg.pages)} pages for a prompt of {len(src)} pages",
            )
            return
        group, _ = self.engine.held[room.key]
        log.debug(
            "room %d: pushing %d pages to decode dp group %d", room.room, len(src), reg.dp_rank
        )
        aux = _aux(req)
        aux["timeline"] = {
            "arrival": req.arrival_time,
            "computed": req.first_token_time,
            "registered": reg.at,
            "push": time.perf_counter(),
        }
        aux["streamed_pages"] = room.streamed_pages
        self.manager.push(
            room.room,
            group,
            reg.peer,
            reg.dp_rank,
            src,
            reg.pages,
            self.config.transfer_timeout_s,
            msgpack.packb(aux),
        )
        room.state = "transferring"

    def _on_pushed(self, outcome: RoomOutcome) -> None:
        rid = self.by_room.get(outcome.room)
        room = self.rooms.get(rid) if rid else None
        if room is None:
            return
        self.metrics.transfer(outcome.ok, outcome.bytes, outcome.seconds)
        req = self.engine.requests.get(rid)
        if req is not None:
            req.extra_meta["kv_transfer"] = {
                "bytes": outcome.bytes,
                "seconds": round(outcome.seconds, 6),
            }
        self._end(room, None if outcome.ok else f"KV transfer failed: {outcome.error}")

    def _end(self, room: PrefillRoom, error: str | None) -> None:
        if room.key in self.engine.held:
            self.engine.release(room.key)
        if room.streamed_pages and room.state != "transferring":
            self._abandon(room, error or "the prefill gave the room up")
        req = self.engine.requests.get(room.rid)
        if error is not None and req is not None:
            log.warning("room %d: %s", room.room, error)
            req.finish("abort", error=error)
        self._drop(room)

    def _abandon(self, room: PrefillRoom, error: str) -> None:
        """A room whose parts went out and that ends without its final push: a final push with
        the error, so the decode stops waiting and the agents forget the room."""
        reg = room.registration
        timeout = self.config.transfer_timeout_s
        self.manager.push(
            room.room, room.group, reg.peer, reg.dp_rank, [], reg.pages, timeout, error=error
        )
        room.state = "transferring"  # its outcome arrives for a room already gone: ignored

    def _drop(self, room: PrefillRoom) -> None:
        if room.streamed_pages and room.state == "computing":  # aborted while streaming
            self._abandon(room, "the prefill request ended before its prompt was computed")
        self._release_stream_keys(room)  # its parts may still read them: the room failed
        self.engine.keep_pages.discard(room.rid)  # aborted before its first token: nothing to keep
        self.rooms.pop(room.rid, None)
        self.by_room.pop(room.room, None)
        self.cancelled.pop(room.room, None)


def _arrived(value) -> float:
    return value.arrived if isinstance(value, Registration) else value


def timeline(req: Request, marks: dict, prefill: dict | None) -> dict:
    """The decode's marks and the prefill's (`prefill_*`), in ms after the decode's arrival.
    Prefill marks from another host (its arrival more than a minute off ours) are made
    relative to the prefill's own arrival."""
    start = req.arrival_time
    out = {k: round((v - start) * 1e3, 3) for k, v in marks.items()}
    prefill = {k: v for k, v in (prefill or {}).items() if v is not None}
    base = start
    if abs(prefill.get("arrival", start) - start) > 60:
        base = prefill["arrival"]
    for k, v in prefill.items():
        out["prefill_" + k] = round((v - base) * 1e3, 3)
    return out


def check_carried(req: Request) -> None:
    """The prompt logprobs a prefill sends ride in the room's control record (`CTRL_BYTES`):
    refuse a request whose would not fit (an estimate of msgpack's size, with room to spare)."""
    if req.params.input_logprobs_from is None:
        return
    rows = len(req.input_logprobs)
    size = rows * (10 + 16 * req.params.top_logprobs_num)
    if size > CTRL_BYTES * 3 // 4:
        raise ValueError(
            f"logprob_start_len: {rows} prompt logprobs (top {req.params.top_logprobs_num}) "
            "are more than a prefill/decode pair carries; start them later in the prompt"
        )


def _aux(req: Request) -> dict:
    aux = {"token": req.output_ids[0]}
    if req.draft_tokens:  # the draft's proposals after the prompt: the decode verifies them first
        aux["draft"] = list(req.draft_tokens)
        aux["draft_parents"] = list(req.draft_parents)
    if req.params.return_logprob and req.token_logprobs:
        aux["logprob"] = req.token_logprobs[0]
        aux["top"] = [list(x) for x in req.top_logprobs[0]]
    if req.params.input_logprobs_from is not None:
        aux["input"] = list(req.input_logprobs)
        aux["input_top"] = [[list(x) for x in top] for top in req.input_top_logprobs]
    return aux


class PrefillLink(Protocol):
    """The decode's line to the prefill's bootstrap server; calls return at once (work goes async)."""

    def register(self, room: int, dp_rank: int, pages: list[int]) -> None: ...

    def cancel(self, room: int) -> None: ...


@dataclass
class DecodeRoom:
    rid: str
    room: int
    peer: InstanceDescriptor
    link: "PrefillLink"  # tells the prefill (from the asyncio side) where to send, or to give up
    state: str = "bootstrapping"  # bootstrapping | transferring | quarantined
    deadline: float = float("inf")
    group: int = 0
    key: str | None = None
    registered_at: float = 0.0


class DecodeSide:
    def __init__(
        self,
        engine: Engine,
        manager: TransferManager,
        config: ServerConfig,
        metrics: InstanceMetrics,
    ):
        self.engine, self.manager, self.config, self.metrics = engine, manager, config, metrics
        self.rooms: dict[str, DecodeRoom] = {}
        self.by_room: dict[int, str] = {}
        self.descriptor = local_descriptor(engine, manager)

    def start(self, req: Request, room: int, peer: InstanceDescriptor, link: "PrefillLink") -> None:
        if room in self.by_room:
            raise ValueError(f"bootstrap_room {room} is already in use on this decode instance")
        self.rooms[req.rid] = DecodeRoom(
            req.rid, room, peer, link, deadline=time.monotonic() + self.config.prealloc_timeout_s
        )
        self.by_room[room] = req.rid
        self.engine.track(req)  # visible to the stream; pages come in poll()

    @property
    def has_work(self) -> bool:
        return bool(self.rooms)

    @property
    def events_socket(self):
        return self.manager.sock

    def busy(self, rid: str) -> bool:
        return False  # a failed room's answer goes out at once; its pages wait in quarantine

    def abort(self, rid: str) -> bool:
        room = self.rooms.get(rid)
        if room is None:
            return False
        self.fail(rid, "aborted by the client")
        return True

    def fail(self, rid: str, error: str) -> None:
        room = self.rooms.get(rid)
        if room is None or room.state == "quarantined":
            return
        req = self.engine.requests[rid]
        room.link.cancel(room.room)
        if room.state == "bootstrapping":
            self._drop(room)
        else:  # receives are posted: settle them before the pages go back
            self.manager.cancel(room.room, room.group)
            room.key, room.state = self.engine.hold(rid, "recv"), "quarantined"
            room.deadline = time.monotonic() + 30
        if not req.finished:
            log.warning("room %d: %s", room.room, error)
            req.finish("abort", error=error)

    def poll(self) -> bool:
        """Transfer events and deadlines; True when a request joined the batch or failed."""
        outcomes = self.manager.poll()
        for outcome in outcomes:
            self._on_received(outcome)
        now = time.monotonic()
        for room in list(self.rooms.values()):
            if room.state == "bootstrapping":
                self._try_prealloc(room, now)
            elif room.state == "transferring" and now > room.deadline:
                self.fail(
                    room.rid,
                    f"the KV of bootstrap_room {room.room} did not arrive within "
                    f"{self.config.transfer_timeout_s:.0f}s",
                )
            elif room.state == "quarantined" and now > room.deadline:
                log.error("room %d: receives never settled; its pages stay out of use", room.room)
                self._drop(room)
        return bool(outcomes)

    def _try_prealloc(self, room: DecodeRoom, now: float) -> None:
        req = self.engine.requests[room.rid]
        pages = self.engine.prealloc(req)
        if pages is None:
            if now > room.deadline:
                self.fail(
                    room.rid,
                    f"no free KV pages for a {len(req.prompt_ids)}-token prompt within "
                    f"{self.config.prealloc_timeout_s:.0f}s",
                )
            return
        room.group = self.engine.group_of[room.rid]
        self.manager.expect(room.room, room.group, room.peer, pages, self.config.transfer_timeout_s)
        room.state, room.deadline = "transferring", now + self.config.transfer_timeout_s + 15
        room.link.register(room.room, room.group, pages)
        room.registered_at = time.perf_counter()

    def _on_received(self, outcome: RoomOutcome) -> None:
        rid = self.by_room.get(outcome.room)
        room = self.rooms.get(rid) if rid else None
        if room is None:
            return
        if room.state != "quarantined":
            self.metrics.transfer(outcome.ok, outcome.bytes, outcome.seconds)
            req = self.engine.requests[rid]
            req.extra_meta["kv_transfer"] = {
                "bytes": outcome.bytes,
                "seconds": round(outcome.seconds, 6),
            }
            if outcome.ok and outcome.payload:
                self._drop(room)
                aux = msgpack.unpackb(outcome.payload)
                received = time.perf_counter()
                if "input" in aux:
                    req.input_logprobs = list(aux["input"])
                    req.input_top_logprobs = [[tuple(x) for x in t] for t in aux["input_top"]]
                self.engine.join_prefilled(
                    rid,
                    int(aux["token"]),
                    aux.get("logprob"),
                    aux.get("top"),
                    aux.get("draft"),
                    aux.get("draft_parents"),
                )
                streamed = aux.get("streamed_pages", 0)
                req.extra_meta["kv_transfer"]["streamed_pages"] = streamed
                marks = {"registered": room.registered_at, "received": received}
                marks["joined"] = time.perf_counter()
                req.extra_meta["pd_timeline_ms"] = timeline(req, marks, aux.get("timeline"))
                return
            req.finish(
                "abort",
                error=f"KV transfer failed: {outcome.error or 'no first token from the prefill'}",
            )
            room.key = self.engine.hold(rid, "recv")
        # quarantined or failed: the pages go back only once no receive can land
        if outcome.settled:
            self.engine.release(room.key)
        else:
            log.error("room %d: receives never settled; its pages stay out of use", room.room)
        self._drop(room)

    def _drop(self, room: DecodeRoom) -> None:
        self.rooms.pop(room.rid, None)
        self.by_room.pop(room.room, None)
