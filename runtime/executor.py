"""Where forward passes run: in this process (one rank) or in spawned rank processes.

`execute(batches)` takes one `ForwardBatch` per DP group (an empty one where a group has nothing
to do: its ranks still join the MoE collectives) and returns each group's logits: on the rank's
device in this process (the front moves only the ids and values it needs), on the host from rank
processes. A rank that dies or fails takes the whole instance down with a message naming it; no
rank is left waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import time

import torch
import torch.distributed as dist

from dserve.attention.backend import ForwardBatch
from dserve.models.config import ModelConfig
from dserve.models.registry import resolve
from dserve.runtime.config import EngineConfig

log = logging.getLogger("dserve.runtime")


class RankFailure(RuntimeError):
    """A rank process died or raised; the instance is shut down."""


class LocalExecutor:
    def __init__(self, config: EngineConfig, transfer=None):
        from dserve.runtime.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.num_pages = [self.runner.num_pages]
        self.agent = None
        if transfer is not None:
            from dserve.transfer.agent import start_agent

            self.agent = start_agent(transfer, self.runner.transfer_pools, 0, 0, 1)

    def execute(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        """The logits stay on the device: the front moves only the ids and values it needs."""
        return [self.runner.forward(batches[0])]

    def shutdown(self) -> None:
        pass


def validate_parallel(config: EngineConfig) -> ModelConfig:
    """Every size must divide before any weight is read; the message names the numbers."""
    cfg, _ = resolve(config.model_path)
    a, world = config.attn_tp_size, config.world_size
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
        if count < world:
            raise ValueError(f"tp_size = {world} needs {world} GPUs; this host has {count}")
    return cfg


def _has_data(conn) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


class MultiprocessExecutor:
    def __init__(self, config: EngineConfig, transfer=None):
        self.config = config
        self.model_config = validate_parallel(config)
        ctx = mp.get_context("spawn")
        # The rendezvous store binds port 0 here and lives as long as the executor: no port is picked, released
        # and bound again later, which another process could take in between.
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.step_timeout_s),
        )
        self.conns, self.procs, self.closed = [], [], False
        from dserve.runtime.worker import worker_main

        for rank in range(config.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, config, self.store.port, child, transfer),
                daemon=True,
                name=f"dserve-rank-{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            replies = self._gather(timeout=config.step_timeout_s, what="start-up")
        except BaseException:
            self.shutdown()
            raise
        self.rank_info = [info for _, info in replies]
        a = config.attn_tp_size
        self.num_pages = [
            min(i.num_pages for i in self.rank_info[g * a : (g + 1) * a])
            for g in range(config.dp_size)
        ]
        log.info(
            "%d ranks up (tp=%d, dp=%d, ep=%d); parameter bytes per rank: %s",
            config.world_size,
            config.tp_size,
            config.dp_size,
            config.ep_size,
            [i.parameter_bytes for i in self.rank_info],
        )

    def _gather(self, timeout: float, what: str) -> list[tuple]:
        """One reply from every rank, or RankFailure as soon as any rank dies or reports an error."""
        pending = dict(enumerate(self.conns))
        replies: list = [None] * len(self.conns)
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            ready = mp.connection.wait(list(pending.values()) + list(sentinels), timeout=timeout)
            if not ready:
                self._fail(f"no {what} reply from ranks {sorted(pending)} within {timeout:.0f}s")
            for rank, conn in list(pending.items()):
                if conn in ready or _has_data(conn):
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        continue  # its process is gone: reported through the sentinel
                    if status == "error":
                        self._fail(self._root_cause(rank, payload))
                    replies[rank] = (status, payload)
                    del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending and not _has_data(self.conns[rank]):
                    self.procs[rank].join(timeout=1)
                    code = self.procs[rank].exitcode
                    self._fail(f"rank {rank} died (exit code {code}) during {what}")
        return replies

    def _root_cause(self, rank: int, error: str) -> str:
        """A rank's error is often a peer's death seen through a broken collective: name the dead first."""
        time.sleep(0.2)
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if r != rank and not p.is_alive()]
        last_line = error.strip().splitlines()[-1]
        if dead:
            names = ", ".join(f"rank {r} died (exit code {code})" for r, code in dead)
            return f"{names}; rank {rank} then failed: {last_line}"
        return error

    def _fail(self, message: str) -> None:
        self.shutdown(graceful=False)  # survivors may sit in a collective with the dead rank
        raise RankFailure(f"{message}; the instance has shut down all its ranks")

    def execute(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        if self.closed:
            raise RankFailure("the instance's ranks are shut down")
        a = self.config.attn_tp_size
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(batches[rank // a])
            except (BrokenPipeError, OSError):
                self._fail(f"rank {rank} is gone (exit code {self.procs[rank].exitcode})")
        replies = self._gather(self.config.step_timeout_s, "step")
        return [replies[g * a][1] for g in range(self.config.dp_size)]

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.store = None  # closes the rendezvous port


def make_executor(config: EngineConfig, transfer=None):
    """`transfer` (an AgentConfig) starts a KV transfer agent on every rank."""
    if config.world_size == 1:
        return LocalExecutor(config, transfer)
    return MultiprocessExecutor(config, transfer)
