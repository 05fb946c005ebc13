"""The messages of a step between the front and the ranks.

The front sends a `StepPlan`: per DP group the requests the ranks meet for the first time (their
tokens so far and how they sample, once), the changes to their page tables, the spans to compute
and the requests that ended. The ranks hold everything else themselves: each request's tokens (they
sampled them), page table and sampling parameters. A rank's attention-group leader
answers with a `StepResult`: per span, the tokens it yields, the next draft tree and the logprobs
asked for. No logits cross a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dserve.scheduler.request import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the ranks have not seen, or see again after a preemption."""

    slot: int
    """Its row in the ranks' per-request tables (unique among its DP group's live requests)."""
    token_ids: list[int]
    """Its prompt and the tokens generated so far."""
    prompt_len: int
    params: SamplingParams
    end_ids: tuple[int, ...] = ()
    """With `min_new_tokens`: the ids that would end it (EOS unless ignored, its stop token
    ids), masked out until it has that many tokens."""


@dataclass(frozen=True)
class PageUpdate:
    """The ranks' copy of a request's page table: keep its first `keep` pages, append `pages`."""

    slot: int
    keep: int
    pages: list[int]


@dataclass(frozen=True)
class KnownTokens:
    """Tokens of a request at positions [start, start + len(ids)) that the front has and a rank
    may not: with pipeline stages only the last samples, and the others learn its tokens here."""

    slot: int
    start: int
    ids: list[int]


@dataclass(frozen=True)
class PlannedSpan:
    """Compute tokens [start, start + length) of the request in `slot`. With a draft, its last
    `len(draft)` tokens are the draft tree to verify (node i's parent is `parents[i]`, -1 the
    token before them). The ranks know every token id, the newest one included."""

    slot: int
    start: int
    length: int
    draft: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    samples: bool = False
    """A next token is sampled (or the draft verified) after the span."""
    catch_up: bool = False
    """Speculation: the draft runs over the span's kept tokens."""
    proposes: bool = False
    """Speculation: the draft proposes the next tree after the span (pages are allocated)."""


@dataclass(frozen=True)
class GroupPlan:
    """One DP group's part of a step (empty: its ranks still join the collectives)."""

    ended: list[int] = field(default_factory=list)
    """Slots whose requests ended or were preempted: forgotten first."""
    new: list[NewRequest] = field(default_factory=list)
    known: list[KnownTokens] = field(default_factory=list)
    pages: list[PageUpdate] = field(default_factory=list)
    spans: list[PlannedSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(span.length for span in self.spans)


@dataclass(frozen=True)
class StepPlan:
    step: int
    groups: list[GroupPlan]
    overlaps: bool = False
    """The front plans the next step before this one's result: the ranks may hold the result
    back until the next plan (or a `Settle`) arrives, and launch that plan first."""


@dataclass(frozen=True)
class Settle:
    """Send every result still held back."""


@dataclass(frozen=True)
class SpanOutcome:
    """What a span that samples yields."""

    tokens: list[int]
    """The sampled token; after a verify, the accepted drafts and the target's own token."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    draft: list[int] = field(default_factory=list)
    """The next draft tree's tokens (speculation), in tree order."""
    draft_parents: list[int] = field(default_factory=list)
    inputs: "InputLogprobs | None" = None
    """With `logprob_start_len`: logprobs of prompt tokens the span's rows predict."""


@dataclass(frozen=True)
class InputLogprobs:
    """Logprobs of the prompt's tokens at positions [start, start + len(logprobs)) (each from
    the logits of the position before), with the top ones asked for."""

    start: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass(frozen=True)
class StepResult:
    step: int
    outcomes: list[SpanOutcome | None]
    """Per planned span of the group, in order; None for a span that samples nothing."""
    static_passes: int = 0
    """How many of the step's passes ran from static buffers (replayed CUDA graphs on a GPU)."""
