"""The front's side of a step: each DP group's scheduled spans -> the `StepPlan` the ranks run.

Per group the planner tells the ranks only what they cannot know: requests they meet for the first
time (tokens and sampling parameters, once), the pages each request's table gained or lost since
the last plan, the spans with their drafts to verify, and the slots whose requests ended. The
speculation strategy marks which spans the draft follows and which propose a tree (and allocates
the tree's pages). Then the spans count as launched (`Scheduler.launched`): the next plan may be
made before this step's result arrives when nothing in it depends on that result (no drafts).
With pipeline stages only the last stage samples, and the others learn each request's new tokens
from the plan (`KnownTokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dserve.scheduler.request import Request
from dserve.scheduler.scheduler import Scheduler, Span
from dserve.spec.strategy import Speculation
from dserve.step.plan import (
    GroupPlan,
    KnownTokens,
    NewRequest,
    PageUpdate,
    PlannedSpan,
    StepPlan,
)


@dataclass
class LaunchedStep:
    """A plan on its way, with the spans it came from (per group), for reading its result."""

    plan: StepPlan
    spans: list[list[Span]]
    pipelined: bool = False

    @property
    def independent(self) -> bool:
        """Nothing in it depends on the results of the steps still in flight: it may go while
        they run (overlapped, or a micro-batch of its own)."""
        return self.plan.overlaps or self.pipelined


class Planner:
    def __init__(
        self,
        schedulers: list[Scheduler],
        speculation: Speculation,
        overlap: bool,
        pipelined: bool = False,
        eos_ids: frozenset[int] = frozenset(),
    ):
        self.schedulers, self.speculation = schedulers, speculation
        self.eos_ids = eos_ids
        self.overlap, self.pipelined = overlap and not pipelined, pipelined
        self.known_pages: list[dict[int, int]] = [{} for _ in schedulers]
        """Per group, per slot: how many pages of its table the ranks have."""
        self.known_tokens: list[dict[int, int]] = [{} for _ in schedulers]
        """Pipelined: per group, per slot, how many of its tokens every stage has."""
        self.steps = 0

    def plan(self) -> LaunchedStep | None:
        """Schedule every group and make the step's plan; None when no group has work."""
        spans = [s.schedule() for s in self.schedulers]
        if not any(spans):
            return None
        groups = [self._group(g, group_spans) for g, group_spans in enumerate(spans)]
        for scheduler, group_spans in zip(self.schedulers, spans):
            scheduler.launched(group_spans)
        predictable = not any(p.draft or p.catch_up or p.proposes for g in groups for p in g.spans)
        self.steps += 1
        plan = StepPlan(self.steps, groups, overlaps=self.overlap and predictable)
        return LaunchedStep(plan, spans, self.pipelined)

    def _group(self, g: int, spans: list[Span]) -> GroupPlan:
        scheduler, known, tokens = self.schedulers[g], self.known_pages[g], self.known_tokens[g]
        kv = scheduler.kv
        plan = GroupPlan(ended=scheduler.ended_slots)
        scheduler.ended_slots = []
        for slot in plan.ended:
            known.pop(slot, None)
            tokens.pop(slot, None)
        for span in spans:
            req = span.req
            catch_up, proposes = self.speculation.flags(span, kv)
            if req.slot not in known:
                plan.new.append(self._new(req))
                known[req.slot], tokens[req.slot] = 0, req.num_tokens
            elif self.pipelined and tokens[req.slot] < req.num_tokens:
                start = tokens[req.slot]
                plan.known.append(KnownTokens(req.slot, start, req.all_ids[start:]))
                tokens[req.slot] = req.num_tokens
            table = kv.tables[req.rid]
            first = kv.changed_from(req.rid, known[req.slot])
            if first < len(table) or len(table) != known[req.slot]:
                plan.pages.append(PageUpdate(req.slot, first, table[first:]))
                known[req.slot] = len(table)
            plan.spans.append(self._span(span, catch_up, proposes))
        if self.pipelined:
            self._tell_known(scheduler, plan, known, tokens)
        return plan

    @staticmethod
    def _tell_known(scheduler, plan: GroupPlan, known: dict, tokens: dict) -> None:
        """Stages before the last learn every running request's new tokens in the first plan
        after its result, scheduled or not: they follow a verify's verdict (the accepted path's
        KV moves) before any page it freed can be given to another request."""
        for req in scheduler.running:
            have = tokens.get(req.slot)
            if req.slot in known and have is not None and have < req.num_tokens:
                plan.known.append(KnownTokens(req.slot, have, req.all_ids[have:]))
                tokens[req.slot] = req.num_tokens

    def _new(self, req: Request) -> NewRequest:
        p = req.params
        end_ids = ()
        if p.min_new_tokens:
            ends = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos_ids))
            end_ids = tuple(sorted(ends))
        return NewRequest(req.slot, req.all_ids, len(req.prompt_ids), p, end_ids)

    def _span(self, span: Span, catch_up: bool, proposes: bool) -> PlannedSpan:
        return PlannedSpan(
            span.req.slot,
            span.start,
            span.length,
            span.draft,
            span.parents,
            samples=span.completes,
            catch_up=catch_up,
            proposes=proposes,
        )
