"""A request's parameters and state: the tokens it has, how many are computed, why it ended.

Fields of `SamplingParams` are named as SGLang names them. A request catches its
`num_computed_tokens` up to `num_tokens` (prompt, then each sampled token); the scheduler only ever
hands out spans of tokens to compute.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    """None: as many as the model's context leaves after the prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    min_new_tokens: int = 0
    """No end (EOS, stop token ids, stop strings) before this many tokens; the ids that end
    it are masked out until then."""
    no_stop_trim: bool = False
    """Keep the matched stop string at the end of the text."""
    logprob_start_len: int = -1
    """With `return_logprob`: also the logprobs of the prompt's tokens from this position on
    (-1: none). The prefix cache serves none of the positions they are computed at."""
    logit_bias: dict | None = None
    json_schema: str | None = None
    """Structured output: the text is JSON that this JSON schema (a string) accepts."""
    regex: str | None = None
    """Structured output: the text matches this regular expression."""
    ebnf: str | None = None
    """Structured output: the text is a sentence of this EBNF (GBNF) grammar."""
    grammar_after: str | None = None
    """Structured output: the grammar holds for the text after this one (e.g. `</think>`:
    the answer after a model's reasoning); the text before it is free."""
    """Token id (an int or its string, as OpenAI sends it) -> a value in [-100, 100] added to
    its logit before sampling."""

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def input_logprobs_from(self) -> int | None:
        """The first prompt position whose logprob is asked for (None: none)."""
        if not self.return_logprob or self.logprob_start_len < 0:
            return None
        return self.logprob_start_len

    def input_rows(self, prompt_len: int, start: int, end: int) -> range:
        """Of positions [start, end), those whose logits give a prompt token's logprob (the
        token after them; the prompt's last position samples instead)."""
        first = self.input_logprobs_from
        if first is None:
            return range(0)
        return range(max(start, first - 1, 0), min(end, prompt_len - 1))

    @property
    def bias(self) -> list[tuple[int, float]]:
        """`logit_bias` as (token id, value) pairs."""
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    @property
    def takes_drafts(self) -> bool:
        """Speculation: whether a token's processing is independent of the tokens before it in the
        step (no penalties), the target's distribution is the model's own (no bias, no masks) and
        nothing per token is reported (no logprobs)."""
        return (
            not self.return_logprob
            and self.repetition_penalty == 1.0
            and not self.frequency_penalty
            and not self.presence_penalty
            and not self.logit_bias
            and not self.min_new_tokens
            and not self.constrained
        )

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (structured output)."""
        return any(x is not None for x in (self.json_schema, self.regex, self.ebnf))

    def validate(self, vocab_size: int) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(
            self.max_new_tokens is None
            or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
            f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
        )
        check(
            _number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}",
        )
        check(
            _number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (off) or >= 1, got {self.top_k!r}",
        )
        check(
            _number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        check(
            _number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check(_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        check(
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an integer, got {self.seed!r}",
        )
        check(
            isinstance(self.top_logprobs_num, int) and 0 <= self.top_logprobs_num <= 20,
            f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num!r}",
        )
        stops = self.stop_strings
        check(
            all(isinstance(s, str) and s for s in stops),
            "stop must be a non-empty string or a list of them",
        )
        ids = self.stop_token_ids or []
        check(
            all(isinstance(t, int) and 0 <= t < vocab_size for t in ids),
            f"stop_token_ids must be token ids in [0, {vocab_size})",
        )
        check(
            isinstance(self.logprob_start_len, int) and self.logprob_start_len >= -1,
            f"logprob_start_len must be -1 or a prompt position, got {self.logprob_start_len!r}",
        )
        check(
            isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
            f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}",
        )
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "return_logprob"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be true or false, got {value!r}")
        _check_bias(self.logit_bias, vocab_size)
        _check_grammar(self)


def _check_grammar(p: SamplingParams) -> None:
    given = [k for k in ("json_schema", "regex", "ebnf") if getattr(p, k) is not None]
    if not given:
        return
    for kind in given:
        if not isinstance(getattr(p, kind), str):
            raise ValueError(f"{kind} must be a string")
    if len(given) > 1:
        raise ValueError(f"give one grammar, not {' and '.join(given)}")
    if p.grammar_after is not None and not (isinstance(p.grammar_after, str) and p.grammar_after):
        raise ValueError("grammar_after must be a non-empty string")
    if p.ignore_eos or p.min_new_tokens:
        what = "ignore_eos" if p.ignore_eos else "min_new_tokens"
        raise ValueError(f"{what} cannot be used with {given[0]}: the grammar decides the end")


def _check_bias(bias, vocab_size: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object of token id -> bias")
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})")
        if not _number(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias: the bias of {key} must be in [-100, 100]")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request as the front sees it. Tokens sampled by a step still in flight are counted in
    `num_pending_tokens` until the step's result arrives (overlapped scheduling)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    """Tokens that steps in flight sample for it, not yet known here."""
    stop_length: int = 0
    """The token count at which it ends whatever it samples (its max_new_tokens, the context;
    on a prefill instance its first token); 0: not set."""
    slot: int | None = None
    """Its row in the ranks' per-request tables while it runs."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    """`stop`, `length` or `abort`."""
    matched_stop: int | str | None = None
    error: str | None = None
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    """With `logprob_start_len`: per prompt position from there, its token's logprob (None for
    the first token, which nothing predicts)."""
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None
    """When a step first took it from the queue."""
    first_token_time: float | None = None
    finish_time: float | None = None
    extra_meta: dict = field(default_factory=dict)
    """E.g. KV transfer figures, merged into the result's meta."""
    draft_tokens: list[int] = field(default_factory=list)
    """Speculative: proposals the next step verifies."""
    draft_parents: list[int] = field(default_factory=list)
    """Their tree: each one's parent (-1: the newest token)."""
    accepted_per_step: list[int] = field(default_factory=list)
    """Speculative: drafts accepted by each verify."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known here: the prompt and the outputs whose results arrived."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total_tokens(self) -> int:
        """Tokens it will have once the steps in flight report: what scheduling counts."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def prefix_limit(self) -> int:
        """How many of its first tokens the prefix cache may serve: all, or with prompt
        logprobs those before the first position they are computed at."""
        rows = self.params.input_rows(len(self.prompt_ids), 0, len(self.prompt_ids))
        return rows.start + 1 if rows else self.num_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ends_in_flight(self) -> bool:
        """Its last token is being sampled by a step in flight: nothing more to schedule."""
        return bool(self.stop_length) and self.num_total_tokens >= self.stop_length

    def finish(self, reason: str, matched: int | str | None = None, error: str | None = None):
        """Record the end (status, reason, time); frees nothing: a scheduled request ends
        through `Scheduler.finish_and_free`, which also gives its pages and slot back."""
        self.status, self.finish_reason = Status.FINISHED, reason
        self.matched_stop, self.error = matched, error
        self.finish_time = time.perf_counter()
