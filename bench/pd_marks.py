"""What each answer of `bench.pd_overhead` says of where a request's time to first token went:
the disaggregated pair's timeline (`pd_timeline_ms`, ms after the decode got the request, with
the client's own send and first token placed on it), the part of the TTFT outside the instance
that computed the first token, and the summaries and table of both per prompt length.
"""

from __future__ import annotations

import statistics

from bench.serving import percentiles


def summary(results: list[dict]) -> dict:
    """One served mode's requests at one length: percentiles of the TTFT, of its part outside
    the instance and of that part's inbound half, of the ITL and of the second token's time, and
    the pair's median timeline."""
    outside = [x for x in map(outside_s, results) if x is not None]
    inbound = [x for x in map(inbound_s, results) if x is not None]
    return {
        "ttft_s": percentiles([r["ttft"] for r in results]),
        "outside_s": percentiles(outside) if outside else {},
        "inbound_s": percentiles(inbound) if inbound else {},
        "itl_s": percentiles([x for r in results for x in r["itl"]]),
        "second_s": percentiles([r["ttft"] + r["itl"][0] for r in results if r["itl"]]),
        "timeline_ms": median_marks(results),
    }


MARKS = (  # pd_timeline_ms (and the client's own) in the order a request meets them
    "client_sent",
    "prefill_arrival",
    "registered",
    "prefill_registered",
    "prefill_computed",
    "prefill_push",
    "pages_arrived",
    "received",
    "joined",
    "published",
    "sent",
    "client_first",
)


def timeline_of(result: dict) -> dict | None:
    """A disaggregated request's `pd_timeline_ms` (ms after the decode got it) with the client's
    marks: when it sent the request and had the first token (on the decode's clock, this host's
    `perf_counter`: the answer's `arrival_s`); None for a colocated instance."""
    meta = result["meta"] or {}
    line = meta.get("pd_timeline_ms")
    if not line:
        return None
    line, arrival = dict(line), meta.get("arrival_s")
    if arrival is not None and abs(result["start"] - arrival) < 60:
        line["client_sent"] = (result["start"] - arrival) * 1e3
        line["client_first"] = (result["start"] + result["ttft"] - arrival) * 1e3
    return line


def outside_s(result: dict) -> float | None:
    """The part of a request's TTFT outside the instance that computed its first token (the
    client's and the router's HTTP hops, the instance's parsing): the client's TTFT less that
    instance's time from the request's creation (`Request.arrival_time`) to its first token:
    colocated, the answer's `ttft`; a pair, the prefill's arrival to its computed first
    token (`pd_timeline_ms`)."""
    meta, ttft = result["meta"] or {}, result["ttft"]
    marks = meta.get("pd_timeline_ms")
    if marks:
        if "prefill_computed" not in marks:
            return None
        return ttft - (marks["prefill_computed"] - marks.get("prefill_arrival", 0)) / 1e3
    return ttft - meta["ttft"] if meta.get("ttft") is not None else None


def inbound_s(result: dict) -> float | None:
    """The first part of `outside_s`: from the client's send to the arrival of the instance
    that computed the first token (the answer's `arrival_s`; a pair's: the decode's, moved by
    its prefill's `prefill_arrival` mark), on this host's clock; None without them."""
    meta = result["meta"] or {}
    arrival, marks = meta.get("arrival_s"), meta.get("pd_timeline_ms")
    if arrival is None or abs(result["start"] - arrival) > 60:
        return None  # no arrival, or the instance's clock is another host's
    if marks:
        if "prefill_arrival" not in marks:
            return None
        arrival += marks["prefill_arrival"] / 1e3
    return arrival - result["start"]


def median_marks(results: list[dict]) -> dict:
    """Per mark (`timeline_of`), the median over the requests; {} for a colocated instance."""
    lines = [x for x in map(timeline_of, results) if x]
    keys = [k for k in MARKS if lines and all(k in x for x in lines)]
    return {k: statistics.median(x[k] for x in lines) for k in keys}


def timeline_table(results: dict, lengths: list[int], mode: str) -> None:
    """Where a disaggregated request's time to first token goes: a row per mark, with the
    step from the mark before (with shared streams the client's first token comes before the
    pages arrive at the decode: it came from the prefill)."""
    print(
        f"disaggregated ({mode}), ms after the decode instance got the request (median; the "
        "step from the mark above):"
    )
    print(f"{'mark':>20} " + " ".join(f"{n:>16}" for n in lengths))
    lines = [results[mode][n]["timeline_ms"] for n in lengths]
    for i, k in enumerate(MARKS):
        cells = []
        for marks in lines:
            value = marks.get(k, float("nan"))
            before = marks.get(MARKS[i - 1], float("nan")) if i else float("nan")
            step = f"({value - before:+.2f})" if i and value == value and before == before else ""
            cells.append(f"{value:>8.2f} {step:>7}")
        print(f"{k:>20} " + " ".join(f"{c:>16}" for c in cells))
