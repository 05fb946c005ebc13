"""A rank process: joins the instance's torch.distributed groups, loads its shard, then runs every
step the front plans until told to stop. It blocks on its pipe between steps (no busy-wait),
except while a step's tokens are on their way to the host: it then polls the pipe and the step.

Rank r is in pipeline stage `r // tp_size`; its place in the stage, l = r % tp_size, is attention-TP
rank `l % A` of DP group `l // A` (A = tp_size // dp_size). With one stage r = l.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import pickle
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from dserve.models.parallel import ParallelContext, Stage, TPGroup, split_layers
from dserve.runtime.config import EngineConfig

POLL_S = 5e-5
"""While a launched step's tokens are on their way, how long a rank waits on its pipe between
looks at them."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    group: int
    """Its DP group."""
    attn_tp_rank: int
    num_pages: int
    parameter_bytes: int
    parameter_shapes: dict


def build_context(rank: int, config: EngineConfig, num_layers: int) -> ParallelContext:
    """Create every process group (all ranks call new_group in the same order) and this rank's
    view: its stage, and within the stage its attention group, DP group and MLP group."""
    import torch.distributed as dist

    tp, dp, a, pp = config.tp_size, config.dp_size, config.attn_tp_size, config.pp_size
    groups = []
    for s in range(pp):
        base = s * tp
        attn = [dist.new_group(list(range(base + g * a, base + (g + 1) * a))) for g in range(dp)]
        dps = [dist.new_group([base + g * a + i for g in range(dp)]) for i in range(a)]
        mlp = dist.new_group(list(range(base, base + tp))) if pp > 1 else dist.group.WORLD
        groups.append((attn, dps, mlp))
    stage, local = divmod(rank, tp)
    group, attn_rank = divmod(local, a)
    attn, dps, mlp = groups[stage]
    layers = split_layers(num_layers, pp, config.layer_counts)[stage]
    prev_rank = rank - tp if stage > 0 else None
    next_rank = rank + tp if stage < pp - 1 else None
    return ParallelContext(
        attn=TPGroup(attn_rank, a, attn[group]),
        mlp=TPGroup(local, tp, mlp),
        dp=TPGroup(group, dp, dps[attn_rank]),
        ep_size=config.ep_size,
        stage=Stage(stage, pp, layers, prev_rank, next_rank),
    )


def rank_device(config: EngineConfig, rank: int) -> str:
    """A rank's device: the GPU of its index on its node."""
    if not config.device.startswith("cuda"):
        return "cpu"
    return f"cuda:{rank % (config.world_size // config.nnodes)}"


RANK_MODULES = [
    "dserve.runtime.worker",
    "dserve.runtime.model_runner",
    "dserve.runtime.step_runner",
]


def rank_processes():
    """Where rank processes come from: a fork server that imported torch and the rank's modules
    once (`RANK_MODULES`), so a rank starts in a fraction of a second instead of importing them
    again as a spawned process does (seconds of CPU each). The server itself never touches a
    GPU, so its children may, and it leaves when the process that started it does. Ranks see
    the environment the server started with (at this process's first engine of several ranks):
    settings reach them through their `EngineConfig`, not environment changes made later."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_MODULES)
    return ctx


def worker_main(
    rank: int, config: EngineConfig, conn, transfer=None, store_port: int | None = None
) -> None:
    """Rank `rank`: `conn` is its pipe to the front, or None on another node than the front's
    (the rank then links to the front through the rendezvous store at `dist_init_addr`)."""
    import torch.distributed as dist

    from dserve.runtime.nodes import connect_to_front, rendezvous_address

    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    runner = None
    try:
        device = rank_device(config, rank)
        if device == "cpu":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        host, port = rendezvous_address(config)
        store = dist.TCPStore(host, store_port or port, is_master=False, timeout=timeout)
        if conn is None:
            conn, transfer = connect_to_front(store, "rank", rank)
        backend = "nccl" if device != "cpu" else "gloo"
        world = config.world_size
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        from dserve.models.registry import resolve

        ctx = build_context(rank, config, resolve(config.model_path)[0].num_hidden_layers)
        from dserve.runtime.model_runner import ModelRunner
        from dserve.runtime.step_runner import StepRunner

        runner = ModelRunner(config, ctx, device)
        if transfer is not None:  # before "ready": the front finds every agent registered
            from dserve.transfer.agent import start_agent

            where = (ctx.dp.rank, ctx.attn.rank, ctx.attn.size, ctx.stage.index)
            start_agent(transfer, runner.transfer_pools, *where)
        shapes = {name: tuple(p.shape) for name, p in runner.model.named_parameters()}
        info = RankInfo(
            rank, ctx.dp.rank, ctx.attn.rank, runner.num_pages, runner.parameter_bytes, shapes
        )
        conn.send(("ready", info))
        run_steps(StepRunner(runner, ctx.dp.rank), conn, leader=ctx.attn.rank == 0)
    except (EOFError, KeyboardInterrupt):
        pass  # the front went away
    except BaseException:
        with contextlib.suppress(OSError, EOFError, AttributeError):  # no link yet: None
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if runner is not None:
            with contextlib.suppress(RuntimeError):  # a failed device fails this too
                runner.release_graphs()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_steps(steps, conn, leader: bool) -> None:
    """Launch each plan as it arrives, then answer for the steps before it. After a plan that
    overlaps, its own result is held (the device runs it while the front reads the step
    before), and answered as soon as its tokens reach the host while the rank waits for the
    next plan, or after that plan's launch if the plan comes first (the device then always has
    a step queued). So the front never waits for the rank's launch to read a result that was
    ready before it: their host work no longer adds up where it, not the device, sets the pace
    (a 4-layer model at TP 2, 2x H200, runs in both orders: batch 32 3.5-3.6 -> 2.9-3.1 ms a
    step, batch 128 8.1-9.7 -> 5.3-6.0; launching first when a plan finds a step ready gave
    3.4 and 6.4-6.6: bench/notes/session48-h200x2-2026-11-28.md). Answers leave in step
    order."""
    from dserve.runtime.executor import result_digest
    from dserve.step.plan import StepPlan

    launched = deque()

    def answer_oldest() -> None:
        result = steps.finish(launched.popleft())  # None on a stage before the last
        answer = result if leader or result is None else result_digest(result)
        conn.send(("ok", answer))

    def answer_ready() -> None:
        while launched and steps.ready(launched[0]):
            answer_oldest()

    while True:
        while launched and not conn.poll(POLL_S):  # a step on its way: answer it when done
            answer_ready()
        message = pickle.loads(conn.recv_bytes())
        if message is None:
            return
        keep = 0
        if isinstance(message, StepPlan):
            answer_ready()  # before the launch: the front reads it meanwhile
            launched.append(steps.launch(message))
            keep = 1 if message.overlaps else 0
        while len(launched) > keep:
            answer_oldest()
