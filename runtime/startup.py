"""What a `dserve` command checks before it binds a port or reads a weight, and how it stops.

A `StartupError` (a bad model path, a directory that holds no checkpoint, a CUDA device on a
host without CUDA, a port in use) ends the command with one line on stderr and exit status 2,
the status argparse gives a usage error; `cli.main` prints it. `stop_signals` makes the first
SIGINT/SIGTERM stop the process cleanly and a second one exit at once. `start_site` serves an
aiohttp app (an instance's) on a listening socket. Nothing here imports the engine (or torch):
the router starts without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine

from aiohttp import web

log = logging.getLogger("dserve.server")


class StartupError(Exception):
    """The command cannot start; the message says why in one line."""


def check_model_dir(path: str, flag: str = "--model", target: bool = True) -> None:
    """A Hugging Face checkpoint directory; a `target` one of an architecture served here
    (a draft's is the draft model's own)."""
    from dserve.models.registry import supported_architectures

    if not os.path.exists(path):
        raise StartupError(f"{flag} {path}: no such directory")
    if not os.path.isdir(path):
        raise StartupError(f"{flag} {path}: not a directory")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise StartupError(f"{flag} {path}: not a model directory (it has no config.json)")
    try:
        with open(config) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise StartupError(f"{flag} {path}: config.json is not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise StartupError(f"{flag} {path}: config.json is not a JSON object")
    archs = raw.get("architectures") or []
    known = supported_architectures()
    if target and not any(a in known for a in archs):
        raise StartupError(
            f"{flag} {path}: architecture {archs or '(none given)'} is not served here; "
            f"supported: {', '.join(known)}"
        )


def check_device(device: str) -> None:
    """`auto`, `cpu`, or a CUDA device that this host has."""
    import torch

    if device in ("auto", "cpu"):
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise StartupError(f"--device {device}: give auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise StartupError(f"--device {device}: CUDA is not available on this host ({why})")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise StartupError(f"--device {device}: this host has {count} GPU(s)")


def listening_socket(host: str, port: int, what: str) -> socket.socket:
    """A socket bound to host:port (listened on by aiohttp later)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} for {what}: {e.strerror}") from e
    return sock


def stop_signals() -> asyncio.Event:
    """An event the first SIGINT or SIGTERM sets (the server then stops cleanly); a second
    signal exits at once. Plain signal handlers, not the event loop's: they also run while
    the main thread waits in a blocking call (a shutdown that hangs)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    seen = []

    def on_signal(signum: int, _frame) -> None:
        seen.append(signum)
        if len(seen) > 1:
            print("dserve: interrupted again, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        print("dserve: stopping (interrupt again to exit at once)", file=sys.stderr, flush=True)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop


def run_loop(main: Coroutine) -> None:
    """Run a server's asyncio side (the HTTP API, the router) to the end on uvloop: libuv's
    loop makes every HTTP hop of a request cheaper than asyncio's own (`bench.router_overhead`,
    the router's hop at 1k tokens: 1.1-1.2 ms against 1.4-1.5 on a 2-core host)."""
    import uvloop

    uvloop.run(main)


async def start_site(app: web.Application, sock: socket.socket) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", host, port)
    return runner
