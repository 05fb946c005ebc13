"""Continuous batching: which spans of which requests the next forward pass computes.

Each step has a token budget. Running requests go first (one decode token each, or the next chunk
of a long prompt, at most `chunked_prefill_size` tokens), then waiting requests join in arrival
order while budget and pages last. When a running request cannot get a page, the most recently
admitted running request is preempted: its pages go back and it returns to the front of the queue,
to be recomputed later (with the prefix cache it mostly finds its own pages again).

A running request holds a slot: its row in the ranks' per-request tables. Scheduling may run while
a step is in flight (overlapped scheduling): `launched` counts the step's spans as computed at
once and each span that samples as a token owed (`Request.num_pending_tokens`), so the next step
continues where this one ends; a request whose last token is owed is not scheduled again. With
micro-batches (pipeline stages) each step in flight has requests of its own instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """A DP group's scheduling limits, built from `EngineConfig`'s fields
    (`EngineConfig.scheduler`): no defaults here, so the two cannot drift."""

    max_num_batched_tokens: int
    """Token budget of one step."""
    chunked_prefill_size: int
    """Most prompt tokens one request computes in one step."""
    max_running_requests: int
    """Requests running at once (slots)."""
    micro_batches: int
    """Steps in flight at once over disjoint requests (pipeline stages): a step takes its share
    of the requests on hand, and no request whose token a step in flight still owes."""


@dataclass
class Span:
    """Compute tokens [start, start + length) of `req` in this step; with speculation the last
    `len(draft)` of them are draft tokens to verify (a tree: node i hangs from node `parents[i]`,
    -1 being the token before them), of which `rejected` turn out wrong."""

    req: Request
    start: int
    length: int
    draft: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    rejected: int = 0

    @property
    def completes(self) -> bool:
        """The span reaches the request's last token, so a next token is sampled after it."""
        return self.start + self.length - len(self.draft) == self.req.num_total_tokens

    @property
    def computed_end(self) -> int:
        """Tokens of the request whose KV is right after this step."""
        return self.start + self.length - self.rejected


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preempted_total = 0
        self.free_slots = list(range(config.max_running_requests - 1, -1, -1))
        self.ended_slots: list[int] = []
        """Slots given back since the planner last looked (their requests ended or left)."""
        self.keep_pages_of: Callable[[Request], bool] | None = None
        """Asked when a request is preempted: True when the caller took its pages (a prefill
        keeps those of a prompt whose first pages are being sent), so they are not freed."""

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Span]:
        budget = self.config.max_num_batched_tokens
        spans: list[Span] = []
        share = self._share()
        for req in list(self.running):
            if budget == 0 or len(spans) == share:
                break
            if req.status is not Status.RUNNING or not self._ready(req):
                continue  # preempted earlier in this loop, or waiting for a step in flight
            span = self._next_span(req, budget)
            if not self._grow(req, span.length):
                continue
            spans.append(span)
            budget -= span.length
        while self._admits(budget) and len(spans) < share:
            req = self.waiting[0]
            if req.num_computed_tokens == 0 and req.rid not in self.kv.tables:
                cached = self.kv.match_prefix(req.rid, req.all_ids[: req.prefix_limit])
                req.num_computed_tokens = cached
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
            # a decode joining from its prefill may bring drafts
            span = self._next_span(req, budget)
            if not self.kv.allocate_slots(req.rid, req.num_computed_tokens + span.length):
                self.kv.free(req.rid)  # hold nothing while waiting
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status, req.slot = Status.RUNNING, self.free_slots.pop()
            if req.scheduled_time is None:
                req.scheduled_time = time.perf_counter()
            self.running.append(req)
            spans.append(span)
            budget -= span.length
        return spans

    def _share(self) -> int:
        """The most spans one step takes: all, or with micro-batches its share of the requests
        on hand."""
        on_hand = len(self.running) + len(self.waiting)
        return max(1, -(-on_hand // self.config.micro_batches))

    def _ready(self, req: Request) -> bool:
        """Whether `req` can be scheduled with steps in flight: not if its last token is owed,
        nor with micro-batches if any is (each step in flight has requests of its own)."""
        if req.ends_in_flight:
            return False
        return self.config.micro_batches == 1 or not req.num_pending_tokens

    def _admits(self, budget: int) -> bool:
        """Whether the queue's head may join now. A preempted request whose token is still owed by
        a step in flight waits for it (it recomputes with every token it has)."""
        return (
            bool(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_running_requests
            and not self.waiting[0].num_pending_tokens
        )

    def _next_span(self, req: Request, budget: int) -> Span:
        """The request's next chunk of prompt, or its newest token followed by its draft tokens."""
        left = req.num_total_tokens - req.num_computed_tokens
        n = min(left, self.config.chunked_prefill_size, budget)
        if n == 1 and req.draft_tokens and budget > len(req.draft_tokens):
            draft, parents = tuple(req.draft_tokens), tuple(req.draft_parents)
            return Span(req, req.num_computed_tokens, 1 + len(draft), draft, parents)
        return Span(req, req.num_computed_tokens, n)

    def _grow(self, req: Request, n: int) -> bool:
        """Pages for `n` more tokens of a running request, preempting from the back when short.
        A request alone that still cannot grow waits (preempted) while pages held past their
        requests (KV being sent) fill the pool, and is ended when it has outgrown the whole
        pool or when waiting requests hold the pages it lacks (once the token a step in flight
        samples for it has arrived)."""
        while not self.kv.allocate_slots(req.rid, req.num_computed_tokens + n):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                if req.num_pending_tokens:  # the token in flight is its own: take it first
                    return False
                pages = -(-(req.num_computed_tokens + n) // self.kv.page_size)
                if pages <= self.kv.num_pages and not self._queue_holds_pages():
                    self._preempt(req)  # it fits once the held pages come back
                    return False
                self.finish_and_free(
                    req, "abort", error="the KV cache is too small for this request"
                )
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _queue_holds_pages(self) -> bool:
        """Whether waiting requests hold pages (a decode's prompts received, not yet running):
        those come back only once they run, so a request waiting for them would wait forever."""
        return any(self.kv.tables.get(r.rid) for r in self.waiting)

    def _preempt(self, req: Request) -> None:
        self._leave(req)
        if self.keep_pages_of is None or not self.keep_pages_of(req):
            self.kv.free(req.rid)
        req.draft_tokens, req.draft_parents = [], []  # the recomputed prompt drafts anew
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.preempted_total += 1

    def _leave(self, req: Request) -> None:
        """`req` stops running: its slot goes back."""
        self.running.remove(req)
        self.free_slots.append(req.slot)
        self.ended_slots.append(req.slot)
        req.slot = None

    def launched(self, spans: list[Span]) -> None:
        """The spans are in a step: their tokens count as computed (a verify's rejected ones are
        taken back by `verified`), and each span that samples owes its request a token."""
        for span in spans:
            req = span.req
            if span.completes:
                req.num_pending_tokens += 1
            req.num_computed_tokens = span.start + span.length
            self.kv.commit(req.rid, req.all_ids, req.num_computed_tokens)

    def verified(self, span: Span, rejected: int) -> None:
        """A verify rejected the last `rejected` tokens of `span`: their pages go back at once."""
        span.rejected = rejected
        req = span.req
        req.num_computed_tokens = span.computed_end
        if rejected and req.status is Status.RUNNING:
            self.kv.trim(req.rid, span.computed_end)

    def received(self, req: Request) -> None:
        """A step's result for `req` arrived: publish the pages whose token ids are now known
        (unless it ended, or was preempted and holds no pages)."""
        if req.status is Status.RUNNING:
            self.kv.commit(req.rid, req.all_ids, req.num_computed_tokens)

    def finish_and_free(
        self, req: Request, reason: str, matched=None, error: str | None = None
    ) -> None:
        """End a request wherever it is (running, waiting or not yet added), give its slot and pages
        back, and record the end on it (`Request.finish`)."""
        if req in self.running:
            self._leave(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.rid)
        if not req.finished:
            req.finish(reason, matched, error)

    def live_rids(self) -> set[str]:
        return {r.rid for r in self.running} | {r.rid for r in self.waiting}
