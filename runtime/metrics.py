"""Prometheus text exposition for `/metrics`: counters, gauges read when scraped, and histograms.

Updated from the asyncio thread (requests) and the engine thread (transfers); single integer and
float updates under the GIL need no lock for a scrape that tolerates one step of skew.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.total}",
            f"{name}_count {self.count}",
        ]
        return lines


class Metrics:
    def __init__(self, prefix: str = "dserve"):
        self.prefix = prefix
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, outcome) -> count
        self.histograms = {
            "time_to_first_token_seconds": Histogram(),
            "inter_token_latency_seconds": Histogram(),
            "e2e_request_latency_seconds": Histogram(),
            "kv_transfer_seconds": Histogram(),
        }
        self.counters: dict[str, float] = defaultdict(float)
        self.gauges: dict[str, Callable[[], float]] = {}
        # counters kept elsewhere (the engine's), read when scraped: name -> (label, read -> {value: count})
        self.labeled: dict[str, tuple[str, Callable[[], dict]]] = {}

    def request_done(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] += 1

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def add(self, name: str, value: float = 1.0) -> None:
        self.counters[name] += value

    def transfer(self, ok: bool, nbytes: int, seconds: float) -> None:
        self.add("kv_transfer_bytes_total", nbytes)
        if ok:
            self.observe("kv_transfer_seconds", seconds)
        else:
            self.add("kv_transfer_failures_total")

    def render(self) -> str:
        p, lines = self.prefix, []
        lines.append(f"# TYPE {p}_requests_total counter")
        for (endpoint, outcome), n in sorted(self.requests.items()):
            lines.append(f'{p}_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {n}')
        for name, value in sorted(self.counters.items()):
            lines += [f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
        for name, (label, read) in sorted(self.labeled.items()):
            lines.append(f"# TYPE {p}_{name} counter")
            lines += [f'{p}_{name}{{{label}="{key}"}} {value}' for key, value in read().items()]
        for name, get in sorted(self.gauges.items()):
            lines += [f"# TYPE {p}_{name} gauge", f"{p}_{name} {get()}"]
        for name, hist in self.histograms.items():
            lines.append(f"# TYPE {p}_{name} histogram")
            lines += hist.render(f"{p}_{name}")
        return "\n".join(lines) + "\n"
