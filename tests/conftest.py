"""Shared fixtures: tiny random checkpoints of each architecture (written once per test session and
worker through `dserve.models.tiny`, i.e. transformers' save_pretrained) and engine factories;
`made_once` for what the test workers of a session share (trained checkpoints)."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import random
import time

# Two test workers on two cores, and each server a test starts, run torch with one thread: more
# threads than cores make OpenMP workers spin against each other (steps 10x slower, and timeouts).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ARCHES = ("deepseek_v3", "deepseek_v2", "glm4_moe")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    made: dict[tuple[str, bool, int], str] = {}

    def get(arch: str, mtp: bool = False, layers: int = 3) -> str:
        key = (arch, mtp, layers)
        if key not in made:
            from dserve.models.tiny import make_tiny

            name = f"{arch}{'_mtp' if mtp else ''}{'' if layers == 3 else f'_{layers}l'}"
            out = str(tmp_path_factory.mktemp(name))
            made[key] = make_tiny(arch, out, mtp=mtp, num_layers=layers)
        return made[key]

    return get


def session_root(tmp_path_factory):
    """The directory every test worker of this session shares."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's, above each worker's own
    return root


@pytest.fixture(autouse=True)
def gpu_share(request, tmp_path_factory):
    """Every `gpu` test holds a shared lock on the session's GPU; one marked `gpu_alone` (a
    timing it asserts) holds it exclusively, so no other worker's kernels run beside it."""
    node = request.node
    if node.get_closest_marker("gpu") is None:
        yield
        return
    alone = node.get_closest_marker("gpu_alone") is not None
    with open(session_root(tmp_path_factory) / "gpu.lock", "w") as lock:
        take_lock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, GPU_LOCK_WAIT_S)
        yield  # released when closed


GPU_LOCK_WAIT_S = 1200  # longer than any one gpu test takes; then the wait fails


def take_lock(lock, kind: int, wait_s: float) -> None:
    """flock `kind` on the open file `lock`, polled (a blocking flock has no deadline):
    fails the test after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"another test worker held the GPU lock for {wait_s:.0f} s")
            time.sleep(0.1)


@pytest.fixture(params=ARCHES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def make_engine():
    """Engine factory; every engine made is checked for leaked pages and shut down after the test."""
    from dserve.runtime import Engine

    engines = []

    def make(path: str, **kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("load_progress", False)
        engine = Engine(path, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.check_invariants()  # ended requests hold no pages; refcounts match the tables
        engine.shutdown()
        engine.check_invariants()
        assert not any(g.kv.tables for g in engine.groups), "pages still held after shutdown"
    engines.clear()
    # free KV pools now: a GPU pool sized from free memory must not see the last test's (a CPU
    # pool's size is fixed, and a full collection takes 0.3 s in a test worker)
    if torch.cuda.is_available():
        gc.collect()


def forward_spans(engine, spans):
    """Logits of one forward pass over `spans` (whose pages are allocated) on a one-rank engine,
    after the last token of each."""
    from dserve.step.batch import Seq, assemble, table_rows

    kv = engine.groups[0].kv
    seqs = []
    for s in spans:
        tokens = s.req.all_ids[s.start : s.start + s.length]
        seqs.append(Seq(s.req.rid, s.start, tokens, [s.length - 1]))
    rows = table_rows(kv.tables, [s.req.rid for s in spans])
    return engine.executor.runner.forward(assemble(seqs, rows, kv.page_size))


def count_calls(obj, name: str) -> list:
    """Wrap `obj.name` so that each call appends to the returned list."""
    calls, inner = [], getattr(obj, name)

    def counted(*args):
        calls.append(1)
        return inner(*args)

    setattr(obj, name, counted)
    return calls


def static_passes_per_step(engine) -> list[list[int]]:
    """Wrap `engine`'s collect: per step the static passes each DP group's answering rank ran
    (appended as the steps' results come in)."""
    passes, collect = [], engine.executor.collect

    def counted():
        results = collect()
        passes.append([r.static_passes for r in results])
        return results

    engine.executor.collect = counted
    return passes


def made_once(tmp_path_factory, name: str, make) -> tuple[str, dict]:
    """(directory, info) of `make(directory) -> info` (JSON), run once per test session: under
    pytest-xdist the first worker to ask makes it in the session's directory while the others
    wait on its lock, then each reads what it made (a trained checkpoint takes 10-20 s)."""
    root = session_root(tmp_path_factory)
    out, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        if not done.exists():
            out.mkdir(exist_ok=True)
            info = make(str(out))
            done.with_suffix(".tmp").write_text(json.dumps(info))
            done.with_suffix(".tmp").rename(done)  # whole, or not there
    return str(out), json.loads(done.read_text())


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # skip the special tokens (ids 0..5) so the prompts look like text
    return [[rng.randrange(6, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run in its interpreter on a CPU host (read at import)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
