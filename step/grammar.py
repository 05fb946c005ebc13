"""Structured output: a request's `json_schema`, `regex` or `ebnf` enforced with xgrammar.

The front compiles a request's grammar once to refuse a bad one (HTTP 400) before it starts. Each
rank that samples (the last pipeline stage; every rank of an attention group alike) keeps a
`GrammarState` per request: xgrammar's matcher, advanced by every token the request has, and
the mask of the tokens it allows next, applied to the logits before the draw. The matcher
reads the request's tokens on the host, so a step samples a grammar request only once the
tokens of the steps before it are there (like penalties; overlapped steps wait for them). The
grammar's stop tokens are the model's EOS ids: once it is complete only EOS is allowed, which
ends the request. Such requests decode without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("json_schema", "regex", "ebnf")


def grammar_of(params) -> tuple[str, str] | None:
    """(kind, source) of the request's grammar, or None."""
    for kind in KINDS:
        value = getattr(params, kind)
        if value is not None:
            return kind, value
    return None


class Grammars:
    """Compiles grammars against one tokenizer (xgrammar caches each by its source)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xg

        info = xg.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.compiler = xg.GrammarCompiler(info)
        self.tokenizer = tokenizer

    def compile(self, kind: str, source: str):
        try:
            if kind == "json_schema":  # compact JSON: no runs of whitespace to wander into
                return self.compiler.compile_json_schema(source, any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            return self.compiler.compile_grammar(source)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"{kind} does not compile: {first}") from e

    def check(self, params) -> None:
        """A ValueError naming the field when the request's grammar is not usable."""
        found = grammar_of(params)
        if found is not None:
            self.compile(*found)

    def state(self, params) -> GrammarState:
        import xgrammar as xg

        matcher = xg.GrammarMatcher(self.compile(*grammar_of(params)))
        return GrammarState(matcher, params.grammar_after, self.tokenizer)


@dataclass
class GrammarState:
    """A request's matcher on a rank, and how many of its output tokens it has taken. With
    `after`, the matcher starts on the text that follows it: until then (`waiting`) nothing is
    masked, and the output is decoded to find it."""

    matcher: object
    after: str | None = None
    tokenizer: object = None
    taken: int = 0

    @property
    def waiting(self) -> bool:
        return self.after is not None

    @property
    def live(self) -> bool:
        return not self.waiting and not self.matcher.is_terminated()

    def advance(self, outputs: list[int]) -> None:
        if self.waiting:
            self._look_for_start(outputs)
        for token in outputs[self.taken :]:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} breaks the request's grammar")
            self.taken += 1

    def _look_for_start(self, outputs: list[int]) -> None:
        """Once the output's text holds `after`, the matcher takes the text after it within
        the token that ended it (where the grammar allows it: it was drawn unmasked) and every
        token after that token."""
        text = self.tokenizer.decode(outputs, skip_special_tokens=False)
        at = text.find(self.after)
        if at < 0:
            self.taken = len(outputs)
            return
        end = at + len(self.after)
        for k in range(len(outputs), 0, -1):  # the first k tokens hold the text up to `end`
            head = self.tokenizer.decode(outputs[: k - 1], skip_special_tokens=False)
            if len(head) < end:
                break
        rest = self.tokenizer.decode(outputs[:k], skip_special_tokens=False)[end:]
        self.after, self.taken = None, k
        if rest:  # unmasked text in the same token (e.g. a newline): taken where it fits
            self.matcher.accept_string(rest)


def apply_masks(logits: torch.Tensor, reqs) -> None:
    """Mask, in place, every row whose request has a live grammar to the tokens it allows
    (`reqs` carry `grammar`, advanced to their newest token)."""
    import xgrammar as xg

    rows = [i for i, r in enumerate(reqs) if r.grammar and r.grammar.live]
    if not rows:
        return
    mask = xg.allocate_token_bitmask(len(reqs), logits.shape[1])
    for row in rows:
        reqs[row].grammar.matcher.fill_next_token_bitmask(mask, row)
    xg.apply_token_bitmask_inplace(logits, mask.to(logits.device), indices=rows)
