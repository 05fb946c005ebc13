"""The KV-transfer and serving benchmarks run end to end on the CPU and write their JSON (the numbers
on a CPU box are smoke figures; GPU numbers are in the issue notes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.servers import start_instance

pytestmark = pytest.mark.slow


def test_kv_transfer_benchmark(tmp_path):
    out = tmp_path / "kvt.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.kv_transfer",
        "--device",
        "cpu",
        "--sizes-mib",
        "1,4",
        "--page-sizes",
        "16",
        "--layers",
        "4",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]  # bf16 pages: host bytes pass as uint8
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["pages"] for r in result["rows"]] and all(r["gb_per_s"] > 0 for r in result["rows"])
    assert result["copy_gb_per_s"] > 0 and "of copy" in done.stdout


def test_serving_benchmark_against_a_server(tiny_dir, tmp_path):
    server = start_instance("serve", tiny_dir("deepseek_v3"), tmp_path).wait_ready()
    try:
        out = tmp_path / "serving.json"
        cmd = [
            sys.executable,
            "-m",
            "bench.serving",
            "--url",
            server.url,
            "--num-prompts",
            "8",
            "--input-len",
            "24",
            "--output-len",
            "6",
            "--max-concurrency",
            "4",
            "--dataset",
            "fixed",
            "--out",
            str(out),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(out.read_text())["summary"]
        assert summary["failed"] == 0 and summary["requests"] == 8
        assert summary["output_token_throughput"] > 0 and summary["ttft_s"]["p50"] > 0
        assert all(r["output_tokens"] == 6 for r in json.loads(out.read_text())["requests"])
    finally:
        server.stop()
