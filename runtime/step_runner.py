"""A rank's side of every step: a `StepPlan` in, the step's tokens out.

`launch(plan)` applies the plan to the rank's copy of its requests (`rank_state.py`), builds the
target pass from the planned spans, runs it, samples on the device and, with speculation, verifies
the drafts and runs the draft passes (`spec/`). A plain step leaves its sampled tokens on the
device, writes each request's newest token where the next step reads it (`ModelRunner.last_token`)
and starts copying them to the host; `finish` waits for that copy. So the next plan can be
launched before this step's tokens reach the host (overlapped scheduling). A speculative step
waits for its tokens inside `launch` (verification walks the tree on the host).

Every rank of an attention group runs the same code on the same full logits (the LM head gathers
the vocabulary), so all hold the same tokens and trees; the group's first rank answers the front.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dserve.attention.backend import PassShape
from dserve.spec.strategy import make_drafter
from dserve.spec.tree import ancestor_mask, depths, is_chain
from dserve.spec.verify import accepted_path, move_accepted, move_paths, verify_spans
from dserve.step.batch import Seq, assemble
from dserve.step.grammar import Grammars
from dserve.step.plan import (
    GroupPlan,
    InputLogprobs,
    PlannedSpan,
    SpanOutcome,
    StepPlan,
    StepResult,
)
from dserve.step.rank_state import RankRequests, RankSpan
from dserve.step.sampler import Sampled, Sampler, device_ints, has_penalties


def target_shape(group: GroupPlan) -> PassShape:
    spans = group.spans
    tree = any(s.draft and not is_chain(s.parents) for s in spans)
    return PassShape(
        group.num_tokens,
        max((s.length for s in spans), default=0),
        max((s.start + s.length for s in spans), default=0),
        tree,
    )


class HostCopy:
    """Tensors on their way to the host: pinned buffers and an event on a GPU."""

    def __init__(self, tensors: list[torch.Tensor | None]):
        self.event = None
        self.host = list(tensors)
        if any(t is not None and t.is_cuda for t in tensors):
            self.host = [None if t is None else _pinned_copy(t) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def done(self) -> bool:
        """Whether the tensors are on the host (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor | None]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens may still be on their way to the host."""

    step: int
    spans: list[RankSpan]
    sampling: list[RankSpan] = field(default_factory=list)
    """The spans whose token was sampled (not verified), in the sampler's row order."""
    copy: HostCopy | None = None
    sends: list = field(default_factory=list)
    """A pipeline stage before the last: its hidden states on their way to the next stage."""
    static_passes: int = 0
    resolved: bool = False
    sampled_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: tuple[list, list] | None = None
    inputs: dict[int, InputLogprobs] = field(default_factory=dict)
    """By span index: the prompt logprobs its rows gave."""

    def resolve(self) -> None:
        """Wait for the sampled tokens and give each request its token (idempotent)."""
        if self.resolved:
            return
        self.resolved = True
        if self.copy is None:
            return
        ids, logprobs, top_values, top_ids = self.copy.wait()
        self.sampled_ids = ids.tolist()
        self.logprobs = None if logprobs is None else logprobs.tolist()
        if top_values is not None:
            self.top = (top_values.tolist(), top_ids.tolist())
        for span, token in zip(self.sampling, self.sampled_ids):
            span.req.tokens.append(token)
            span.req.awaiting -= 1

    def outcomes(self) -> list[SpanOutcome | None]:
        """Per span, in plan order: None, or its tokens (the sampled one, or a verify's), the
        logprobs asked for and the next draft tree."""
        self.resolve()
        out, row = [], 0  # the sampled spans are in plan order too
        for i, span in enumerate(self.spans):
            inputs = self.inputs.get(i)
            if not span.plan.samples:
                out.append(SpanOutcome([], inputs=inputs) if inputs else None)
                continue
            draft, parents = span.draft_out or ([], [])
            if span.emitted is not None:
                out.append(SpanOutcome(span.emitted, None, None, draft, parents))
                continue
            logprob, top = self._logprobs(span, row)
            token = self.sampled_ids[row]
            out.append(SpanOutcome([token], logprob, top, draft, parents, inputs))
            row += 1
        return out

    def _logprobs(self, span: RankSpan, row: int):
        """([logprob of the chosen token], [its top logprobs]) where asked, else (None, None)."""
        params = span.req.params
        if not params.return_logprob or self.logprobs is None:
            return None, None
        n, top = params.top_logprobs_num, []
        if n and self.top is not None:
            values, ids = self.top
            top = list(zip(ids[row][:n], values[row][:n]))
        return [self.logprobs[row]], [top]


class StepRunner:
    """The steps of one rank, over its `ModelRunner`."""

    def __init__(self, runner, group: int = 0):
        """`group`: the index of this rank's DP group."""
        config = runner.config
        self.runner, self.group = runner, group
        self.page_size = config.page_size
        self.requests = RankRequests(config.max_running_requests, runner.max_pages)
        self.sampler = Sampler(runner.device, config.random_seed)
        self.last_stage = runner.ctx.stage.last
        self.drafter = make_drafter(config.speculative(), self) if self.last_stage else None
        self.trees: dict[int, PlannedSpan] = {}
        """A stage before the last: by slot, the verify span whose accepted path it has yet to
        learn (the last stage verifies and drafts; the others follow its verdicts)."""
        self.unresolved: deque[PendingStep] = deque()
        self.grammars: Grammars | None = None
        """Structured output: made at the first constrained request."""

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        mine = plan.groups[self.group]
        static_before = self.runner.static_passes
        if self.trees:
            self._follow_verdicts(mine)
        self.requests.apply(mine)
        spans = self._spans(mine)
        batch = self._target_batch(spans)
        if self.drafter is not None:
            self.drafter.fuse(batch, spans)
        shapes = [target_shape(g) for g in plan.groups]
        pending = PendingStep(plan.step, spans)
        if self.runner.ctx.stage.size == 1:
            logits = self.runner.forward(batch, shapes)
        else:
            logits = self._stage_pass(pending, batch, shapes)
            if not self.last_stage:
                self.trees.update((s.plan.slot, s.plan) for s in spans if s.plan.draft)
                return pending  # the last stage samples
        n = len(batch.logits_rows)
        self._input_logprobs(pending, logits[:n])
        self._sample(pending, logits[:n])
        if self.drafter is not None:
            self._speculate(plan, pending, logits[:n], logits[n:])
        pending.static_passes = self.runner.static_passes - static_before
        return pending

    def ready(self, pending: PendingStep) -> bool:
        """Whether `finish(pending)` would return without waiting for the device."""
        if any(not work.is_completed() for work, _ in pending.sends):
            return False
        return pending.copy is None or pending.resolved or pending.copy.done()

    def finish(self, pending: PendingStep) -> StepResult | None:
        """The step's result (waits for its tokens to reach the host); None on a pipeline stage
        before the last, once its hidden states have left."""
        for work, _ in pending.sends:
            work.wait()
        if not self.last_stage:
            return None
        outcomes = pending.outcomes()
        if pending in self.unresolved:
            self.unresolved.remove(pending)
        return StepResult(pending.step, outcomes, pending.static_passes)

    def _stage_pass(self, pending: PendingStep, batch, shapes) -> torch.Tensor:
        """This stage's layers over the pass: the previous stage's hidden states in (the first
        stage embeds the tokens), this stage's out to the next stage (the last: its logits)."""
        import torch.distributed as dist

        stage, runner = self.runner.ctx.stage, self.runner
        tokens = shapes[self.group].tokens  # the same group's rank in each stage
        hidden = None
        if not stage.first:
            hidden = runner.stage_input(batch, shapes, tokens)
            if tokens:
                dist.recv(hidden, src=stage.prev_rank)
        out = runner.forward(batch, shapes, hidden)
        if not stage.last and tokens:
            out = out.contiguous()
            pending.sends.append((dist.isend(out, dst=stage.next_rank), out))
        return out

    def _follow_verdicts(self, group: GroupPlan) -> None:
        """A stage before the last learns a verified span's tokens from the first plan after
        its result (the front sends them to every stage at once): the accepted path is the one
        the tokens take through the tree, and its nodes' KV moves to consecutive positions as
        on the last stage, before any page the front freed can be written again."""
        moves = []
        for known in group.known:
            span = self.trees.pop(known.slot, None)
            if span is None:
                continue
            emitted = known.ids[span.start + 1 - known.start :]
            moves.append((span.slot, span.start, accepted_path(span, emitted)))
        for slot in group.ended:
            self.trees.pop(slot, None)
        tables, pools = self.requests.tables, self.runner.verified_pools
        move_paths(moves, tables, self.page_size, pools)

    def _spans(self, group: GroupPlan) -> list[RankSpan]:
        """The planned spans with their rows: a span's prompt-logprob rows, then the row it
        samples after (or its draft's rows)."""
        spans, row, logits_row = [], 0, 0
        for p in group.spans:
            req = self.requests[p.slot]
            end = p.start + p.length
            inputs = range(0)
            if not p.draft:
                inputs = req.params.input_rows(req.prompt_len, p.start, end)
            logits_row += len(inputs)
            spans.append(RankSpan(p, req, row, logits_row, inputs))
            row += p.length
            logits_row += p.length if p.draft else int(p.samples)
        return spans

    def _target_batch(self, spans: list[RankSpan]):
        seqs = [self._seq(span) for span in spans]
        rows = self.requests.tables.rows([span.plan.slot for span in spans])
        return assemble(seqs, rows, self.page_size)

    @staticmethod
    def _seq(span: RankSpan) -> Seq:
        """A prompt chunk or decode token (logits after its last token when it samples), or a
        token and its draft to verify (logits after every token; a tree's nodes at their depth
        past the root, each seeing its ancestors)."""
        p, req = span.plan, span.req
        known = req.tokens_at(p.start, p.start + p.length - len(p.draft))
        if not p.draft:
            rows = [q - p.start for q in span.input_rows]
            return Seq(p.slot, p.start, known, rows + ([p.length - 1] if p.samples else []))
        seq = Seq(p.slot, p.start, known + list(p.draft), list(range(p.length)))
        if not is_chain(p.parents):
            seq.positions = [p.start] + [p.start + d for d in depths(p.parents)]
            seq.mask = ancestor_mask(p.parents)
        return seq

    @staticmethod
    def _input_logprobs(pending: PendingStep, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens after each span's input rows (waits for them)."""
        for i, span in enumerate(pending.spans):
            rows = span.input_rows
            if not rows:
                continue
            first = span.logits_row - len(rows)
            logprobs = logits[first : span.logits_row].float().log_softmax(dim=-1)
            after = [span.req.tokens[q + 1] for q in rows]
            index = torch.tensor(after, device=logits.device)[:, None]
            chosen = logprobs.gather(1, index)[:, 0].tolist()
            k = span.req.params.top_logprobs_num
            top = [[] for _ in rows]
            if k:
                best = logprobs.topk(k, dim=-1)
                pairs = zip(best.indices.tolist(), best.values.tolist())
                top = [list(zip(ids, values)) for ids, values in pairs]
            pending.inputs[i] = InputLogprobs(rows.start + 1, chosen, top)

    def _sample(self, pending: PendingStep, logits: torch.Tensor) -> None:
        """Sample after every span that samples and has no draft; the tokens stay on the device
        (and in `last_token`) while their copy to the host starts."""
        sampling = [s for s in pending.spans if s.plan.samples and not s.plan.draft]
        pending.sampling = sampling
        if not sampling:
            return
        reqs = [s.req for s in sampling]
        if any(has_penalties(r.params) or r.params.constrained for r in reqs):
            self._resolve_all()  # penalties and grammars read every token, in flight too
        self._advance_grammars(reqs)
        device = logits.device
        rows = device_ints([s.logits_row for s in sampling], device)
        positions = [s.plan.start + s.plan.length for s in sampling]
        sampled: Sampled = self.sampler.sample(logits[rows], reqs, positions)
        slots = device_ints([s.plan.slot for s in sampling], device)
        self.runner.last_token.index_copy_(0, slots, sampled.ids)
        for span in sampling:
            span.req.awaiting += 1
        fields = [sampled.ids, sampled.logprobs, sampled.top_values, sampled.top_ids]
        pending.copy = HostCopy(fields)
        self.unresolved.append(pending)

    def _advance_grammars(self, reqs) -> None:
        """Each constrained request's matcher (made at its first draw here) advanced to its
        newest token."""
        for req in reqs:
            if not req.params.constrained:
                continue
            if req.grammar is None:
                req.grammar = self._grammars().state(req.params)
            req.grammar.advance(req.output_ids)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            from dserve.runtime.intake import load_tokenizer

            config, model = self.runner.config, self.runner.model_config
            tokenizer = load_tokenizer(config.model_path, config.load_format)
            stops = set(model.eos_token_ids) | {tokenizer.eos_token_id} - {None}
            self.grammars = Grammars(tokenizer, model.vocab_size, sorted(stops))
        return self.grammars

    def _resolve_all(self) -> None:
        while self.unresolved:
            self.unresolved.popleft().resolve()

    def _speculate(self, plan: StepPlan, pending: PendingStep, logits, draft_logits) -> None:
        """Verify the drafts, move accepted tree paths into place, then draft the next trees;
        the step's tokens are on the host by the end."""
        self._resolve_all()
        verifying = [s for s in pending.spans if s.plan.draft]
        verify_spans(verifying, logits, self.sampler)
        for span in verifying:
            span.req.tokens.extend(span.emitted)
        tables, pools = self.requests.tables, self.runner.verified_pools
        move_accepted(verifying, tables, self.page_size, pools)
        self.drafter.propose(plan, pending.spans, draft_logits)
