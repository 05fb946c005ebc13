"""The programmatic engine: `Engine(model_path, **EngineConfig fields)`, `generate`,
`generate_stream`.

`step` is a pipeline: schedule and plan the next step (`planner.py`), launch it on the ranks
(`executor.py`), then read the oldest step's result and process it (append tokens, stop, free the
pages of finished requests at once). Sampling, verification and drafting run on the ranks. With
overlapped scheduling (on unless `disable_overlap_schedule`) a step whose outcome nothing depends
on (no drafts) is planned while the one before it still runs, so the front's work hides behind the
device's. `add_request` / `step` / `abort` are the lower-level loop that the HTTP server drives.

KV that comes from or goes to another instance goes through `connector` (`connector.py`): the
engine asks it how much of a prompt arrives from elsewhere and tells it what it allocated and when
a request ends or is preempted; pages may outlive their request (`hold` / `release`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dserve.runtime.config import EngineConfig
from dserve.runtime.connector import KVConnector, Prefilled
from dserve.runtime.executor import RankFailure, make_executor
from dserve.runtime.intake import NoTokenizer, as_params, batch_inputs, load_tokenizer, prompt_ids
from dserve.runtime.output import GenerateResult, StreamChunk, TextTracker, make_result
from dserve.runtime.planner import LaunchedStep, Planner
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request
from dserve.scheduler.scheduler import Scheduler, Span
from dserve.spec.strategy import make_speculation
from dserve.spec.tree import well_formed
from dserve.step.grammar import Grammars
from dserve.step.plan import InputLogprobs, SpanOutcome, StepResult
from dserve.transfer.agent import AgentConfig

log = logging.getLogger("dserve.runtime")


@dataclass
class DPGroup:
    """One attention group's requests and KV pages (one group without DP attention)."""

    scheduler: Scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def load(self) -> int:
        running, waiting = self.scheduler.running, self.scheduler.waiting
        return sum(r.num_tokens for r in running) + sum(r.num_tokens for r in waiting)


class Engine:
    def __init__(self, model_path: str, transfer: AgentConfig | None = None, **kwargs):
        """`transfer` starts a KV transfer agent on every rank (prefill and decode instances)."""
        self.config = c = EngineConfig(model_path, **kwargs)
        torch.manual_seed(c.random_seed)  # dummy weights (load_format=dummy) are drawn from it
        self.executor = make_executor(c, transfer)
        self.model_config = self.executor.model_config
        self.tokenizer = load_tokenizer(model_path, c.load_format)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_context = self.model_config.max_position_embeddings
        pipelined = c.pp_size > 1
        limits = c.scheduler()
        self.groups = [
            DPGroup(Scheduler(limits, KVCacheManager(pages, c.page_size, c.enable_prefix_caching)))
            for pages in self.executor.num_pages
        ]
        self.pool_tokens = min(g.kv.num_pages for g in self.groups) * c.page_size
        self.requests: dict[str, Request] = {}
        self.trackers: dict[str, TextTracker] = {}
        self.group_of: dict[str, int] = {}
        self.held: dict[str, tuple[int, str]] = {}
        """Holder -> (DP group, rid) of pages in flight (`hold`)."""
        self.connector = KVConnector(self)
        """KV from or to elsewhere (a disaggregated instance's role sets its own)."""
        self.arriving: list[Request] = []
        """Requests whose prompt's KV arrives from elsewhere, waiting for pages."""
        for group in self.groups:
            group.scheduler.keep_pages_of = self._keep_preempted
        self.speculation = make_speculation(c.speculative())
        self.planner = Planner(
            [g.scheduler for g in self.groups],
            self.speculation,
            overlap=not c.disable_overlap_schedule,
            pipelined=pipelined,
            eos_ids=frozenset(self.eos_token_ids),
        )
        self.in_flight: deque[LaunchedStep] = deque()
        self.generated_tokens = 0
        """Tokens this engine's steps sampled so far (not a decode's first token: its prefill
        sampled it)."""
        self._grammars: Grammars | None = None
        self.depth = limits.micro_batches if pipelined else 1 + (not c.disable_overlap_schedule)
        """Steps in flight at most: one, two with overlapped scheduling, a pipeline's micro-batches."""

    # ---- request lifecycle ----------------------------------------------------------------
    def make_request(
        self, prompt=None, input_ids=None, sampling_params=None, rid: str | None = None
    ) -> Request:
        params = as_params(sampling_params)
        params.validate(self.model_config.vocab_size)
        if params.constrained:
            self.grammars().check(params)
        vocab, context = self.model_config.vocab_size, self.max_context
        ids = prompt_ids(self.tokenizer, prompt, input_ids, vocab, context, self.pool_tokens)
        req = Request(rid or uuid.uuid4().hex, ids, params)
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        first = params.input_logprobs_from
        if first is not None:
            if first >= len(ids):
                raise ValueError(
                    f"logprob_start_len must be below the prompt's length ({len(ids)} tokens)"
                )
            req.input_logprobs = [None] * (len(ids) - first)
            req.input_top_logprobs = [[] for _ in range(len(ids) - first)]
        return req

    def grammars(self) -> Grammars:
        """The front's grammar compiler (checks structured-output requests), made on first use."""
        if self._grammars is None:
            if isinstance(self.tokenizer, NoTokenizer):
                raise ValueError("structured output needs the model's tokenizer")
            vocab = self.model_config.vocab_size
            self._grammars = Grammars(self.tokenizer, vocab, sorted(self.eos_token_ids))
        return self._grammars

    def add_request(
        self, prompt=None, input_ids=None, sampling_params=None, rid: str | None = None
    ) -> str:
        return self.submit(self.make_request(prompt, input_ids, sampling_params, rid))

    def submit(self, req: Request) -> str:
        self.track(req)
        if self.connector.arriving_tokens(req):
            self.arriving.append(req)  # its pages come in `poll`
            return req.rid
        group = self._least_loaded()
        self.group_of[req.rid] = group
        self.groups[group].scheduler.add(req)
        return req.rid

    def _least_loaded(self) -> int:
        return min(range(len(self.groups)), key=lambda g: self.groups[g].load)

    def track(self, req: Request) -> None:
        """Know a request (its output can be read) before any DP group holds it."""
        self.requests[req.rid] = req
        self.trackers.setdefault(req.rid, TextTracker(self.tokenizer, req))
        capped = self.connector.max_new_tokens(req)
        if capped is not None:
            req.stop_length = len(req.prompt_ids) + capped
        else:
            most = req.params.max_new_tokens
            wanted = self.max_context if most is None else len(req.prompt_ids) + most
            req.stop_length = min(wanted, self.max_context)

    def abort(self, rid: str) -> None:
        """End a request wherever it is; its pages are free when this returns (a step in flight
        that computes it has its result for it dropped)."""
        req = self.requests.get(rid)
        if req is not None and not req.finished:
            self._scheduler(req).finish_and_free(req, "abort", error="aborted")

    def pop_result(self, rid: str) -> GenerateResult:
        result = make_result(self.requests[rid], self.trackers[rid].text)
        self.forget(rid)
        return result

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.trackers.pop(rid, None)
        self.group_of.pop(rid, None)

    # ---- the loop ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.in_flight) or any(g.scheduler.has_work for g in self.groups)

    stalled = False
    """The last step launched nothing and had nothing in flight: the waiting requests wait for
    pages held past their requests (KV being sent) or for new work."""

    def step(self) -> list[Request]:
        """Plan and launch the next step, then process the results that are due: the oldest ones
        beyond `depth` steps in flight when this step needs none of them, else everything
        launched. Returns the requests that got tokens or ended."""
        try:
            launched = self.planner.plan()
            if launched is not None:
                self.executor.submit(launched.plan)
                self.in_flight.append(launched)
            done = []
            keep = self.depth - 1 if launched is not None and launched.independent else 0
            self.stalled = launched is None and not self.in_flight
            while len(self.in_flight) > keep:
                done += self._process(self.in_flight.popleft(), self.executor.collect())
        except RankFailure as e:
            self.in_flight.clear()
            self._fail_all(str(e))
            raise
        return done + [r for r in self.requests.values() if r.finished and r not in done]

    def _process(self, launched: LaunchedStep, results: list[StepResult]) -> list[Request]:
        done = []
        for g, (spans, result) in enumerate(zip(launched.spans, results)):
            for span, outcome in zip(spans, result.outcomes):
                if outcome is not None and self._take(g, span, outcome):
                    done.append(span.req)
        return done

    def _take(self, g: int, span: Span, outcome: SpanOutcome) -> bool:
        """Apply a span's outcome to its request; False when it ended while the step ran."""
        req = span.req
        if outcome.inputs is not None and not req.finished:
            self._take_inputs(req, outcome.inputs)
        if not outcome.tokens:  # only prompt logprobs: nothing sampled
            return False
        req.num_pending_tokens -= 1
        if req.finished:
            return False
        scheduler = self.groups[g].scheduler
        if span.draft:
            scheduler.verified(span, len(span.draft) - (len(outcome.tokens) - 1))
        for i, token in enumerate(outcome.tokens):
            if outcome.logprobs is not None and req.params.return_logprob:
                req.token_logprobs.append(outcome.logprobs[i])
                req.top_logprobs.append(outcome.top_logprobs[i])
            self._append(req, token)
            if req.finished:
                break
        self.speculation.settle(span, outcome)
        scheduler.received(req)
        return True

    @staticmethod
    def _take_inputs(req: Request, inputs: InputLogprobs) -> None:
        """Prompt logprobs by position (a recomputed prompt gives the same ones again)."""
        base = req.params.logprob_start_len
        for i, (logprob, top) in enumerate(zip(inputs.logprobs, inputs.top)):
            at = inputs.start + i - base
            req.input_logprobs[at] = logprob
            req.input_top_logprobs[at] = [tuple(x) for x in top]

    def _append(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        self.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self._check_finish(req, token)

    def _fail_all(self, message: str) -> None:
        for req in self.requests.values():
            if req.finished:
                continue
            if req.rid in self.group_of:
                self._scheduler(req).finish_and_free(req, "abort", error=message)
            else:  # its prompt's KV was still to arrive: it holds nothing
                req.finish("abort", error=message)

    def _scheduler(self, req: Request) -> Scheduler:
        return self.groups[self.group_of[req.rid]].scheduler

    def _check_finish(self, req: Request, token: int) -> None:
        p = req.params
        matched = None
        if p.stop and len(req.output_ids) >= p.min_new_tokens:
            matched = self.trackers[req.rid].update()
        scheduler = self._scheduler(req)
        capped = self.connector.max_new_tokens(req) is not None
        stop_token = bool(p.stop_token_ids) and token in p.stop_token_ids
        eos = not p.ignore_eos and token in self.eos_token_ids
        if capped and req.num_tokens >= req.stop_length:  # whatever the token
            self.connector.request_finished(req)  # it may hold the pages first
            scheduler.finish_and_free(req, "length")
        elif stop_token or eos:
            scheduler.finish_and_free(req, "stop", token)
        elif matched is not None:
            scheduler.finish_and_free(req, "stop", matched)
        elif req.num_tokens >= req.stop_length:
            scheduler.finish_and_free(req, "length")

    # ---- KV from or to elsewhere (the connector's side) ---------------------------------------
    def poll(self) -> bool:
        """Between steps: pages for the prompts whose KV arrives, then the connector's events
        and deadlines. True when a request joined or ended (its answer may go out)."""
        self._allocate_arriving()
        return self.connector.poll()

    def _allocate_arriving(self) -> None:
        """Pages for each arriving prompt, in the least loaded DP group, while the pools have
        them; the connector hears of each allocation."""
        for req in list(self.arriving):
            if req.finished:
                self.arriving.remove(req)
                continue
            group = self._least_loaded()
            kv = self.groups[group].kv
            if not kv.allocate_slots(req.rid, len(req.prompt_ids)):
                kv.free(req.rid)
                continue
            self.arriving.remove(req)
            self.group_of[req.rid] = group
            self.connector.allocated(req, list(kv.tables[req.rid]))

    def join(self, rid: str, prefilled: Prefilled) -> None:
        """The prompt's KV (and the draft's, with speculation) is in the pages; the first token
        computed elsewhere joins and decoding starts, verifying its draft tokens first. A seeded
        request's draws depend on its seed and each token's position only, so this engine draws
        what a colocated one would."""
        req = self.requests[rid]
        spec, vocab = self.speculation, self.model_config.vocab_size
        tokens, parents = prefilled.draft_tokens, prefilled.draft_parents
        if tokens and well_formed(tokens, parents, vocab, spec.num_nodes, spec.num_steps):
            req.draft_tokens, req.draft_parents = list(tokens), list(parents)
        if prefilled.input_logprobs is not None:
            req.input_logprobs = list(prefilled.input_logprobs)
            top = prefilled.input_top_logprobs
            req.input_top_logprobs = [[tuple(x) for x in row] for row in top]
        req.num_computed_tokens = len(req.prompt_ids)
        req.output_ids.append(prefilled.token)
        req.first_token_time = time.perf_counter()
        if req.params.return_logprob and prefilled.logprob is not None:
            req.token_logprobs.append(prefilled.logprob)
            req.top_logprobs.append([tuple(x) for x in prefilled.top_logprobs])
        self._check_finish(req, prefilled.token)
        if not req.finished:
            self._scheduler(req).add(req)

    def _keep_preempted(self, req: Request) -> bool:
        return self.connector.request_preempted(req)

    def dp_group(self, rid: str) -> int:
        """The DP group that holds `rid`'s pages."""
        return self.group_of[rid]

    # ---- pages that outlive their request ------------------------------------------------------
    def hold(self, rid: str, why: str) -> str:
        """Keep `rid`'s pages after it ends (KV being sent, or receives not yet settled);
        returns their holder, to `release` them with."""
        group = self.group_of[rid]
        holder = f"{rid}#{why}"
        self.groups[group].kv.hold(rid, holder)
        self.held[holder] = (group, rid)
        return holder

    def written_tokens(self, req: Request) -> int:
        """Tokens of `req` whose KV the steps read back so far have written (a step still in
        flight may be writing the rest): what a prefill may send of a prompt it computes."""
        flying = sum(
            s.length
            for step in self.in_flight
            for group in step.spans
            for s in group
            if s.req is req
        )
        return max(0, req.num_computed_tokens - flying)

    def pages_of(self, rid: str) -> list[int]:
        """The pages of a running request, in order."""
        return list(self.groups[self.group_of[rid]].kv.tables[rid])

    def held_pages(self, holder: str) -> list[int]:
        group, _ = self.held[holder]
        return list(self.groups[group].kv.tables[holder])

    def release(self, holder: str) -> None:
        group, _ = self.held.pop(holder)
        self.groups[group].kv.free(holder)

    # ---- convenience ---------------------------------------------------------------------------
    def generate(self, prompts=None, input_ids=None, sampling_params=None):
        """One result per prompt (a list for a list, a single result for a single prompt)."""
        rows, single = batch_inputs(prompts, input_ids, sampling_params)
        reqs = [self.make_request(*row) for row in rows]
        for req in reqs:
            self.submit(req)
        while not all(r.finished for r in reqs):
            self.step()
        results = [self.pop_result(r.rid) for r in reqs]
        return results[0] if single else results

    def generate_stream(
        self, prompt=None, input_ids=None, sampling_params=None
    ) -> Iterator[StreamChunk]:
        rid = self.add_request(prompt, input_ids, sampling_params)
        req, tracker = self.requests[rid], self.trackers[rid]
        try:
            while not req.finished:
                self.step()
                if req.finished:
                    break
                chunk = tracker.chunk()
                if chunk.text or chunk.token_ids:
                    yield chunk
            yield tracker.chunk(self.pop_result(rid))
        finally:
            if rid in self.requests:  # the consumer stopped early: abort and release
                self.abort(rid)
                self.forget(rid)

    def flush_cache(self) -> int | None:
        """Forget the prefix cache of every DP group when the engine is idle (nothing running,
        waiting or held); returns the pages forgotten, None when busy."""
        if self.has_work or self.held or any(not r.finished for r in self.requests.values()):
            return None
        return sum(g.kv.allocator.forget_cached() for g in self.groups)

    @property
    def preempted_total(self) -> int:
        return sum(g.scheduler.preempted_total for g in self.groups)

    def check_invariants(self) -> None:
        """Page accounting of every DP group: ended requests hold nothing, ref counts match
        tables."""
        for g, group in enumerate(self.groups):
            live = {
                rid
                for rid, r in self.requests.items()
                if not r.finished and self.group_of.get(rid) == g
            }
            live |= {key for key, (group_index, _) in self.held.items() if group_index == g}
            group.kv.check_invariants(live)
            assert group.scheduler.live_rids() <= live

    def shutdown(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.in_flight.clear()
        self.executor.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
