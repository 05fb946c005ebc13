"""What an instance tells its operator: `/metrics` as prometheus_client's parser reads it (HELP
text on every metric, process metrics, token counters equal to what was served, the prefix
cache's hit rate, speculative acceptance, latency and queue-time histograms filled), one log line
per finished request and a batch line while busy."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import Proc, get, metric_value, post, start_instance, stream

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
MTP = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = tiny_dir("deepseek_v3", mtp=True)
    logs = tmp_path_factory.mktemp("observability")
    proc = start_instance("serve", model, logs, *MTP, "--batch-log-interval-s", "0.05")
    yield proc.wait_ready()
    proc.stop()


def test_metrics_after_traffic(server: Proc):
    prompt = list(range(40, 80))  # two full pages and a bit: the second time, two pages hit
    answers = []
    for rid in ("first", "second"):
        body = {"input_ids": prompt, "sampling_params": GREEDY, "rid": rid}
        status, answer = post(server.url + "/generate", body)
        assert status == 200, answer
        answers.append(answer)
    events = stream(server.url + "/generate", {"input_ids": [9, 8, 7], "sampling_params": GREEDY})
    assert len(events[-1]["output_ids"]) == 8  # the whole output so far, as SGLang streams
    cached = answers[1]["meta_info"]["cached_tokens"]
    assert cached > 0 and answers[0]["meta_info"]["cached_tokens"] == 0

    status, text = get(server.url + "/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(text))
    undocumented = [f.name for f in families if not f.documentation]
    assert not undocumented, undocumented
    value = lambda name, **labels: metric_value(text, name, **labels)
    assert value("dserve_prompt_tokens_total") == 2 * len(prompt) + 3
    assert value("dserve_generation_tokens_total") == 3 * 8
    assert value("dserve_cached_tokens_total") == cached
    assert value("dserve_cache_hit_rate") == pytest.approx(cached / (2 * len(prompt) + 3))
    assert value("dserve_requests_total", endpoint="generate", outcome="ok") == 3
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
    ):
        assert value(f"dserve_{histogram}_count") > 0, histogram
    assert value("dserve_kv_pages_total") > 0
    assert 0 <= value("dserve_token_usage") <= 1
    assert value("dserve_num_running_requests") == 0
    assert value("dserve_spec_verify_steps_total", algorithm="mtp") > 0
    assert value("dserve_spec_accept_length") >= 1
    assert value("process_cpu_seconds_total") > 0
    assert value("process_resident_memory_bytes") > 0


def test_a_log_line_per_request_and_batch_lines(server: Proc):
    body = {"input_ids": [5] * 20, "rid": "logged", "sampling_params": GREEDY}
    assert post(server.url + "/generate", body)[0] == 200
    params = {**GREEDY, "max_new_tokens": 48}  # long enough for a few batch lines
    body = {"input_ids": [6] * 9, "sampling_params": params}
    assert post(server.url + "/generate", body)[0] == 200
    with open(server.log_path) as f:
        log = f.read()
    line = next(x for x in log.splitlines() if "finished logged:" in x)
    assert re.search(
        r"INFO finished logged: prompt 20 tokens \(cached 0\), output 8 tokens, "
        r"ttft \d+\.\d+s, latency \d+\.\d+s, finish length",
        line,
    ), line
    batch = [x for x in log.splitlines() if "batch: running" in x]
    assert batch, "no batch line while busy"
    assert re.search(
        r"batch: running \d+, queued \d+, token usage \d\.\d\d \(\d+ of \d+ pages\), "
        r"gen throughput \d+\.\d tok/s, accept length \d\.\d\d",
        batch[-1],
    ), batch[-1]
