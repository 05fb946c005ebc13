"""Instances that span several hosts: the rendezvous and the control links between the front on
node 0 and ranks on the other nodes.

Every node runs the same `dserve serve|prefill|decode` command with its `--node-rank`. Node 0
holds the front, torch.distributed's TCP store at `--dist-init-addr` and a control listener whose
address it publishes in the store. Each other node runs only its ranks (`run_node`): every rank
reads the listener's address from the store and connects, as does the node itself. The front
treats a remote rank's link as it treats a local rank's pipe (plans out, results back); a link
that closes is a dead rank, and a node whose links do not arrive in time fails the start with its
name. A node whose front goes away stops its ranks.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import time

import torch.distributed as dist

from dserve.runtime.config import EngineConfig

log = logging.getLogger("dserve.runtime")
CONTROL_KEY = "dserve/control"


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    """Where the TCP store listens: `dist_init_addr`, or any free loopback port on one host."""
    if config.nnodes == 1:
        return "127.0.0.1", 0
    host, port = config.dist_init_addr.rsplit(":", 1)
    return host, int(port)


def node_of(config: EngineConfig, rank: int) -> int:
    return rank // (config.world_size // config.nnodes)


def local_ranks(config: EngineConfig, node: int) -> range:
    per_node = config.world_size // config.nnodes
    return range(node * per_node, (node + 1) * per_node)


def open_store(config: EngineConfig, master: bool) -> dist.TCPStore:
    host, port = rendezvous_address(config)
    timeout = datetime.timedelta(seconds=config.node_join_timeout_s)
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timeout)


class ControlListener:
    """Node 0's end of the control links of the other nodes' ranks."""

    def __init__(self, config: EngineConfig, store: dist.TCPStore, transfer=None):
        """`transfer`: the ranks' transfer agent settings (prefill and decode instances), sent
        to every rank that joins."""
        self.config, self.transfer = config, transfer
        host = rendezvous_address(config)[0]
        self.server = socket.create_server((host, 0))
        self.authkey = os.urandom(16)
        port = self.server.getsockname()[1]
        store.set(CONTROL_KEY, f"{host}:{port}:{self.authkey.hex()}")

    def accept(self, ranks: range) -> tuple[dict[int, object], dict[int, object]]:
        """({rank: link} for `ranks`, {node: link}) once every remote rank and node has joined;
        ValueError naming the nodes missing at the deadline."""
        rank_links, node_links = {}, {}
        nodes = set(range(1, self.config.nnodes))
        deadline = time.monotonic() + self.config.node_join_timeout_s
        while len(rank_links) < len(ranks) or set(node_links) != nodes:
            left = deadline - time.monotonic()
            self.server.settimeout(max(left, 0.001))
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                missing = nodes - set(node_links)
                missing |= {node_of(self.config, r) for r in ranks if r not in rank_links}
                raise ValueError(
                    f"node(s) {sorted(missing)} did not join within "
                    f"{self.config.node_join_timeout_s:.0f}s (dist_init_addr "
                    f"{self.config.dist_init_addr}): start `--node-rank` there"
                ) from None
            link = _authenticated(sock, self.authkey)
            kind, index = link.recv()
            link.send(self.transfer)
            (rank_links if kind == "rank" else node_links)[index] = link
        return rank_links, node_links

    def close(self) -> None:
        self.server.close()


def _authenticated(sock: socket.socket, authkey: bytes):
    sock.setblocking(True)
    conn = mp.connection.Connection(sock.detach())
    mp.connection.deliver_challenge(conn, authkey)
    mp.connection.answer_challenge(conn, authkey)
    return conn


def connect_to_front(store: dist.TCPStore, kind: str, index: int):
    """A remote rank's (or node's) control link to the front, and the transfer agent settings
    the front gives its ranks (None on a colocated instance)."""
    host, port, key = store.get(CONTROL_KEY).decode().split(":")
    link = mp.connection.Client((host, int(port)), authkey=bytes.fromhex(key))
    link.send((kind, index))
    return link, link.recv()


def run_node(config: EngineConfig) -> None:
    """A node other than node 0: start its ranks, each linked to the front, and stop them when
    the front goes away (or when they have all ended)."""
    from dserve.runtime.worker import rank_processes, worker_main

    store = open_store(config, master=False)
    link, _ = connect_to_front(store, "node", config.node_rank)
    ctx = rank_processes()
    procs = []
    for rank in local_ranks(config, config.node_rank):
        proc = ctx.Process(
            target=worker_main, args=(rank, config, None), name=f"dserve-rank-{rank}"
        )
        proc.start()
        procs.append(proc)
    log.info("node %d: ranks %s started", config.node_rank, [p.name for p in procs])
    watched = [link, *(p.sentinel for p in procs)]
    while any(p.is_alive() for p in procs):
        ready = mp.connection.wait(watched, timeout=1.0)
        if link in ready:  # the front closed the link: it stopped or failed
            break
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    log.info("node %d: ranks stopped", config.node_rank)
