"""What the two halves of a disaggregated pair share: the connector base, the handoff and the
timeline.

A prefill instance's `PrefillConnector` (`pd_prefill.py`) and a decode instance's
`DecodeConnector` (`pd_decode.py`) are the engine's `KVConnector` (`connector.py`) for their
role, each a room state machine per request that the engine thread polls between steps. The
prefill sends a room's pages and, in the control message, a `Handoff`: the first token and what
came with it (`connector.Prefilled`), the prefill's marks of the room's timeline and how many
pages left early (KV streaming).

Every wait has a deadline that ends the request with an error naming what did not happen.

Each decode answer's meta carries `pd_timeline_ms`: when (ms after the decode got the request)
the decode posted its receives and registered the room (`registered`), the prefill got the
request (`prefill_arrival`), computed its first token (`prefill_computed`), got the registration
(`prefill_registered`: its bootstrap server did) and started the push (`prefill_push`), the
decode's agents had every page (`pages_arrived`), the decode's engine thread heard of it
(`received`) and joined the first token (`joined`), handed it to the HTTP thread (`published`)
and that thread wrote it to the client (`sent`, a streamed answer's). Both instances read
`time.perf_counter`, the host's monotonic clock: on two hosts the prefill's marks are offsets from
its own arrival instead (`prefill_*` keys are then relative to it). The answer's `arrival_s` (every
answer has one) is the decode's arrival on that clock, so a client on the same host can place
its own marks (bench.pd_overhead).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import msgpack

from dserve.models.config import ModelConfig
from dserve.runtime.connector import KVConnector, Prefilled
from dserve.runtime.metrics import InstanceMetrics
from dserve.runtime.protocol import BadRequest
from dserve.runtime.server_config import ServerConfig
from dserve.scheduler.request import Request
from dserve.transfer.descriptor import InstanceDescriptor
from dserve.transfer.manager import RoomOutcome, TransferManager
from dserve.transfer.messages import CTRL_BYTES

log = logging.getLogger("dserve.pd")


@dataclass(frozen=True)
class PrefillMarks:
    """When (perf_counter, the prefill's host) the prefill got the request, computed its first
    token, got the decode's registration of the room and started the push."""

    arrival: float
    computed: float | None
    registered: float
    push: float


@dataclass(frozen=True)
class Handoff:
    """What a prefill sends its decode with a room's pages (the control message's payload)."""

    prefilled: Prefilled
    marks: PrefillMarks
    streamed_pages: int = 0
    """Pages that left while the prompt was computed (KV streaming)."""

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, raw: bytes) -> Handoff:
        body = msgpack.unpackb(raw)
        prefilled = Prefilled(**body["prefilled"])
        return cls(prefilled, PrefillMarks(**body["marks"]), body["streamed_pages"])


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


def timeline(req: Request, marks: dict, prefill: PrefillMarks | None) -> dict:
    """The decode's marks and the prefill's (`prefill_*`), in ms after the decode's arrival.
    Prefill marks from another host (its arrival more than a minute off ours) are made
    relative to the prefill's own arrival."""
    start = req.arrival_time
    out = {k: round((v - start) * 1e3, 3) for k, v in marks.items()}
    theirs = asdict(prefill) if prefill is not None else {}
    theirs = {k: v for k, v in theirs.items() if v is not None}
    base = start
    if abs(theirs.get("arrival", start) - start) > 60:
        base = theirs["arrival"]
    for k, v in theirs.items():
        out["prefill_" + k] = round((v - base) * 1e3, 3)
    return out


def mark(req: Request, name: str) -> None:
    """Add `name` (now) to `req`'s timeline, once, if it has one (a disaggregated decode's)."""
    line = req.extra_meta.get("pd_timeline_ms")
    if line is not None and name not in line:
        line[name] = round((time.perf_counter() - req.arrival_time) * 1e3, 3)


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


class PDConnector(KVConnector):
    """What both roles' connectors do alike: the rooms by request and by room id, the local
    descriptor, the agents' events socket, the bootstrap fields every body must carry."""

    role = ""  # "prefill" or "decode", for messages

    def __init__(
        self,
        engine,
        manager: TransferManager,
        config: ServerConfig,
        metrics: InstanceMetrics,
    ):
        super().__init__(engine)
        self.manager, self.config, self.metrics = manager, config, metrics
        self.rooms: dict = {}  # by rid
        self.by_room: dict[int, str] = {}  # room id -> rid
        identity = model_identity(engine.model_config)
        c = engine.config
        self.descriptor: InstanceDescriptor = manager.descriptor(
            identity, c.dp_size, c.attn_tp_size
        )

    @property
    def has_work(self) -> bool:
        return bool(self.rooms)

    @property
    def events_socket(self):
        return self.manager.sock

    def check_bootstrap(self, bootstrap) -> None:
        if bootstrap is None:
            raise BadRequest(
                f"a {self.role} instance serves requests sent through `dserve router` "
                "(bootstrap_host, bootstrap_port and bootstrap_room are required)"
            )

    def _claim(self, room_id: int, rid: str) -> None:
        """Take room id `room_id` for request `rid` (ValueError when it is taken)."""
        if room_id in self.by_room:
            raise ValueError(
                f"bootstrap_room {room_id} is already in use on this {self.role} instance"
            )
        self.by_room[room_id] = rid

    def poll(self) -> bool:
        """Transfer events, then deadlines; True when a room ended or joined (its answer may
        go out)."""
        outcomes = self.manager.poll()
        for outcome in outcomes:
            rid = self.by_room.get(outcome.room)
            room = self.rooms.get(rid) if rid else None
            if room is not None:  # else one already gone
                self._on_outcome(room, outcome)
        self._tick(time.perf_counter())
        return bool(outcomes)

    def _on_outcome(self, room, outcome: RoomOutcome) -> None:
        """A room's pages were pushed or received (or failed to be)."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """Each room's next move and deadline."""
        raise NotImplementedError

    def _record(self, req: Request, outcome: RoomOutcome) -> None:
        """A room's transfer in the metrics and the request's meta."""
        self.metrics.transfer(outcome.ok, outcome.bytes, outcome.seconds)
        req.extra_meta["kv_transfer"] = {
            "bytes": outcome.bytes,
            "seconds": round(outcome.seconds, 6),
        }

    def _forget_room(self, rid: str, room_id: int) -> None:
        self.rooms.pop(rid, None)
        self.by_room.pop(room_id, None)
