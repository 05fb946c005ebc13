"""The prefill side of a rank's transfer agent: pushing a room's pages to the decode ranks.

A room goes out in one push (the prompt computed, then every message and one control message
per decode rank) or streamed: parts while the prompt is computed, each sending the messages
whose pages are all written by then (`ready_pages`), then a final push with the rest and the
control message. The decode posted every receive at once (`expect`), so parts need nothing from
it; it counts the room only when every receive completed and every control message said
success, so a room a later part (or the final push) fails never starts decoding.

Every push ends by its `timeout_s` after the agent took it (a final push's wait for the room's
parts included): then a failed send's endpoint is aborted, so the agent reads the room's pages
no more, and the room is reported. The front fails a room whose report is later than that
(`PrefillConnector`'s report deadline).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dserve.transfer.commands import PartSent, Push, RoomReport, Transfer
from dserve.transfer.messages import Control, Message, ctrl_tag

log = logging.getLogger("dserve.transfer")
INJECTED = "transfer failed (injected by transfer_fail_rate)"
STALLED = "held unsent on purpose (transfer_stall_rooms)"


@dataclass
class Stall:
    """TEST ONLY: the agent holds its first `rooms` final pushes unsent and reports each (failed)
    only `seconds` later, as a wedged agent would (the front's report deadline must end them)."""

    rooms: int = 0
    seconds: float = 0.0

    def takes(self) -> bool:
        """Whether this final push is one to hold (counted down)."""
        if self.rooms <= 0:
            return False
        self.rooms -= 1
        return True


@dataclass
class Stream:
    """What a room's pushes have done so far (its parts, then the final push)."""

    started: float
    sent: set[int] = field(default_factory=set)
    """Tags of the messages already sent (or being sent)."""
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    parts: list[asyncio.Future] = field(default_factory=list)


class Sending:
    """The prefill half of `TransferAgent` (a mixin: it uses the agent's pools, endpoints and
    message helpers)."""

    async def _push(self, push: Push, arrived: float) -> None:
        room = push.room
        deadline = time.monotonic() + push.timeout_s
        stream = self.streams.get(room)
        if stream is None:
            stream = self.streams[room] = Stream(arrived)
        if push.ready_pages is not None:  # a part: its errors go with the final push
            part = self._send_part(push, stream, deadline)
            stream.parts.append(asyncio.ensure_future(part))
            return
        del self.streams[room]
        await asyncio.gather(*stream.parts)  # each ends by its own deadline, before this one
        if self.stall.takes():
            await self._stall(room, stream)
            return
        await self._send_all(push, stream, deadline)
        sent = time.perf_counter()
        log.debug("room %d pushed in %.3f ms", room, (sent - stream.started) * 1e3)
        report = RoomReport(
            room,
            Transfer.PUSH,
            ok=not stream.errors,
            error="; ".join(dict.fromkeys(stream.errors)) or None,
            bytes=stream.bytes,
            started=stream.started,
            finished=sent,
        )
        await self._emit(report)

    async def _stall(self, room: int, stream: Stream) -> None:
        """TEST ONLY (`Stall`): send nothing, and report the room failed long after."""
        log.warning("room %d: %s for %.1fs", room, STALLED, self.stall.seconds)
        await asyncio.sleep(self.stall.seconds)
        held = {"started": stream.started, "finished": time.perf_counter()}
        await self._emit(RoomReport(room, Transfer.PUSH, False, STALLED, **held))

    async def _send_part(self, push: Push, stream: Stream, deadline: float) -> None:
        """A part's messages, then `PartSent`: the front may reuse its pages now."""
        await self._send_all(push, stream, deadline)
        await self._emit(PartSent(push.room))

    async def _send_all(self, push: Push, stream: Stream, deadline: float) -> None:
        """This push's messages to every decode rank this rank has a route to.
        No wait for the rank's forwards: the engine pushes pages only after it has read the
        results of every forward that wrote them (a step's outputs reach the host; other TP
        ranks' writes precede collectives those outputs depend on). A device-wide synchronize
        here waited for the rank's next step, already in flight, adding up to a step."""
        me = self.where.slot
        routes = [r for pool_routes in push.routes for r in pool_routes]
        decode_ranks = sorted({r.decode_rank for r in routes if r.prefill_rank == me})
        if len(decode_ranks) == 1:  # the common case, without a task per rank
            await self._push_to(push, decode_ranks[0], deadline, stream)
        else:
            sends = (self._push_to(push, d, deadline, stream) for d in decode_ranks)
            await asyncio.gather(*sends)

    async def _push_to(self, push: Push, d: int, deadline: float, stream: Stream) -> None:
        """This push's messages to decode rank d (and, if final, the control message) in
        flight at once. The control message need not wait for the data: the decode counts a
        room only once every receive completed, so a data send that fails after an "ok"
        still fails the room. Errors go to `stream.errors`."""
        room, me = push.room, self.where.slot
        address = push.dst_ranks[d]
        final = push.ready_pages is None
        left = lambda: max(deadline - time.monotonic(), 0.01)
        marks = [time.perf_counter()]
        try:
            making = self.endpoints.get(address)
            ep = (
                making.result()
                if making is not None and made(making)
                else await asyncio.wait_for(self._endpoint(address), left())
            )
            error = self._failure(push, final)
            data = [] if error or stream.errors else self._data(push, me, d, stream)
            marks.append(time.perf_counter())
            sends = [ep.send(as_ucx_buffer(t), tag=msg.tag, force_tag=True) for msg, t in data]
            if final:
                error = error or (stream.errors[0] if stream.errors else None)
                payload = push.payload if self.attn_rank == 0 else None
                control = Control(error is None, error, payload).pack()
                ctrl = np.frombuffer(control, dtype=np.uint8)
                sends.append(ep.send(ctrl, tag=ctrl_tag(room, me, d), force_tag=True))
            marks.append(time.perf_counter())
            await asyncio.wait_for(asyncio.gather(*sends), left())
            marks.append(time.perf_counter())
            _log_send_marks(room, d, len(sends), marks)
            stream.bytes += sum(t.numel() * t.element_size() for _, t in data)
            if error:
                stream.errors.append(error)
        except Exception as e:  # noqa: BLE001 - the room fails with the reason; the endpoint is redone
            self._drop_endpoint(address)
            reason = (
                "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            )
            stream.errors.append(f"sending to decode rank {d} failed: {reason}")

    def _failure(self, push: Push, final: bool) -> str | None:
        """The error a final push sends instead of data: the prefill's (`push.error`) or the
        test-only injected one (a streamed room's parts have gone out by then)."""
        if not final:
            return None
        if push.error:
            return push.error
        if self.fail_rate > 0 and random.Random(push.room).random() < self.fail_rate:
            return INJECTED
        return None

    def _data(
        self, push: Push, me: int, d: int, stream: Stream
    ) -> list[tuple[Message, torch.Tensor]]:
        """(message, bytes) of those this push sends to decode rank d: not sent yet and, for a
        part, with every page ready. They are claimed in `stream.sent` at once."""
        ready = push.ready_pages
        msgs = [
            msg
            for r in self._pair_routes(push, me, d)
            for msg in self._messages(push, r)
            if msg.tag not in stream.sent and (ready is None or msg.ready(ready))
        ]
        stream.sent.update(msg.tag for msg in msgs)
        if all(self._in_place(msg) for msg in msgs):  # views of whole page runs: no copy
            return [(msg, self._source(msg)) for msg in msgs]
        with self._own_stream():  # gathers of scattered pages or head slices, done first
            data = [(msg, self._source(msg)) for msg in msgs]
        self._own_stream_done()
        return data

    def _in_place(self, msg: Message) -> bool:
        """Whether the message's bytes are a view of consecutive whole pages (no gather)."""
        whole = self._layers(msg)[1]
        return msg.src_heads is None and whole and consecutive(msg.src_pages)

    def _source(self, msg: Message) -> torch.Tensor:
        """The message's bytes: a view of consecutive whole pages, else a gathered copy."""
        pool = self.pools[msg.pool][1]
        first, n = msg.src_pages[0], len(msg.src_pages)
        index = (
            slice(first, first + n)
            if consecutive(msg.src_pages)
            else torch.tensor(msg.src_pages, device=pool.device)
        )
        layers = self._layers(msg)[0]
        if msg.src_heads is None:
            return pool.pages[index][:, layer_columns(pool, layers)].contiguous()
        h0, hn = msg.src_heads
        parts = [
            buf[index][:, :, h0 : h0 + hn].reshape(n, -1)
            for layer in layers
            for buf in pool.buffers[layer]
        ]
        return torch.cat(parts, dim=1)


def consecutive(pages: tuple) -> bool:
    return pages == tuple(range(pages[0], pages[0] + len(pages)))


def layer_columns(pool, layers: range) -> slice:
    """A page's elements that hold `layers` (a page is laid out layer by layer)."""
    per_layer = pool.pages.shape[1] // pool.layout.num_layers
    return slice(layers.start * per_layer, layers.stop * per_layer)


def made(f: asyncio.Future) -> bool:
    """Whether an endpoint future holds a made endpoint."""
    return f.done() and not f.cancelled() and f.exception() is None


def as_ucx_buffer(t: torch.Tensor):
    """ucxx takes device memory through __cuda_array_interface__ and host memory as numpy (bytes, so
    dtypes numpy lacks, such as bfloat16, pass too). `t` must be contiguous: the result aliases it."""
    assert t.is_contiguous()
    return t if t.is_cuda else t.reshape(-1).view(torch.uint8).numpy()


def _log_send_marks(room: int, d: int, sends: int, marks: list[float]) -> None:
    """Debug: where a push to decode rank d spent its time (from taking it to the messages
    ready, posting the sends, their completion), in ms, from `perf_counter` time `marks[0]`
    (comparable with the decode's "expect timeline" on one host)."""
    if log.isEnabledFor(logging.DEBUG):
        steps = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        log.debug(
            "room %d to decode rank %d at %.6f: ready +%.3f, %d sends posted +%.3f, "
            "completed +%.3f ms",
            room,
            d,
            marks[0],
            steps[0],
            sends,
            steps[1],
            steps[2],
        )
