"""A rank's transfer agent: moves KV pages of rooms over UCX (`ucxx`) beside the rank's forward passes.

The agent runs its own asyncio loop in a thread of the rank process. It listens for UCX peers, talks
to its instance's front over one ZMQ DEALER socket (commands in, events out, msgpack), and:

- `Push`   (prefill, `sending.py`) sends the room's messages to each decode rank it has a route
           to, then one control message per decode rank (success or the error, plus the payload);
           a dummy sends only that. A streamed room comes in parts first (the messages whose pages
           the prompt's computed chunks have written), each acknowledged with a `PartSent` event.
- `Expect` (decode, `receiving.py`) posts a receive for every message and control message of the room straight
           into its pages (into a staging buffer when only a head slice of a page arrives), and
           reports the room done once all arrived and every sender said success.
- `Cancel` (decode) completes the room's outstanding receives with empty messages sent to itself,
           so no late byte can land in pages that are then freed; the room reports failed.
The commands and events are `commands.py`'s dataclasses.

Peers reach each other by UCX worker address (exchanged in the rank descriptors through the
bootstrap), not through a listener: making an endpoint is local and needs no handshake. (ucxx's
listener handshake, a stream exchange with a 5 s deadline, timed out for whole runs of connections
between busy rank processes on a loaded 2-core host.) Every wait has a deadline. A failing endpoint
is aborted and forgotten (the next room makes a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from dserve.memory.kv_pool import KVPool
from dserve.transfer.commands import (
    Cancel,
    Expect,
    Hello,
    Push,
    RoomReport,
    Stop,
    Transfer,
    pack,
    unpack,
)
from dserve.transfer.descriptor import PoolDescriptor, RankDescriptor
from dserve.transfer.mapping import Route, held_heads
from dserve.transfer.messages import Message, route_messages
from dserve.transfer.receiving import Receiving, RoomReceives
from dserve.transfer.sending import Sending, Stall, Stream, made

log = logging.getLogger("dserve.transfer")


@dataclass(frozen=True)
class AgentConfig:
    """What a rank needs to start its agent: the front's ZMQ address, the host the instance binds
    to (127.0.0.1 keeps UCX's network transports on the loopback device), and the test-only
    faults: the fraction of rooms whose sending fails on purpose, and how many rooms (the first
    ones) a prefill agent holds unsent for `stall_s` before it reports them (a wedged agent)."""

    front_address: str
    host: str = "127.0.0.1"
    fail_rate: float = 0.0
    # the most MiB one UCX message brings into this rank's pages (0: a whole page run)
    message_mib: int = 0
    # prefill: the most tokens one message carries, so a prompt's pages leave in parts as its
    # chunks are computed (0: whole page runs, sent once the prompt is done)
    stream_tokens: int = 0
    stall_rooms: int = 0
    stall_s: float = 0.0
    # the front's in-process address (inproc://), for an agent in the front's own process
    local_address: str = ""


def start_agent(
    config: AgentConfig,
    pools: list,
    dp_rank: int,
    attn_rank: int,
    attn_tp: int,
    stage: int = 0,
    in_front: bool = False,
) -> "TransferAgent":
    """The rank's agent over its pools (`TransferPool`s, the target's first; the same page ids,
    maybe other layouts). `stage`: the rank's pipeline stage; `in_front`: the rank runs in the
    front's process (its agent reaches the front in-process)."""
    described = []
    for offered in pools:
        p, heads = offered.pool, offered.num_kv_heads
        mha = p.layout.kind == "mha"
        held = held_heads(attn_rank, attn_tp, heads) if mha else []
        desc = PoolDescriptor.from_layout(
            offered.name,
            p.layout,
            heads if mha else 0,
            held,
            message_pages(p.layout, config.message_mib, config.stream_tokens),
            first_layer=offered.layers.start if offered.layers is not None else 0,
            model_layers=offered.total_layers if offered.layers is not None else 0,
        )
        described.append((desc, p))
    where = Placement(dp_rank, attn_rank, attn_tp, stage)
    stall = Stall(config.stall_rooms, config.stall_s)
    front = config.local_address if in_front and config.local_address else config.front_address
    return TransferAgent(front, where, described, config.host, config.fail_rate, stall)


@dataclass(frozen=True)
class Placement:
    """Where an agent's rank sits in its instance."""

    dp_rank: int
    attn_rank: int
    attn_tp: int
    stage: int = 0

    @property
    def slot(self) -> int:
        """The rank's index in its DP group over all stages (its number in routes)."""
        return self.stage * self.attn_tp + self.attn_rank

    @property
    def identity(self) -> bytes:
        return f"{self.dp_rank}-{self.stage}-{self.attn_rank}".encode()


def ucx_settings(cuda: bool, host: str) -> dict:
    """The UCX/ucxx settings an agent runs with, unless the environment sets them. Measured on 2x H200
    (bench/notes/kv-transfer-*.md): a polling progress thread cuts ~0.2 ms off every room for one busy
    core per rank; UCX's own rendezvous choice moves a room (one message) faster than the put_zcopy
    once forced for per-layer messages, so it is left alone. On 127.0.0.1 the network devices are
    the loopback only (shared memory and CUDA IPC are not network devices).

    Python futures: without them ucxx waits for a request by `await asyncio.sleep(0)` until it
    completed, so the agent's thread spins, holding the GIL, while any receive is posted: a
    decode's from the room's registration until the prefill pushed (the whole prefill), in the
    process whose HTTP and engine threads serve requests (a rank of one: the front's own). With
    them the progress thread completes each request's future through ucxx's notifier thread and
    the agent sleeps meanwhile (2-core CPU host, tiny model, 64-token prompts one at a time: TTFT
    p50 21.9 -> 17.5 ms, the pair's CPU time 2.2 -> 1.3 s for 40 requests). Its cost: a
    completion reaches the agent through one more thread (kv-transfer-2026-11-23.md: a 1 GiB
    room between two otherwise idle H200s at 80% of the copy speed, against 87% spinning)."""
    env = {"UCXPY_ENABLE_PYTHON_FUTURE": "1"}
    if cuda:
        env["UCXPY_PROGRESS_MODE"] = "thread-polling"
    if host in ("127.0.0.1", "localhost"):
        env["UCX_NET_DEVICES"] = "lo"
    return env


def message_pages(layout, message_mib: int, stream_tokens: int = 0) -> int:
    """Pages per message for a cap of `message_mib` and of `stream_tokens` (0: no cap)."""
    caps = []
    if message_mib:
        caps.append(max(1, (message_mib << 20) // layout.bytes_per_page))
    if stream_tokens:
        caps.append(max(1, stream_tokens // layout.page_size))
    return min(caps, default=0)


def _stop_notifier(ucxx) -> None:
    """End ucxx's notifier thread (Python futures) with the agent's loop it completes futures on:
    woken at once (it waits up to 1 s for requests), then joined. The ucxx context is the
    process's: one agent per process."""
    ctx = getattr(ucxx.core, "_ctx", None)
    if ctx is None or getattr(ctx, "notifier_thread", None) is None:
        return
    with contextlib.suppress(Exception):  # best effort: the thread is a daemon's, it dies with us
        ctx.worker.stop_request_notifier_thread()
        ucxx.stop_notifier_thread()


class TransferAgent(Sending, Receiving):
    def __init__(
        self,
        front_address: str,
        where: Placement,
        pools: list[tuple[PoolDescriptor, KVPool]],
        host: str = "127.0.0.1",
        fail_rate: float = 0.0,
        stall: Stall | None = None,
    ):
        self.front_address, self.host, self.fail_rate = front_address, host, fail_rate
        self.stall = stall or Stall()
        self.where = where
        self.dp_rank, self.attn_rank = where.dp_rank, where.attn_rank
        self.pools = pools
        self.endpoints: dict[
            str, asyncio.Future
        ] = {}  # peer worker address -> endpoint being made or made
        self.rooms: dict[int, RoomReceives] = {}  # decode: the rooms being received
        self.streams: dict[int, Stream] = {}  # prefill: rooms pushed in parts so far
        self.stream = None  # the agent's own CUDA stream for its copies (made on first use)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"dserve-transfer-{where.identity.decode()}", daemon=True
        )
        self.thread.start()
        self.ready.wait(60)
        if self.error is not None:
            raise RuntimeError(f"transfer agent failed to start: {self.error}") from self.error

    # ---- loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the starter or logged
            self.error = e
            self.ready.set()
            log.exception("transfer agent stopped")

    async def _main(self) -> None:
        import ucxx
        import zmq
        import zmq.asyncio

        cuda = any(pool.device.type == "cuda" for _, pool in self.pools)
        for key, value in ucx_settings(
            cuda, self.host
        ).items():  # read when the context is made, below
            os.environ.setdefault(key, value)  # a user's setting wins
        # makes the context; progress on this loop
        self.address = ucxx.get_worker_address().tobytes().hex()
        if self.front_address.startswith("inproc://"):  # the front's context, in this process
            self.zctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        else:
            self.zctx = zmq.asyncio.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.where.identity)
        self.sock.connect(self.front_address)
        w = self.where
        pools = [d for d, _ in self.pools]
        self.descriptor = RankDescriptor(
            w.dp_rank, w.attn_rank, w.attn_tp, self.address, pools, w.stage
        )
        await self._emit(Hello(self.descriptor))
        self.ready.set()
        tasks = set()
        while True:
            command = unpack(await self.sock.recv())
            # monotonic, comparable across processes: timelines in debug logs
            arrived = time.perf_counter()
            if isinstance(command, Stop):
                break
            task = asyncio.ensure_future(self._dispatch(command, arrived))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for ep in [f.result() for f in self.endpoints.values() if made(f)]:
            ep.abort()
        self.sock.close()
        _stop_notifier(ucxx)

    async def _emit(self, event) -> None:
        if log.isEnabledFor(logging.DEBUG):
            name = type(event).__name__
            log.debug("rank %d/%d: %s %s", self.dp_rank, self.attn_rank, name, event)
        await self.sock.send(pack(event))

    async def _dispatch(self, command, arrived: float) -> None:
        name = type(command).__name__
        log.debug("rank %d/%d: %s room %s", self.dp_rank, self.attn_rank, name, command.room)
        try:
            if isinstance(command, Push):
                await self._push(command, arrived)
            elif isinstance(command, Expect):
                await self._expect(command, arrived)
            elif isinstance(command, Cancel):
                await self._cancel(command.room)
        except Exception as e:  # noqa: BLE001 - a room fails, the agent keeps serving
            log.exception("transfer command %s failed", name)
            push = isinstance(command, Push)
            transfer = Transfer.PUSH if push else Transfer.RECEIVE
            error = f"{type(e).__name__}: {e}"
            # _expect settles its own receives; it fails here before posting any
            await self._emit(RoomReport(command.room, transfer, False, error))

    async def _endpoint(self, address: str):
        """One endpoint per peer, shared by all rooms. Rooms that start together wait on the same
        endpoint: two made at once would leave one unreferenced, and ucxx closing it under its
        in-flight sends resets the peer's receives."""
        import ucxx

        if address not in self.endpoints:
            worker = ucxx.get_ucx_address_from_buffer(bytes.fromhex(address))
            self.endpoints[address] = asyncio.ensure_future(
                ucxx.create_endpoint_from_worker_address(worker)
            )
        making = self.endpoints[address]
        try:
            return await asyncio.shield(making)
        except Exception:
            if self.endpoints.get(address) is making:
                del self.endpoints[address]
            raise

    def _drop_endpoint(self, address: str) -> None:
        making = self.endpoints.pop(address, None)
        if making is not None and made(making):
            making.result().abort()

    # ---- the agent's own copies ---------------------------------------------------------------------
    def _own_stream(self):
        """Run the agent's copies (gathers, staging, scatters) on a CUDA stream of its own: they are not
        ordered behind the rank's forward on the default stream, and memory they allocate comes from
        this stream's blocks, which no in-flight kernel of the rank still uses. A no-op on the CPU."""
        device = self.pools[0][1].device
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self.stream)

    def _own_stream_done(self) -> None:
        """Wait for the agent's copies (UCX reads and writes device memory outside any stream)."""
        if self.stream is not None:
            self.stream.synchronize()

    # ---- messages --------------------------------------------------------------------------------
    def _messages(self, command: Push | Expect, route: Route) -> list[Message]:
        """This pair's messages over every pool (a `Push`'s with their source pages)."""
        out = []
        for i, (desc, _) in enumerate(self.pools):
            if route not in command.routes[i]:
                continue  # nothing of this pool moves on this route
            mine = len(desc.held_heads) if desc.kind == "mha" else 0
            if isinstance(command, Push):
                src_pages = command.src_pages
                src_held, dst_held = mine, command.dst_heads_held[i]
            else:
                src_pages = None
                src_held, dst_held = command.src_heads_held[i], mine
            out += route_messages(
                command.room,
                route,
                i,
                command.dst_pages,
                src_pages,
                src_held,
                dst_held,
                command.message_pages[i],
            )
        return out

    def _layers(self, msg: Message) -> tuple[range, bool]:
        """The pool's own layers that `msg` moves, and whether that is all of them."""
        desc = self.pools[msg.pool][0]
        first, stop = msg.layers
        held = range(first - desc.first_layer, stop - desc.first_layer)
        return held, len(held) == desc.num_layers

    def _pair_routes(self, command: Push | Expect, p: int, d: int) -> list[Route]:
        """Real routes from prefill rank p to decode rank d over all pools (deduplicated)."""
        seen = []
        for pool_routes in command.routes:
            for r in pool_routes:
                if r.prefill_rank == p and r.decode_rank == d and not r.dummy and r not in seen:
                    seen.append(r)
        return seen

    # ---- decode side ----------------------------------------------------------------------------
