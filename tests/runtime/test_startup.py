"""An instance's start and stop, as a client and an operator see it: it listens at once and
answers 503 ("starting") to `/health` and to requests while the model loads and the kernels warm
up, then 200; what stops a start (a bad model path, a directory without a checkpoint, CUDA asked
for on a host without it, a port in use) is one line on stderr and exit status 2, before any
weight is read; one interrupt stops it cleanly, a second one at once."""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest
import torch

from tests.servers import assert_all_pages_free, free_port, get, post, start_instance

pytestmark = pytest.mark.slow


def test_health_says_starting_until_the_instance_is_ready(tiny_dir, tmp_path):
    proc = start_instance("serve", tiny_dir("deepseek_v3"), tmp_path)
    seen, refused_request = [], None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not seen or seen[-1] != 200):
            try:
                status, body = get(proc.url + "/health", timeout=2)
            except OSError:
                time.sleep(0.02)  # not listening yet: the interpreter is still importing
                continue
            seen.append(status)
            if status == 503 and refused_request is None:
                assert body == {"status": "starting"}
                refused_request = post(proc.url + "/generate", {"input_ids": [5, 6, 7]})
        assert seen and seen[-1] == 200, seen
        assert 503 in seen, "the port answers before the instance is ready"
        status, body = refused_request
        assert status == 503 and "starting" in body["error"]["message"], body
        params = {"max_new_tokens": 2, "temperature": 0}
        status, body = post(
            proc.url + "/generate", {"input_ids": [5, 6], "sampling_params": params}
        )
        assert status == 200 and len(body["output_ids"]) == 2, body
        assert_all_pages_free(proc)  # the warm-up's requests too
        proc.popen.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
        assert proc.popen.wait(30) == 0
        assert "Traceback" not in proc.tail(200), proc.tail()
    finally:
        proc.stop()


def test_a_second_interrupt_exits_at_once(tiny_dir, tmp_path):
    """The first Ctrl-C while the model loads waits for the load to end; a second exits now."""
    proc = start_instance("serve", tiny_dir("deepseek_v3"), tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if get(proc.url + "/health", timeout=2)[0] == 503:
                    break
            except OSError:
                time.sleep(0.02)
        proc.popen.send_signal(signal.SIGINT)
        time.sleep(0.1)
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(10) == 128 + signal.SIGINT
        assert "interrupted again, exiting now" in proc.tail(), proc.tail()
    finally:
        proc.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dserve.runtime.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def one_line_exit_2(done: subprocess.CompletedProcess, message: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert message in lines[0], lines


def test_start_errors_are_one_line_and_exit_2(tiny_dir, tmp_path):
    model = tiny_dir("deepseek_v3")
    (tmp_path / "empty").mkdir()
    cases = {
        "no such directory": ["--model", str(tmp_path / "missing")],
        "not a model directory (it has no config.json)": ["--model", str(tmp_path / "empty")],
        "--device cuda: CUDA is not available": ["--model", model, "--device", "cuda"],
    }
    for message, args in cases.items():
        if "cuda" in args and torch_has_cuda():
            continue  # a GPU host has CUDA: nothing to refuse
        one_line_exit_2(run_cli("serve", *args, "--port", str(free_port())), message)


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_port_in_use_fails_before_the_model_loads(tiny_dir, tmp_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        model = ["--model", tiny_dir("deepseek_v3"), "--device", "cpu"]
        done = run_cli("--log-level", "warning", "serve", *model, "--port", str(port))
        router = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        router_done = run_cli("router", *router, "--port", str(port))
    # no weight is read: the one line is all it says (--log-level warning hides the listening line)
    one_line_exit_2(done, f"cannot listen on 127.0.0.1:{port} for the HTTP API")
    one_line_exit_2(router_done, f"cannot listen on 127.0.0.1:{port} for the HTTP API")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_first_request_is_as_fast_as_the_later_ones_on_a_gpu(tiny_dir, tmp_path):
    """Warm start: every kernel a step launches compiled (or loaded from Triton's cache)
    before /health says ready, so the first request, of shapes the warm-up did not use,
    takes at most twice the median of the ones after it (a kernel compiled during a request
    costs seconds). The later ones, 337 to 596 tokens, should not stall either: over four
    times the median is reported as an expected failure, a known gap of issue 20 (an H100
    on a cold Triton cache, session 24: 0.37 and 0.50 s against 37 ms for the 485- and
    522-token prompts, cause not found; none on a warm cache)."""
    proc = start_instance("serve", tiny_dir("deepseek_v3"), tmp_path, "--device", "cuda")
    try:
        proc.wait_ready()
        times = []
        for i in range(9):
            ids = [3 + (i + j) % 50 for j in range(300 + 37 * i)]
            params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
            start = time.perf_counter()
            status, body = post(
                proc.url + "/generate", {"input_ids": ids, "sampling_params": params}
            )
            times.append(time.perf_counter() - start)
            assert status == 200 and len(body["output_ids"]) == 24, body
        steady = statistics.median(times[1:])
        assert times[0] <= 2 * steady, f"first {times[0]:.3f} s, then {times[1:]}"
        assert_all_pages_free(proc)
    finally:
        proc.stop()
    if max(times[1:]) > 4 * steady:
        pytest.xfail(f"a later request stalled: {[round(t, 3) for t in times]} s")


def test_the_warm_up_passes_cross_every_power_of_two():
    from dserve.runtime.http_server import pass_sizes

    assert pass_sizes(2048) == [19, 35, 67, 131, 259, 515, 1027, 2048]
    assert pass_sizes(100) == [19, 35, 67, 100] and pass_sizes(16) == [16]
