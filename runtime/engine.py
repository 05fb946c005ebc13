"""The programmatic engine: `Engine(model_path, **EngineConfig fields)`, `generate`, `generate_stream`.

The front: per DP group a scheduler picks spans, the executor runs them on the rank(s), the sampler picks
next tokens, and finished requests give their pages back at once. `add_request` / `step` / `abort`
are the lower-level loop that the HTTP server and the parallel ranks drive.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import torch

from dserve.runtime.batch import build_step_batches
from dserve.runtime.config import EngineConfig
from dserve.runtime.executor import RankFailure, make_executor
from dserve.runtime.output import GenerateResult, StreamChunk, TextTracker, make_result
from dserve.runtime.sampler import sample
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request, SamplingParams
from dserve.scheduler.scheduler import Scheduler, SchedulerConfig
from dserve.spec.decoding import Speculator
from dserve.spec.tree import well_formed
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
        return sum(r.num_tokens for r in self.scheduler.running) + sum(
            r.num_tokens for r in self.scheduler.waiting
        )


class NoTokenizer:
    """Stands in where a dummy-weight model directory has config.json only: prompts must come as
    input_ids, and outputs carry ids and no text."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise ValueError(
            "this model directory has no tokenizer (load_format=dummy): send input_ids"
        )

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def load_tokenizer(model_path: str, load_format: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        if load_format != "dummy":
            raise
        return NoTokenizer()


class Engine:
    def __init__(self, model_path: str, transfer: "AgentConfig | None" = None, **kwargs):
        """`transfer` starts a KV transfer agent on every rank (prefill and decode instances)."""
        self.config = EngineConfig(model_path, **kwargs)
        torch.manual_seed(self.config.random_seed)
        self.executor = make_executor(self.config, transfer)
        self.model_config = self.executor.model_config
        self.tokenizer = load_tokenizer(model_path, self.config.load_format)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_context = self.model_config.max_position_embeddings
        sched = SchedulerConfig(
            self.config.max_num_batched_tokens,
            self.config.chunked_prefill_size,
            self.config.max_running_requests,
        )
        self.groups = [
            DPGroup(
                Scheduler(
                    sched,
                    KVCacheManager(pages, self.config.page_size, self.config.enable_prefix_caching),
                )
            )
            for pages in self.executor.num_pages
        ]
        self.pool_tokens = min(g.kv.num_pages for g in self.groups) * self.config.page_size
        self.requests: dict[str, Request] = {}
        self.trackers: dict[str, TextTracker] = {}
        self.group_of: dict[str, int] = {}
        self.keep_pages: set[str] = set()  # prefill: requests whose pages outlive them, to be sent
        self.held: dict[
            str, tuple[int, str]
        ] = {}  # holder key -> (DP group, rid) of pages in flight
        c = self.config
        self.speculator = (
            Speculator(
                c.speculative_num_steps,
                self._execute,
                c.speculative_eagle_topk,
                c.speculative_num_draft_tokens,
                c.speculative_naive,
            )
            if c.speculative_algorithm
            else None
        )

    # ---- request lifecycle -------------------------------------------------------------------
    def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of a text prompt or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}")
            input_ids = self.tokenizer.encode(prompt)
        ids = list(input_ids)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"unknown token ids {bad[:5]}: ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_context} "
                f"tokens and at least one must be left to generate"
            )
        if len(ids) >= self.pool_tokens:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the KV cache holds only {self.pool_tokens}"
            )
        return ids

    def make_request(
        self, prompt=None, input_ids=None, sampling_params=None, rid: str | None = None
    ) -> Request:
        params = _as_params(sampling_params)
        params.validate(self.model_config.vocab_size)
        req = Request(rid or uuid.uuid4().hex, self.tokenize(prompt, input_ids), params)
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        seed = params.seed
        if seed is not None:
            req.generator = torch.Generator().manual_seed(
                seed
            )  # sampling runs on the front, on the CPU
        return req

    def add_request(
        self, prompt=None, input_ids=None, sampling_params=None, rid: str | None = None
    ) -> str:
        return self.submit(self.make_request(prompt, input_ids, sampling_params, rid))

    def submit(self, req: Request) -> str:
        self.requests[req.rid] = req
        self.trackers[req.rid] = TextTracker(self.tokenizer, req)
        group = min(
            range(len(self.groups)), key=lambda g: self.groups[g].load
        )  # DP attention: least loaded
        self.group_of[req.rid] = group
        self.groups[group].scheduler.add(req)
        return req.rid

    def abort(self, rid: str) -> None:
        """End a request wherever it is; its pages are free when this returns."""
        req = self.requests.get(rid)
        if req is not None and not req.finished:
            self._scheduler(req).finish(req, "abort", error="aborted")

    def pop_result(self, rid: str) -> GenerateResult:
        result = make_result(self.requests[rid], self.trackers[rid].text)
        self._forget(rid)
        return result

    def forget(self, rid: str) -> None:
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.trackers.pop(rid, None)
        self.group_of.pop(rid, None)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One forward pass over the scheduled spans of every DP group; returns the requests that got
        a new token or ended."""
        plans = [g.scheduler.schedule() for g in self.groups]
        if not any(plans):
            return [r for r in self.requests.values() if r.finished]
        batches = build_step_batches(plans, [g.kv for g in self.groups])
        if self.speculator is not None:
            self.speculator.fuse(plans, batches)
        group_logits = self._execute(batches)
        if self.speculator is not None:
            group_logits = self.speculator.split(batches, group_logits)
        done, rows, verified = [], [], []
        for g, (spans, group, logits) in enumerate(zip(plans, self.groups, group_logits)):
            row, argmax = (
                0,
                logits.argmax(dim=-1).tolist() if any(span.draft for span in spans) else None,
            )
            for span in spans:
                if (
                    span.draft
                ):  # speculative: the drafts the target agrees with, then its own next token
                    rows_of_span = slice(row, row + span.length)
                    tokens = self.speculator.verify(
                        span, logits[rows_of_span], argmax[rows_of_span], group.kv, g
                    )
                    verified.append((span.req, tokens))
                    row += span.length
                elif span.completes:
                    done.append(span.req)
                    rows.append(logits[row : row + 1])
                    row += 1
            group.scheduler.advance(spans)
        if done:
            self._append_sampled(done, sample(torch.cat(rows), done))
        for req, tokens in verified:
            for token in tokens:
                self._append(req, token)
                if req.finished:
                    break
        if self.speculator is not None:
            self.speculator.propose(plans, [g.kv for g in self.groups], self._pages_of)
        done += [req for req, _ in verified]
        return done + [r for r in self.requests.values() if r.finished and r not in done]

    def _pages_of(self, req: Request) -> str | None:
        """The key of a request's page table: its own while it runs, the holder's once its pages
        wait to be sent (prefill), None once it has none."""
        if not req.finished:
            return req.rid
        key = hold_key(req.rid, "send")
        return key if key in self.held else None

    def _execute(self, batches):
        if self.speculator is not None:
            self.speculator.attach_moves(batches)
        try:
            return self.executor.execute(batches)
        except RankFailure as e:
            self._fail_all(str(e))
            raise

    def _append_sampled(self, reqs: list[Request], out) -> None:
        for i, req in enumerate(reqs):
            if out.logprobs is not None and req.params.return_logprob:
                req.token_logprobs.append(out.logprobs[i])
                req.top_logprobs.append(out.top_logprobs[i])
            self._append(req, out.token_ids[i])

    def _append(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self._check_finish(req, token)

    def _fail_all(self, message: str) -> None:
        for req in self.requests.values():
            if not req.finished:
                self._scheduler(req).finish(req, "abort", error=message)

    def _scheduler(self, req: Request) -> Scheduler:
        return self.groups[self.group_of[req.rid]].scheduler

    def _check_finish(self, req: Request, token: int) -> None:
        p = req.params
        matched = self.trackers[req.rid].update()
        if (
            req.rid in self.keep_pages
        ):  # prefill: the first token ends it; its pages wait to be sent
            self.keep_pages.discard(req.rid)
            self.hold(req.rid, "send")
            self._scheduler(req).finish(req, "length")
        elif (
            p.stop_token_ids
            and token in p.stop_token_ids
            or not p.ignore_eos
            and token in self.eos_token_ids
        ):
            self._scheduler(req).finish(req, "stop", token)
        elif matched is not None:
            self._scheduler(req).finish(req, "stop", matched)
        elif len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.max_context:
            self._scheduler(req).finish(req, "length")

    # ---- pages that outlive their request (disaggregation) ----------------------------------------
    def hold(self, rid: str, why: str) -> str:
        """Keep `rid`'s pages after it ends (KV being sent, or receives not yet settled); returns the key
        to `release` them with."""
        group = self.group_of[rid]
        key = hold_key(rid, why)
        self.groups[group].kv.hold(rid, key)
        self.held[key] = (group, rid)
        return key

    def held_pages(self, key: str) -> list[int]:
        group, _ = self.held[key]
        return list(self.groups[group].kv.tables[key])

    def release(self, key: str) -> None:
        group, _ = self.held.pop(key)
        self.groups[group].kv.free(key)

    def prealloc(self, req: Request) -> list[int] | None:
        """Decode: pages for the whole prompt before its KV arrives; None while the pool is short."""
        group = min(range(len(self.groups)), key=lambda g: self.groups[g].load)
        kv = self.groups[group].kv
        if not kv.allocate_slots(req.rid, len(req.prompt_ids)):
            kv.free(req.rid)
            return None
        self.track(req)
        self.group_of[req.rid] = group
        return list(kv.tables[req.rid])

    def track(self, req: Request) -> None:
        """Know a request (its output can be read) before any DP group holds it."""
        self.requests[req.rid] = req
        self.trackers.setdefault(req.rid, TextTracker(self.tokenizer, req))

    def join_prefilled(
        self,
        rid: str,
        first_token: int,
        logprob: float | None = None,
        top_logprobs: list | None = None,
        draft_tokens: list[int] | None = None,
        rng_state: bytes | None = None,
        draft_parents: list[int] | None = None,
    ) -> None:
        """Decode: the prompt's KV (and the draft's, with speculation) is in the pages; the prefill's
        first token joins and decoding starts, verifying the prefill's draft tokens first. A seeded
        request's generator continues from the prefill's state, so its draws are the colocated ones."""
        req = self.requests[rid]
        if rng_state is not None and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
        parents = (
            list(range(-1, len(draft_tokens or []) - 1)) if draft_parents is None else draft_parents
        )
        spec, vocab = self.speculator, self.model_config.vocab_size
        if (
            spec is not None
            and draft_tokens
            and well_formed(draft_tokens, parents, vocab, spec.num_nodes, spec.num_steps)
        ):
            req.draft_tokens, req.draft_parents = list(draft_tokens), list(parents)
        req.num_computed_tokens = len(req.prompt_ids)
        req.output_ids.append(first_token)
        req.first_token_time = time.perf_counter()
        if req.params.return_logprob and logprob is not None:
            req.token_logprobs.append(logprob)
            req.top_logprobs.append([tuple(x) for x in top_logprobs or []])
        self._check_finish(req, first_token)
        if not req.finished:
            self._scheduler(req).add(req)

    # ---- convenience -----------------------------------------------------------------------------
    def generate(self, prompts=None, input_ids=None, sampling_params=None):
        """One result per prompt (a list for a list, a single result for a single prompt)."""
        single = isinstance(prompts, str) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], int)
        )
        texts = [prompts] if isinstance(prompts, str) else prompts
        ids = [input_ids] if single and input_ids is not None else input_ids
        n = len(texts) if texts is not None else len(ids or [])
        if texts is not None and ids is not None:
            raise ValueError("give prompts or input_ids, not both")
        if n == 0:
            raise ValueError("no prompts given")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        reqs = [
            self.make_request(texts[i] if texts else None, ids[i] if ids else None, params[i])
            for i in range(n)
        ]
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
                text, tokens = tracker.delta()
                if text or tokens:
                    yield StreamChunk(rid, text, tokens, False)
            text, tokens = tracker.delta()
            yield StreamChunk(rid, text, tokens, True, self.pop_result(rid))
        finally:
            if rid in self.requests:  # the consumer stopped early: abort and release
                self.abort(rid)
                self._forget(rid)

    @property
    def preempted_total(self) -> int:
        return sum(g.scheduler.preempted_total for g in self.groups)

    def check_invariants(self) -> None:
        """Page accounting of every DP group: ended requests hold nothing, ref counts match tables."""
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
        self.executor.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def hold_key(rid: str, why: str) -> str:
    """The key under which `Engine.hold(rid, why)` keeps a request's pages."""
    return f"{rid}#{why}"


def _as_params(value) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams.from_dict(value)
    raise ValueError(
        f"sampling_params must be a SamplingParams or a dict, got {type(value).__name__}"
    )
