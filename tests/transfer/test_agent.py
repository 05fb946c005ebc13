"""Transfer agents in their own processes, driven by the front's TransferManager, over real UCX:
the exact bytes of scattered pages land where the decode wants them (head slicing either way,
pipeline stages with other layer partitions on the two sides), rooms
started together on a fresh pair share one connection, and a decode agent whose room fails after its
receives were posted settles them first, so a late sender writes nothing into the pages."""

from __future__ import annotations

import time

import pytest
import torch

from dserve.memory.kv_pool import KVLayout
from dserve.runtime.worker import rank_processes
from dserve.transfer.mapping import held_heads

pytest.importorskip("ucxx")  # the transfer stack (ucxx, pyzmq) is not on every GPU host
pytest.importorskip("zmq")
from dserve.transfer.commands import Transfer  # noqa: E402
from dserve.transfer.manager import TransferManager  # noqa: E402

HEADS, LAYERS, PAGE, DIM, PAGES = 4, 3, 4, 8, 64


def layout(kind: str, tp: int, layers: int = LAYERS) -> KVLayout:
    if kind == "mla":
        return KVLayout("mla", layers, PAGE, torch.float32, latent_dim=DIM * 2, kv_lora_rank=DIM)
    n = len(held_heads(0, tp, HEADS))
    return KVLayout(
        "mha", layers, PAGE, torch.float32, num_kv_heads=n, head_dim=DIM, v_head_dim=DIM // 2
    )


def stage_ranges(stages: list[int]) -> list[range]:
    """Each stage's layers for a partition such as [1, 2]."""
    firsts = [sum(stages[:i]) for i in range(len(stages))]
    return [range(f, f + n) for f, n in zip(firsts, stages)]


def global_values(kind: str) -> list[list[torch.Tensor]]:
    """Every layer buffer as if one rank held all heads (the prefill ranks' pages are slices of it)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(DIM * 2,)] if kind == "mla" else [(HEADS, DIM), (HEADS, DIM // 2)]
    return [[torch.randn(PAGES, PAGE, *s, generator=gen) for s in shapes] for _ in range(LAYERS)]


def rank_process(
    front: str,
    kind: str,
    rank: int,
    tp: int,
    prefill: bool,
    dump: str,
    break_settle: bool,
    message_pages: int,
    stage: int,
    layers: range,
) -> None:
    from dserve.memory.kv_pool import KVPool
    from dserve.transfer.agent import Placement, TransferAgent
    from dserve.transfer.descriptor import PoolDescriptor

    if break_settle:  # the room fails after its receives were posted, before any arrived

        async def broken(self, room, state, tasks, timeout_s):
            raise RuntimeError("broken on purpose after posting")

        TransferAgent._wait_receives = broken
    lay = layout(kind, tp, len(layers))
    pool = KVPool(lay, PAGES, "cpu")
    heads = held_heads(rank, tp, HEADS) if kind == "mha" else []
    if prefill:
        values = global_values(kind)[layers.start : layers.stop]
        for layer, full_layer in zip(pool.buffers, values):
            for buf, full in zip(layer, full_layer):
                buf.copy_(full[:, :, heads] if kind == "mha" else full)
    desc = PoolDescriptor.from_layout(
        "target",
        lay,
        HEADS if kind == "mha" else 0,
        heads,
        message_pages,
        first_layer=layers.start,
        model_layers=LAYERS,
    )
    agent = TransferAgent(front, Placement(0, rank, tp, stage), [(desc, pool)])
    agent.thread.join()
    torch.save(pool.pages, dump)


class Side:
    def __init__(
        self,
        kind: str,
        tp: int,
        prefill: bool,
        tmp_path,
        break_settle: bool = False,
        message_pages: int = 0,
        stages: tuple[int, ...] = (LAYERS,),
    ):
        """`stages`: layers per pipeline stage; each stage has `tp` ranks."""
        self.manager = TransferManager()
        self.ranges = stage_ranges(list(stages))
        self.slots = [(s, r) for s in range(len(stages)) for r in range(tp)]
        side = "p" if prefill else "d"
        self.dumps = [str(tmp_path / f"{side}{s}-{r}.pt") for s, r in self.slots]
        ctx = rank_processes()  # as the engine starts its ranks
        self.procs = []
        for (stage, r), dump in zip(self.slots, self.dumps):
            args = (self.manager.address, kind, r, tp, prefill, dump)
            args += (break_settle, message_pages, stage, self.ranges[stage])
            self.procs.append(ctx.Process(target=rank_process, daemon=True, args=args))
        for p in self.procs:
            p.start()
        self.manager.wait_for_agents(len(self.slots))
        self.desc = self.manager.descriptor({}, 1, tp)

    def pages(self) -> list[torch.Tensor]:
        """Each rank's pages (in slot order), after its agent stopped."""
        self.manager.close()
        for p in self.procs:
            p.join(30)
        return [torch.load(d) for d in self.dumps]


def outcomes(sides: list[Side], count: int, timeout: float = 60) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        for s in sides:
            got += s.manager.poll(5)
    assert len(got) == count, f"only {len(got)} of {count} room outcomes arrived"
    return got


def expected_pages(
    kind: str, rank: int, tp: int, src: list[int], dst: list[int], received, layers: range
) -> None:
    """Check the decode rank's `received` pages hold the global values of its heads and layers,
    page by page."""
    from dserve.memory.kv_pool import KVPool

    pool = KVPool(layout(kind, tp, len(layers)), PAGES, "cpu")
    pool.pages.copy_(received)
    heads = held_heads(rank, tp, HEADS) if kind == "mha" else slice(None)
    held = global_values(kind)[layers.start : layers.stop]
    for layer, values in zip(pool.buffers, held):
        for buf, full in zip(layer, values):
            want = full[src][:, :, heads] if kind == "mha" else full[src]
            torch.testing.assert_close(buf[dst], want, rtol=0, atol=0)


SHAPES = [  # kind, prefill tp, decode tp, decode message_pages, prefill stages, decode stages
    ("mha", 1, 2, 0, (3,), (3,)),
    ("mha", 2, 1, 2, (3,), (3,)),
    ("mla", 2, 2, 0, (3,), (3,)),
    ("mla", 1, 1, 2, (3,), (3,)),
    ("mla", 2, 1, 0, (3,), (1, 2)),  # one prefill stage feeds two decode stages
    ("mla", 1, 2, 2, (2, 1), (1, 2)),  # partitions that cut each other
    ("mha", 2, 1, 0, (1, 2), (2, 1)),  # head slices of layer slices
]


@pytest.mark.parametrize("kind,prefill_tp,decode_tp,message_pages,p_stages,d_stages", SHAPES)
def test_scattered_pages_arrive_exactly(
    kind, prefill_tp, decode_tp, message_pages, p_stages, d_stages, tmp_path
):
    """`message_pages` 2: the decode takes runs in pieces of at most two pages. With pipeline
    stages each decode rank's layers come from the prefill stages that hold them."""
    prefill = Side(kind, prefill_tp, True, tmp_path, stages=p_stages)
    decode = Side(kind, decode_tp, False, tmp_path, message_pages=message_pages, stages=d_stages)
    gen = torch.Generator().manual_seed(1)
    rooms = {}  # four rooms at once on a pair that has not connected yet
    order = torch.randperm(PAGES, generator=gen).tolist()
    for i, room in enumerate(range(11, 15)):
        src = torch.randperm(PAGES, generator=gen)[:5].tolist()
        # a run and scattered pages
        dst = sorted(order[i * 8 : i * 8 + 3]) + order[i * 8 + 3 : i * 8 + 5]
        rooms[room] = (src, dst)
        decode.manager.expect(room, 0, prefill.desc, dst, 30)
        prefill.manager.push(room, 0, decode.desc, 0, src, dst, 30, bytes([room]))
    done = outcomes([prefill, decode], 2 * len(rooms))
    assert all(o.ok for o in done), [o.error for o in done if not o.ok]
    received = [o for o in done if o.transfer is Transfer.RECEIVE]
    assert {o.payload[0] for o in received} == set(rooms)
    pushed = {o.room: o for o in done if o.transfer is Transfer.PUSH}
    for o in done:  # the agents' timestamps (one clock on a host) give each room's transfer time
        assert 0 < o.started <= o.finished
        if o.transfer is Transfer.RECEIVE:
            assert o.finished > pushed[o.room].started
    received = decode.pages()
    prefill.pages()
    for (stage, rank), pages in zip(decode.slots, received):
        for src, dst in rooms.values():
            expected_pages(kind, rank, decode_tp, src, dst, pages, decode.ranges[stage])


def test_failed_room_settles_its_receives_before_reporting(tmp_path):
    prefill, decode = (
        Side("mha", 1, True, tmp_path),
        Side("mha", 1, False, tmp_path, break_settle=True),
    )
    decode.manager.expect(7, 0, prefill.desc, [3, 4, 9], 30)
    (failed,) = outcomes([decode], 1)
    assert not failed.ok and "broken on purpose" in failed.error
    assert failed.settled  # the posted receives were completed (cancelled) before the report
    prefill.manager.push(7, 0, decode.desc, 0, [0, 1, 2], [3, 4, 9], 2, b"1")
    outcomes([prefill], 1)  # sent eagerly (ok) or not taken (timed out): either way nothing lands
    assert not decode.pages()[0].any(), "a late message wrote into pages the decode had given back"
    prefill.pages()
