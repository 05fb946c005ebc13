"""The decode side of a rank's transfer agent: receiving a room's pages from the prefill ranks.

`Expect` posts every receive of the room at once, straight into its pages, or into a staging
buffer when only a head or layer slice of a page arrives (scattered into the pages once all
arrived). The room is reported done once every receive completed and every prefill rank's
control message said success. `Cancel`, a timeout or a failure completes the receives still
posted with empty messages the agent sends itself, so no late byte can land in pages that are
then freed: the report says whether they all settled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from dserve.transfer.commands import Expect, RoomReport, Transfer
from dserve.transfer.messages import CTRL_BYTES, Control, Message, ctrl_tag
from dserve.transfer.sending import as_ucx_buffer, layer_columns

log = logging.getLogger("dserve.transfer")


@dataclass
class RoomReceives:
    """A decode room's receives while they are posted."""

    tags: set[int]  # those not completed yet
    cancelled: bool = False
    sender_error: str | None = None
    payload: bytes | None = None


class Receiving:
    """The decode half of `TransferAgent` (a mixin: it uses the agent's pools, endpoints and
    message helpers)."""

    def _destination(self, msg: Message) -> tuple[torch.Tensor, list | None]:
        """Where to receive: the pages themselves, or a staging buffer and the head- or
        layer-slice views it scatters into once the room arrived."""
        pool = self.pools[msg.pool][1]
        first, n = msg.dst_pages
        pages = slice(first, first + n)
        layers, whole = self._layers(msg)
        if msg.dst_heads is None and whole:
            return pool.pages[pages], None
        if msg.dst_heads is None:
            views = [pool.pages[pages, layer_columns(pool, layers)]]
        else:
            h0, hn = msg.dst_heads
            views = [buf[pages, :, h0 : h0 + hn] for layer in layers for buf in pool.buffers[layer]]
        size = sum(v[0].numel() for v in views)
        staging = torch.empty((n, size), dtype=pool.pages.dtype, device=pool.device)
        return staging, views

    async def _expect(self, command: Expect, arrived: float) -> None:
        import ucxx

        room = command.room
        recvs, scatters = self._receive_buffers(command)
        state = RoomReceives({tag for _, tag, _ in recvs})
        self.rooms[room] = state

        async def one(tag, buffer):
            if isinstance(buffer, torch.Tensor):
                await ucxx.recv(as_ucx_buffer(buffer), tag)
            else:
                await ucxx.recv(buffer, tag)
            state.tags.discard(tag)

        async def ctrl(p, tag, buffer):
            await one(tag, buffer)
            if not buffer[:4].any():
                return  # completed empty by a cancel
            control = Control.unpack(buffer.tobytes())
            state.payload = state.payload or control.payload
            # its data will not come: stop waiting
            if not control.ok and state.sender_error is None:
                state.sender_error = f"prefill rank {p}: {control.error}"
                await self._cancel(room)

        tasks = []
        for p, tag, buffer in recvs:
            receive = one(tag, buffer) if p is None else ctrl(p, tag, buffer)
            tasks.append(asyncio.ensure_future(receive))
        posted = time.perf_counter()
        error, payload, received = None, None, 0
        try:
            error = await self._wait_receives(room, state, tasks, command.timeout_s)
            error = state.sender_error or error
            payload = state.payload
            if error is None:
                self._scatter_staged(scatters)
                received = sum(_nbytes(b) for _, _, b in recvs if isinstance(b, torch.Tensor))
        except Exception as e:  # noqa: BLE001 - the room fails; its receives are settled below first
            log.exception("room %d: receiving failed", room)
            error = f"{type(e).__name__}: {e}"
        finally:  # every way out: no receive may still be posted when the room is reported
            settled = await self._complete_receives(room, tasks)
            self.rooms.pop(room, None)
        done = time.perf_counter()
        log.debug(
            "room %d expect timeline: command %.6f, posted +%.3f ms, arrived +%.3f ms",
            room,
            arrived,
            (posted - arrived) * 1e3,
            (done - arrived) * 1e3,
        )
        report = RoomReport(
            room,
            Transfer.RECEIVE,
            error is None,
            error,
            payload,
            received,
            settled,
            started=arrived,
            finished=done,
        )
        await self._emit(report)

    def _receive_buffers(self, command: Expect) -> tuple[list, list]:
        """Where each receive of the room lands: (sending prefill rank for a control message,
        else None; tag; buffer), and (staging buffer, page views) for each staged message."""
        room, me = command.room, self.where.slot
        recvs, scatters = [], []
        routes = [r for pool_routes in command.routes for r in pool_routes]
        senders = {r.prefill_rank for r in routes if r.decode_rank == me}
        for p in sorted(senders):
            for r in self._pair_routes(command, p, me):
                for msg in self._messages(command, r):
                    target, scatter_to = self._receive_into(msg)
                    recvs.append((None, msg.tag, target))
                    if scatter_to is not None:
                        scatters.append((target, scatter_to))
            ctrl_buffer = np.zeros(CTRL_BYTES, dtype=np.uint8)
            recvs.append((p, ctrl_tag(room, p, me), ctrl_buffer))
        return recvs, scatters

    def _receive_into(self, msg: Message) -> tuple[torch.Tensor, list | None]:
        """`_destination`, its staging buffer made on the agent's stream (never memory of an
        in-flight step)."""
        if msg.dst_heads is None:
            return self._destination(msg)
        with self._own_stream():
            return self._destination(msg)

    def _scatter_staged(self, scatters: list) -> None:
        """Staged messages into their pages, before the room is reported (staging is freed)."""
        if not scatters:
            return
        with self._own_stream():
            for staged, views in scatters:
                _scatter(staged, views)
        self._own_stream_done()

    async def _wait_receives(
        self, room: int, state: RoomReceives, tasks: list, timeout_s: float
    ) -> str | None:
        """Wait for every receive of the room (those left after a timeout are cancelled by
        `_complete_receives`). The first error, if any."""
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        error = next(
            (f"receive failed: {t.exception()}" for t in done if t.exception() is not None), None
        )
        if pending:
            error = error or f"KV of room {room} did not arrive within {timeout_s:.0f}s"
        if state.cancelled and error is None:
            error = "the request was cancelled"
        return error

    async def _complete_receives(self, room: int, tasks: list) -> bool:
        """Cancel the room's receives still posted and wait for them; True once none of them can
        still write into its pages."""
        if all(t.done() for t in tasks):
            return True
        try:
            await self._cancel(room)
            left = [
                t for t in tasks if not t.done()
            ]  # the cancel may already have completed them all
            if left:
                await asyncio.wait(left, timeout=10)
        except Exception:  # noqa: BLE001 - reported as unsettled: the decode keeps the pages out of use
            log.exception("room %d: cancelling its receives failed", room)
        return all(t.done() for t in tasks)

    async def _cancel(self, room: int) -> None:
        state = self.rooms.get(room)
        if state is None:
            return
        state.cancelled = True
        ep = await self._endpoint(self.address)
        empty = np.zeros(0, dtype=np.uint8)
        for tag in list(state.tags):
            await ep.send(empty, tag=tag, force_tag=True)


def _scatter(staged: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy a staged head slice ([pages, per-page bytes in page-major order]) into its page views."""
    offset = 0
    for v in views:
        size = v[0].numel()
        v.copy_(staged[:, offset : offset + size].view(v.shape))
        offset += size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
