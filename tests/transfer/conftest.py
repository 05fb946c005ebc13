"""Fixtures the disaggregated tests share: `default_pair(arch)`, a prefill, a decode and a router
with the default flags on the tiny checkpoint of `arch` (test_pd_serving's, and the first tests
of test_pd_streaming). A pair keeps running through consecutive tests that ask for it and stops
before one that does not (an idle pair takes ~5% of a core), or when another arch's is asked
for: one runs at a time."""

from __future__ import annotations

import pytest

from tests.servers import Cluster, start_cluster

_running: dict[str, Cluster] = {}  # arch -> its pair, at most one


@pytest.fixture(scope="session")
def default_pair(tiny_dir, tmp_path_factory):
    """`get(arch)`: the running default pair of `arch` (its checkpoint in `.model`), started if
    need be."""

    def get(arch: str) -> Cluster:
        cluster = _running.get(arch)
        if cluster is None or any(p.popen.poll() is not None for p in cluster.procs):
            stop_pairs()  # another arch's, or one with a dead process
            model = tiny_dir(arch)
            cluster = start_cluster(model, tmp_path_factory.mktemp(f"pair_{arch}"))
            cluster.model = model
            _running[arch] = cluster
        return cluster

    yield get
    stop_pairs()


def stop_pairs() -> None:
    while _running:
        _running.popitem()[1].stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """After a test's own teardown: stop the pair unless the next test uses one."""
    if "default_pair" not in getattr(nextitem, "fixturenames", ()):
        stop_pairs()
