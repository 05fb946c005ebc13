"""Real server processes for tests: `dserve serve|prefill|decode|router` started as subprocesses on
free ports, waited for on /health, and stopped (SIGTERM, then SIGKILL) afterwards. Small HTTP helpers
(plain urllib, so the client side is independent of the server's aiohttp)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

COMMON = ["--no-load-progress"]
PREFILL_CHUNK = 16  # tokens: a prefill instance's prompts of more stream in parts
DEVICE = ["--device", "cpu"]


_port_locks: list[int] = []  # lock files of the ports this process took, held while it lives


def free_port() -> int:
    """A port for a server to bind later. Picking one the kernel handed out (bind to port 0) races: between
    the pick and the server's bind, an outgoing connection or another port-0 bind may get it. So ports come
    from below the kernel's ephemeral range, where neither happens, and each is claimed by a lock file this
    process holds while it lives, so no other test process (an xdist worker or a second session) takes it."""
    lock_dir = os.path.join(tempfile.gettempdir(), "dserve-test-ports")
    os.makedirs(lock_dir, exist_ok=True)
    first, last = 12000, _ephemeral_start()
    assert last - first >= 1000, (
        f"the kernel's ephemeral ports start at {last}: too few ports below them"
    )
    start = random.randrange(first, last)
    for i in range(last - first):
        port = first + (start - first + i) % (last - first)
        fd = os.open(os.path.join(lock_dir, str(port)), os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)  # taken (by a lock or a bound socket): the lock, if ours, goes with the fd
            continue
        _port_locks.append(fd)
        return port
    raise RuntimeError(f"no free port in {first}..{last}")


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:
        return 32768


_procs: list["Proc"] = []  # every instance this process started, killed at exit if a test left one


def _kill_leftovers() -> None:
    for proc in _procs:
        if proc.popen.poll() is None:
            proc.kill()


atexit.register(_kill_leftovers)


class Proc:
    def __init__(
        self,
        args: list[str],
        log_path: str,
        port: int,
        env: dict | None = None,
        command: tuple[str, ...] = ("-m", "dserve.runtime.cli"),
    ):
        """`command`: what runs with `args`, after the Python interpreter."""
        self.args, self.log_path, self.port = args, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.log = open(log_path, "w")  # noqa: SIM115 - open as long as the server runs
        self.popen = subprocess.Popen(
            [sys.executable, *command, *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        _procs.append(self)

    def wait_ready(self, timeout: float = 180.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.args[0]} exited with {self.popen.returncode}:\n{self.tail()}"
                )
            try:
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.args[0]} not ready in {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def kill(self) -> None:
        """SIGKILL the whole process group (the instance and its rank processes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        stop_all([self])

    def terminate(self) -> None:
        """SIGTERM (a clean stop), without waiting for it."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)


def stop_all(procs) -> None:
    """SIGTERM each, then wait for each (20 s, then SIGKILL its process group): each stops
    cleanly as when stopped one by one, but they stop at the same time."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(20)
        proc.kill()
        proc.log.close()


def start_instance(
    role: str, model: str, log_dir, *extra: str, port: int | None = None, env: dict | None = None
) -> Proc:
    """`extra` flags override the CPU default (`--device cuda` on a GPU host); `env` e.g. picks GPUs."""
    port = port or free_port()
    device = [] if "--device" in extra else DEVICE
    args = [role, "--model", model, "--port", str(port), *COMMON, *device, *extra]
    if role == "prefill":
        args += ["--bootstrap-port", str(free_port())]
        if "--chunked-prefill-size" not in extra:  # prompts of over 16 tokens stream their KV
            args += ["--chunked-prefill-size", str(PREFILL_CHUNK)]
    return Proc(args, os.path.join(log_dir, f"{role}-{port}.log"), port, env)


def start_router(prefills: list[Proc], decodes: list[Proc], log_dir, *extra: str) -> Proc:
    port = free_port()
    args = ["router", "--port", str(port), "--health-interval-s", "0.5", *extra]
    args += [a for p in prefills for a in ("--prefill", p.url)] + [
        a for d in decodes for a in ("--decode", d.url)
    ]
    return Proc(args, os.path.join(log_dir, f"router-{port}.log"), port)


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    router: Proc
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.router.url

    def stop(self) -> None:
        stop_all(self.procs)


def start_cluster(
    model: str,
    log_dir,
    prefill_args=(),
    decode_args=(),
    router_args=(),
    prefill_env=None,
    decode_env=None,
) -> Cluster:
    """The three start at once: the router probes the instances every 0.5 s until both answer
    ready, and the cluster is returned once it has seen them so."""
    prefill = start_instance("prefill", model, log_dir, *prefill_args, env=prefill_env)
    decode = start_instance("decode", model, log_dir, *decode_args, env=decode_env)
    started = [prefill, decode]
    try:
        router = start_router([prefill], [decode], log_dir, *router_args)
        started.insert(0, router)
        for proc in (prefill, decode, router):
            proc.wait_ready()
        wait_for(
            lambda: get(router.url + "/health")[0] == 200, 30, "router sees both instances healthy"
        )
    except BaseException:
        stop_all(started)  # the router too: none outlives a failed start
        raise
    return Cluster(prefill, decode, router, started)


# ---- HTTP ------------------------------------------------------------------------------------------
def get(url: str, timeout: float = 10) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, _decode(r.read(), r.headers.get_content_type())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read(), e.headers.get_content_type())


def post(url: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def generate(url: str, ids: list[int], **params) -> tuple[int, dict]:
    """POST `ids` to `url`/generate: greedy, 6 tokens, `ignore_eos`, unless `params` say
    otherwise."""
    body = {"input_ids": ids, "sampling_params": {**GREEDY, **params}}
    return post(url + "/generate", body)


def stream(url: str, body: dict, timeout: float = 120) -> list[dict]:
    """The SSE events of a streamed request, parsed, up to [DONE]."""
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
    return events


def openai_client(proc: Proc):
    """The official client against an instance or the router."""
    from openai import OpenAI

    return OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _decode(raw: bytes, content_type: str):
    return json.loads(raw) if content_type == "application/json" else raw.decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a `/metrics` page (parsed by prometheus_client's parser),
    summed over the samples whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    assert values, f"{name} {labels} is not on the page"
    return sum(values)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for: {what}")


def kv_state(proc: Proc) -> dict:
    return get(proc.url + "/debug/kv")[1]


def assert_all_pages_free(*procs: Proc, timeout: float = 15) -> None:
    """Every page back in the pool (in-flight and quarantined ones included) and invariants hold."""
    for p in procs:
        wait_for(
            lambda p=p: kv_state(p)["used_pages"] == 0 and kv_state(p)["held"] == 0,
            timeout,
            f"{p.args[0]} frees every page (now {kv_state(p)})",
        )
        assert kv_state(p)["invariants"] == "ok", kv_state(p)


def check_and_stop(cluster: Cluster, prompts, expected, sampling_params: dict) -> list[dict]:
    """Post each prompt (one at a time) through the router: 200 and `expected` tokens (per
    prompt a list, or a function of the prompt); every page free after; the cluster stopped
    whatever happened. Returns each answer's meta_info."""
    metas = []
    try:
        for i, ids in enumerate(prompts):
            want = expected(ids) if callable(expected) else expected[i]
            body = {"input_ids": ids, "sampling_params": sampling_params}
            status, answer = post(cluster.url + "/generate", body)
            assert status == 200, answer
            assert answer["output_ids"] == want, ids
            metas.append(answer["meta_info"])
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()
    return metas
