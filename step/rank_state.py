"""What a rank keeps of the requests it runs: their tokens, sampling parameters and page tables,
by slot (the row the front gave each running request).

A rank learns a request once (`NewRequest`) and from then on appends the tokens it samples itself,
so the front never sends a token back. The newest token of a request may still be on the device
only (its step's result not yet copied to the host): the next step reads it there
(`step/batch.pending_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dserve.scheduler.request import SamplingParams
from dserve.step.batch import pending_token
from dserve.step.grammar import GrammarState
from dserve.step.plan import GroupPlan, KnownTokens, NewRequest, PageUpdate, PlannedSpan


@dataclass
class RankRequest:
    slot: int
    tokens: list[int]
    """The prompt and every output token this rank has on the host."""
    prompt_len: int
    params: SamplingParams
    awaiting: int = 0
    """Tokens that steps in flight sampled for it, on the device only so far."""
    end_ids: tuple[int, ...] = ()
    """Masked out while it has fewer than `min_new_tokens` outputs (`NewRequest.end_ids`)."""
    grammar: GrammarState | None = None
    """Structured output: its matcher, made where it is first sampled."""

    @property
    def all_ids(self) -> list[int]:
        return self.tokens

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def learn(self, known: KnownTokens) -> None:
        """Take tokens the front knows (ones this rank sampled itself must agree)."""
        have = self.tokens[known.start : known.start + len(known.ids)]
        if known.start > len(self.tokens) or have != known.ids[: len(have)]:
            raise RuntimeError(f"slot {self.slot}: tokens from the front disagree with this rank's")
        self.tokens.extend(known.ids[len(have) :])

    def tokens_at(self, start: int, end: int) -> list[int]:
        """The ids at positions [start, end) (see `token_at`)."""
        if end <= len(self.tokens):
            return self.tokens[start:end]
        known = max(start, len(self.tokens))
        return self.tokens[start:] + [self.token_at(p) for p in range(known, end)]

    def token_at(self, position: int) -> int:
        """The id at `position`, or the stand-in of the newest one sampled (on the device)."""
        if position < len(self.tokens):
            return self.tokens[position]
        if self.awaiting and position == len(self.tokens) + self.awaiting - 1:
            return pending_token(self.slot)
        raise RuntimeError(
            f"slot {self.slot}: position {position} asked of a request with "
            f"{len(self.tokens)} tokens"
        )

    @classmethod
    def create(cls, new: NewRequest) -> RankRequest:
        return cls(new.slot, list(new.token_ids), new.prompt_len, new.params, end_ids=new.end_ids)


class PageTables:
    """Every slot's page table as a row of one array; `lengths` says how many pages each has."""

    def __init__(self, slots: int, max_pages: int):
        self.pages = np.zeros((slots, max_pages), dtype=np.int64)
        self.lengths = np.zeros(slots, dtype=np.int64)

    def update(self, change: PageUpdate) -> None:
        end = change.keep + len(change.pages)
        if end > self.pages.shape[1]:
            raise RuntimeError(
                f"slot {change.slot}: {end} pages is more than a sequence holds "
                f"({self.pages.shape[1]})"
            )
        self.pages[change.slot, change.keep : end] = change.pages
        self.lengths[change.slot] = end

    def clear(self, slot: int) -> None:
        self.lengths[slot] = 0

    def rows(self, slots: list[int]) -> np.ndarray:
        """The tables of `slots`, one row each, as wide as the longest."""
        width = int(self.lengths[slots].max()) if slots else 0
        return self.pages[slots, :width]


class RankRequests:
    """The live requests of one DP group as its ranks see them, kept in step with the plans."""

    def __init__(self, slots: int, max_pages: int):
        self.by_slot: dict[int, RankRequest] = {}
        self.tables = PageTables(slots, max_pages)

    def apply(self, plan: GroupPlan) -> None:
        for slot in plan.ended:
            self.by_slot.pop(slot, None)
            self.tables.clear(slot)
        for new in plan.new:
            self.by_slot[new.slot] = RankRequest.create(new)
        for known in plan.known:
            self.by_slot[known.slot].learn(known)
        for change in plan.pages:
            self.tables.update(change)

    def __getitem__(self, slot: int) -> RankRequest:
        return self.by_slot[slot]


@dataclass
class RankSpan:
    """A planned span on the rank: where its tokens and logits sit in the target pass, and once
    verified, the draft nodes it kept and the tokens it yields."""

    plan: PlannedSpan
    req: RankRequest
    row: int
    """Its first token's row in the pass."""
    logits_row: int
    """Its first row in the pass's logits that samples or verifies (when it has any)."""
    input_rows: range = range(0)
    """Its positions whose logits give prompt logprobs: the rows just before `logits_row`."""
    path: list[int] | None = None
    """Verified: the accepted draft nodes, root first."""
    emitted: list[int] | None = None
    """Verified: the accepted drafts' tokens and the target's own."""
    draft_out: tuple[list[int], list[int]] | None = None
    """The next draft tree it proposes: (tokens, parents)."""

    @property
    def kept(self) -> list[int]:
        """The rows of the span whose tokens stay: all, or the root and the accepted path."""
        if self.path is None:
            return list(range(self.plan.length))
        return [0] + [n + 1 for n in self.path]
