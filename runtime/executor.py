"""Where steps run: on one rank in this process, or on rank processes of their own.

The front `submit`s a `StepPlan` and later `collect`s the oldest step's `StepResult`s (one per DP
group); in between it may submit the next plan (overlapped scheduling: a plan that `overlaps`
lets the ranks hold its result back until the next plan is launched). The ranks answer with
tokens, never logits. A rank that dies or fails takes the whole instance down with a message
naming it, within seconds; no rank is left waiting.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import pickle
import time
import zlib
from collections import deque

import torch

from dserve.models.config import ModelConfig
from dserve.models.parallel import split_layers
from dserve.models.registry import resolve
from dserve.runtime.config import EngineConfig
from dserve.runtime.nodes import ControlListener, local_ranks, node_of, open_store
from dserve.step.plan import Settle, StepPlan, StepResult

log = logging.getLogger("dserve.runtime")


class RankFailure(RuntimeError):
    """A rank process died or raised; the instance is shut down."""


class LocalExecutor:
    """One rank, in this process: `submit` launches the step at once, `collect` waits for it."""

    def __init__(self, config: EngineConfig, transfer=None):
        from dserve.runtime.model_runner import ModelRunner
        from dserve.runtime.step_runner import StepRunner

        self.runner = ModelRunner(config)
        self.steps = StepRunner(self.runner)
        self.model_config = self.runner.model_config
        self.num_pages = [self.runner.num_pages]
        self.launched = deque()
        self.agent = None
        if transfer is not None:
            from dserve.transfer.agent import start_agent

            self.agent = start_agent(transfer, self.runner.transfer_pools, 0, 0, 1, in_front=True)

    @property
    def in_flight(self) -> int:
        return len(self.launched)

    def submit(self, plan: StepPlan) -> None:
        self.launched.append(self.steps.launch(plan))

    def collect(self) -> list[StepResult]:
        return [self.steps.finish(self.launched.popleft())]

    def shutdown(self) -> None:
        self.launched.clear()


def validate_parallel(config: EngineConfig) -> ModelConfig:
    """Every size must divide before any weight is read; the message names the numbers."""
    cfg, _ = resolve(config.model_path)
    a, world = config.attn_tp_size, config.tp_size  # within a pipeline stage
    split_layers(cfg.num_hidden_layers, config.pp_size, config.layer_counts)
    checks = [
        (cfg.num_attention_heads, a, "num_attention_heads", "attention ranks (tp_size / dp_size)"),
        (cfg.vocab_size, a, "vocab_size", "attention ranks (tp_size / dp_size)"),
        (cfg.intermediate_size, world, "intermediate_size", "ranks (tp_size)"),
    ]
    if cfg.n_routed_experts:
        checks += [
            (cfg.n_routed_experts, config.ep_size, "n_routed_experts", "ep_size"),
            (
                cfg.moe_intermediate_size,
                world // config.ep_size,
                "moe_intermediate_size",
                "ranks per expert (tp_size / ep_size)",
            ),
            (
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                world,
                "shared expert intermediate size",
                "ranks (tp_size)",
            ),
        ]
    for total, parts, what, by in checks:
        if total % parts:
            raise ValueError(f"{what} = {total} does not divide by {by} = {parts}")
    if cfg.attention_kind == "mha":
        kv = cfg.num_key_value_heads
        if (kv >= a and kv % a) or (kv < a and a % kv):
            raise ValueError(
                f"num_key_value_heads = {kv} and {a} attention ranks: one must divide the other"
            )
    if config.device.startswith("cuda"):
        count = torch.cuda.device_count()
        ranks = config.world_size
        ranks //= config.nnodes  # the GPUs of one host
        if count < ranks:
            what = f"tp_size = {config.tp_size}" + (
                f" x pp_size = {config.pp_size}" if config.pp_size > 1 else ""
            )
            raise ValueError(f"{what} needs {ranks} GPUs; this host has {count}")
    return cfg


def _has_data(conn) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def result_digest(result: StepResult) -> int:
    """What a rank that does not answer says of its step: every rank of an attention group
    computes the same tokens and trees, and the front checks that they did."""
    return zlib.crc32(pickle.dumps(result))


class MultiprocessExecutor:
    def __init__(self, config: EngineConfig, transfer=None):
        self.config = config
        self.model_config = validate_parallel(config)
        # The rendezvous store binds here (on one host: port 0) and lives as long as the
        # executor: no port is picked, released and bound again later by another process.
        self.store = open_store(config, master=True)
        self.conns, self.procs, self.node_links, self.closed = [], [], {}, False
        self.in_flight, self.held = 0, 0
        here = local_ranks(config, 0)
        for rank in here:
            self._spawn(rank, transfer)
        try:
            if here.stop < config.world_size:  # the other nodes' ranks link up through the store
                self._accept(range(here.stop, config.world_size), transfer)
            replies = self._gather(timeout=config.step_timeout_s, what="start-up")
        except BaseException:
            self.shutdown(graceful=False)  # ranks may wait in the rendezvous for the missing
            raise
        self.rank_info = [info for _, info in replies]
        # a DP group's page ids index its pools on every stage: the smallest pool bounds them
        self.num_pages = [
            min(i.num_pages for i in self.rank_info if i.group == g) for g in range(config.dp_size)
        ]
        log.info(
            "%d ranks up (tp=%d, dp=%d, ep=%d); parameter bytes per rank: %s",
            config.world_size,
            config.tp_size,
            config.dp_size,
            config.ep_size,
            [i.parameter_bytes for i in self.rank_info],
        )

    def _spawn(self, rank: int, transfer) -> None:
        from dserve.runtime.worker import rank_processes, worker_main

        ctx = rank_processes()
        parent, child = ctx.Pipe()
        args = (rank, self.config, child, transfer, self.store.port)
        name = f"dserve-rank-{rank}"
        proc = ctx.Process(target=worker_main, args=args, daemon=True, name=name)
        proc.start()
        child.close()
        self.conns.append(parent)
        self.procs.append(proc)

    def _accept(self, ranks: range, transfer) -> None:
        listener = ControlListener(self.config, self.store, transfer)
        try:
            links, self.node_links = listener.accept(ranks)
        finally:
            listener.close()
        self.conns += [links[rank] for rank in ranks]

    def submit(self, plan: StepPlan) -> None:
        self._send(plan)
        self.in_flight += 1
        self.held = 1 if plan.overlaps else 0

    def collect(self) -> list[StepResult]:
        """The oldest step's results, one per DP group."""
        if self.in_flight == self.held:  # the ranks hold it back: ask for it
            self._send(Settle())
            self.held = 0
        replies = [payload for _, payload in self._gather(self.config.step_timeout_s, "step")]
        self.in_flight -= 1
        c = self.config
        a, last = c.attn_tp_size, (c.pp_size - 1) * c.tp_size  # the last stage answers
        leaders = [last + g * a for g in range(c.dp_size)]
        for leader in leaders:
            digest = result_digest(replies[leader])
            for rank in range(leader + 1, leader + a):
                if replies[rank] != digest:
                    self._fail(
                        f"the ranks of an attention group computed different tokens in step "
                        f"{replies[leader].step} (rank {rank} differs from rank {leader})"
                    )
        return [replies[leader] for leader in leaders]

    def _send(self, message) -> None:
        if self.closed:
            raise RankFailure("the instance's ranks are shut down")
        data = pickle.dumps(message)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._dead(rank, "the handover of a step")

    def _gather(self, timeout: float, what: str) -> list[tuple]:
        """One reply from every rank, or RankFailure as soon as any rank dies or reports an
        error. A rank whose pipe closed is dead whether or not its process has been reaped."""
        pending = dict(enumerate(self.conns))
        replies: list = [None] * len(self.conns)
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            ready = mp.connection.wait(list(pending.values()) + list(sentinels), timeout=timeout)
            if not ready:
                self._fail(f"no {what} reply from ranks {sorted(pending)} within {timeout:.0f}s")
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._dead(rank, what)
                if status == "error":
                    self._fail(self._root_cause(rank, payload))
                replies[rank] = (status, payload)
                del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending and not _has_data(self.conns[rank]):
                    self._dead(rank, what)
        return replies

    def _dead(self, rank: int, what: str) -> None:
        if rank >= len(self.procs):  # on another node: its link closed
            node = node_of(self.config, rank)
            self._fail(f"rank {rank} on node {node} died or lost its link during {what}")
        self.procs[rank].join(timeout=1)
        code = self.procs[rank].exitcode
        self._fail(f"rank {rank} died (exit code {code}) during {what}")

    def _root_cause(self, rank: int, error: str) -> str:
        """A rank's error is often a peer's death seen through a broken collective: name the
        dead first."""
        time.sleep(0.2)
        dead = [d for r, d in self._dead_ranks() if r != rank]
        last_line = error.strip().splitlines()[-1]
        if dead:
            return f"{', '.join(dead)}; rank {rank} then failed: {last_line}"
        return error

    def _dead_ranks(self) -> list[tuple[int, str]]:
        """(rank, what happened) for local ranks that exited and remote ones whose link closed."""
        dead = [
            (r, f"rank {r} died (exit code {p.exitcode})")
            for r, p in enumerate(self.procs)
            if not p.is_alive()
        ]
        for r in range(len(self.procs), len(self.conns)):
            try:
                closed = self.conns[r].poll() and self.conns[r].recv() is None
            except (EOFError, OSError):
                closed = True
            if closed:
                node = node_of(self.config, r)
                dead.append((r, f"rank {r} on node {node} died or lost its link"))
        return dead

    def _fail(self, message: str) -> None:
        self.shutdown(graceful=False)  # survivors may sit in a collective with the dead rank
        raise RankFailure(f"{message}; the instance has shut down all its ranks")

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send_bytes(pickle.dumps(None))
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in [*self.conns, *self.node_links.values()]:
            conn.close()  # another node's ranks and the node itself stop when their links close
        self.store = None  # closes the rendezvous port


def make_executor(config: EngineConfig, transfer=None):
    """`transfer` (an AgentConfig) starts a KV transfer agent on every rank."""
    if config.world_size == 1:
        return LocalExecutor(config, transfer)
    return MultiprocessExecutor(config, transfer)
