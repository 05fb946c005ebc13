"""Prometheus metrics for `/metrics`, through prometheus_client: one registry per instance (or
router), with the process collector (CPU, memory, open files) and HELP text for every metric.
`RouterMetrics` are the router's.

`InstanceMetrics` counts what an instance serves (requests by outcome, prompt / generated /
cached tokens, latencies, queue time, KV transfers) and, read when scraped, what its engine holds
(running and queued requests, KV pages in use, the prefix cache's hit rate, speculative
acceptance). Updated from the asyncio thread (requests) and the engine thread (transfers,
finished requests); prometheus_client's metrics take their own locks.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Registry:
    """A prometheus_client registry whose metric names start with `prefix_`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def counter(self, name: str, doc: str, labels=()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> Gauge:
        gauge = Gauge(f"{self.prefix}_{name}", doc, registry=self.registry)
        gauge.set_function(read)
        return gauge

    def histogram(self, name: str, doc: str, labels=()) -> Histogram:
        return Histogram(
            f"{self.prefix}_{name}",
            doc,
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class InstanceMetrics(Registry):
    def __init__(self):
        super().__init__("dserve")
        self.requests = self.counter(
            "requests",
            "Generation requests by endpoint and outcome (ok, bad_request, error, client_gone).",
            ["endpoint", "outcome"],
        )
        self.prompt_tokens = self.counter(
            "prompt_tokens", "Prompt tokens of the requests this instance finished."
        )
        self.generation_tokens = self.counter(
            "generation_tokens", "Tokens this instance's requests generated."
        )
        self.cached_tokens = self.counter(
            "cached_tokens", "Prompt tokens served from the prefix cache instead of computed."
        )
        self.ttft = self.histogram(
            "time_to_first_token_seconds", "From the request's arrival to its first token."
        )
        self.itl = self.histogram(
            "inter_token_latency_seconds", "Between a request's consecutive tokens."
        )
        self.e2e = self.histogram(
            "e2e_request_latency_seconds", "From the request's arrival to its last token."
        )
        self.queue_time = self.histogram(
            "queue_time_seconds",
            "From the request's arrival to the first step that computes it.",
        )
        self.kv_transfer_seconds = self.histogram(
            "kv_transfer_seconds", "One room's KV transfer, from its command to its outcome."
        )
        self.kv_transfer_bytes = self.counter(
            "kv_transfer_bytes", "Bytes of KV sent (prefill) or received (decode)."
        )
        self.kv_transfer_failures = self.counter(
            "kv_transfer_failures", "Rooms whose KV transfer failed."
        )
        self.totals = {"prompt": 0, "cached": 0}

    def request_done(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def transfer(self, ok: bool, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.inc(nbytes)
        if ok:
            self.kv_transfer_seconds.observe(seconds)
        else:
            self.kv_transfer_failures.inc()

    def finished(self, prompt: int, generated: int, cached: int, queued: float | None) -> None:
        """A request's tokens and its time in the queue, once it ended."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        self.totals["prompt"] += prompt
        self.totals["cached"] += cached
        if queued is not None:
            self.queue_time.observe(queued)

    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over all prompt tokens, so far."""
        prompt = self.totals["prompt"]
        return self.totals["cached"] / prompt if prompt else 0.0

    def watch(self, engine) -> None:
        """Gauges and counters read from `engine` when scraped."""
        groups = engine.groups
        self.gauge(
            "num_running_requests",
            "Requests in the running batch.",
            lambda: sum(len(g.scheduler.running) for g in groups),
        )
        self.gauge(
            "num_queued_requests",
            "Requests waiting to be scheduled.",
            lambda: sum(len(g.scheduler.waiting) for g in groups),
        )
        self.gauge(
            "kv_pages_used",
            "KV pages in use (by requests, the prefix cache's live entries, transfers).",
            lambda: sum(g.kv.num_used_pages for g in groups),
        )
        self.gauge(
            "kv_pages_total",
            "KV pages of the pool.",
            lambda: sum(g.kv.num_pages for g in groups),
        )
        self.gauge("token_usage", "Fraction of the KV pool in use.", lambda: token_usage(engine))
        self.gauge(
            "cache_hit_rate",
            "Prompt tokens served from the prefix cache over all prompt tokens.",
            self.cache_hit_rate,
        )
        if engine.config.speculative_algorithm:
            spec = engine.speculation
            self.registry.register(SpecCollector(self.prefix, engine))
            self.gauge(
                "spec_accept_length",
                "Mean tokens one verify step yields (accepted drafts plus one).",
                lambda: 1 + sum(spec.accepted) / spec.verify_steps if spec.verify_steps else 0.0,
            )


def token_usage(engine) -> float:
    used = sum(g.kv.num_used_pages for g in engine.groups)
    return used / max(1, sum(g.kv.num_pages for g in engine.groups))


class SpecCollector:
    """The speculation's own counters (kept by the engine), read when scraped."""

    def __init__(self, prefix: str, engine):
        self.prefix, self.engine = prefix, engine

    def collect(self):
        spec = self.engine.speculation
        algorithm = self.engine.config.speculative_algorithm
        verify = CounterMetricFamily(
            f"{self.prefix}_spec_verify_steps", "Verify steps.", labels=["algorithm"]
        )
        verify.add_metric([algorithm], spec.verify_steps)
        proposed = CounterMetricFamily(
            f"{self.prefix}_spec_draft_tokens",
            "Verifies with a draft token at this position of the draft.",
            labels=["position"],
        )
        accepted = CounterMetricFamily(
            f"{self.prefix}_spec_accepted_tokens",
            "Draft tokens at this position that verification accepted.",
            labels=["position"],
        )
        for d, (p, a) in enumerate(zip(spec.proposed, spec.accepted)):
            proposed.add_metric([str(d)], p)
            accepted.add_metric([str(d)], a)
        return [verify, proposed, accepted]


class RouterMetrics(Registry):
    """The router's: requests by endpoint and outcome, their latency to the first relayed
    token and to the end, tries on each instance, retries, and each instance's state."""

    def __init__(self, backends: list):
        super().__init__("dserve_router")
        self.requests = self.counter(
            "requests",
            "Requests by endpoint and outcome (ok, bad_request, error, client_gone).",
            ["endpoint", "outcome"],
        )
        self.latency = self.histogram(
            "request_latency_seconds",
            "From a request's arrival to the end of its answer (errors too), per endpoint.",
            ["endpoint"],
        )
        self.ttft = self.histogram(
            "time_to_first_token_seconds",
            "From a request's arrival to the first token relayed (a whole answer: to the "
            "answer), per endpoint, of the requests that succeeded.",
            ["endpoint"],
        )
        self.tries = self.counter(
            "backend_requests",
            "Tries sent to each instance (a request retried counts once per try).",
            ["role", "url"],
        )
        self.retries = self.counter(
            "retries", "Tries on another pair after one failed before any token went out."
        )
        self.registry.register(BackendCollector(self.prefix, backends))

    def sent(self, backend) -> None:
        self.tries.labels(backend.role, backend.url).inc()

    def answered(
        self, endpoint: str, outcome: str, start: float, first: float | None = None
    ) -> None:
        """A request answered: `start` its arrival, `first` when its first token went out (a
        successful answer's)."""
        self.requests.labels(endpoint, outcome).inc()
        if first is not None and outcome == "ok":
            self.ttft.labels(endpoint).observe(first - start)
        self.latency.labels(endpoint).observe(time.perf_counter() - start)


class BackendCollector:
    """Each instance's state as the router sees it, read when scraped."""

    def __init__(self, prefix: str, backends: list):
        self.prefix, self.backends = prefix, backends

    def collect(self):
        families = {
            "healthy": "1 while the instance is in rotation (its health probes answer).",
            "in_flight": "Requests the router has in flight on the instance.",
            "circuit_open": "1 while the instance's circuit breaker keeps it out of rotation.",
        }
        out = {
            name: GaugeMetricFamily(f"{self.prefix}_backend_{name}", doc, labels=["role", "url"])
            for name, doc in families.items()
        }
        now = time.monotonic()
        for b in self.backends:
            labels = [b.role, b.url]
            out["healthy"].add_metric(labels, float(b.healthy))
            out["in_flight"].add_metric(labels, b.in_flight)
            out["circuit_open"].add_metric(labels, float(not b.breaker.allows(now)))
        return list(out.values())
