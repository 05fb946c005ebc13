"""What a finished or streaming request hands back, and incremental detokenisation with stop strings.

Streamed text never shows a character that a stop string could still take back, nor half of a
multi-byte character: such a tail is held until the next token decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dserve.scheduler.request import Request


@dataclass
class GenerateResult:
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"
    meta: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    rid: str
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new tokens since the previous chunk
    finished: bool
    result: GenerateResult | None = None  # set on the last chunk
    logprobs: list[float] | None = None
    """With `return_logprob`: those of `token_ids`."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[float | None] | None = None
    """With `logprob_start_len`, on the first chunk with tokens: the prompt's logprobs."""
    input_top_logprobs: list[list[tuple[int, float]]] | None = None


class TextTracker:
    """A request's text, decoded incrementally: each update decodes only the tokens since the last
    complete character, with the previous update's tokens before them for context (as vLLM and
    SGLang do: a tokenizer may render a token differently at the start of a text), so a long output
    costs the same per token as a short one. Text that ends in half a multi-byte character waits
    for the next token. A request with stop strings is decoded at every token (`update`, which
    looks for them); the others only when their text is read (a stream's `delta`, the result), so
    a step's tokens cost no tokenizer call where nobody reads them yet."""

    def __init__(self, tokenizer, req: Request):
        self.tokenizer, self.req = tokenizer, req
        self.stops = req.params.stop_strings
        self.longest_stop = max(map(len, self.stops), default=0)
        self.decoded = ""
        # output_ids[context:read] give the decoder the context of the tokens after
        self.context = 0
        self.read = 0  # output_ids[:read] are in self.decoded
        self.stopped = False  # cut at a stop string: later tokens add no text
        self.sent_chars = 0
        self.sent_tokens = 0

    @property
    def text(self) -> str:
        """The text so far; once the request ended, with any half character it ended on."""
        return self.text_so_far(self.req.finished)

    def text_so_far(self, final: bool) -> str:
        """The text so far, with the half character it ends on only when `final`."""
        if not self.stopped and self.read < len(self.req.output_ids):
            self._decode_new(complete_only=not final)
        return self.decoded

    def _decode_new(self, complete_only: bool) -> None:
        ids, skip = self.req.output_ids, self.req.params.skip_special_tokens
        before = self.tokenizer.decode(ids[self.context : self.read], skip_special_tokens=skip)
        window = self.tokenizer.decode(ids[self.context :], skip_special_tokens=skip)
        if len(window) > len(before) and not (complete_only and window.endswith("\ufffd")):
            self.decoded += window[len(before) :]
            self.context, self.read = self.read, len(ids)

    def update(self) -> str | None:
        """Decode the new tokens; returns the stop string matched, if any (the text is cut before it)."""
        if self.stopped:
            return None
        start = len(self.decoded)
        self._decode_new(complete_only=True)
        if not self.stops or len(self.decoded) == start:
            return None
        since = max(start - self.longest_stop + 1, 0)  # a stop ending in the new text
        hits = [
            (index, stop) for stop in self.stops if (index := self.decoded.find(stop, since)) >= 0
        ]
        if not hits:
            return None
        index, matched = min(hits)
        if self.req.params.no_stop_trim:
            index += len(matched)
        self.decoded, self.stopped = self.decoded[:index], True
        return matched

    def _safe_end(self, final: bool) -> int:
        text = self.text_so_far(final)
        end = len(text)
        if final:
            return end
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in self.stops:  # hold back a tail that may grow into a stop string
            for k in range(min(len(stop) - 1, end), 0, -1):
                if text[:end].endswith(stop[:k]):
                    end -= k
                    break
        return max(end, self.sent_chars)

    def delta(self, final: bool | None = None) -> tuple[str, list[int]]:
        """What is new; held back as while the request runs unless `final` (by default: whether
        it ended)."""
        final = self.req.finished if final is None else final
        end = self._safe_end(final)
        text, self.sent_chars = self.decoded[self.sent_chars : end], end
        tokens = self.req.output_ids[self.sent_tokens :]
        self.sent_tokens = len(self.req.output_ids)
        return text, tokens

    def chunk(self, result: GenerateResult | None = None, final: bool | None = None) -> StreamChunk:
        """What is new since the last chunk (the last one carries the result). `final=False`:
        computed as a running request's, though it ended (`EngineLoop`'s first token apart)."""
        start = self.sent_tokens
        text, tokens = self.delta(final)
        chunk = StreamChunk(self.req.rid, text, tokens, result is not None, result)
        if start == 0 and tokens and self.req.params.input_logprobs_from is not None:
            chunk.input_logprobs = list(self.req.input_logprobs)
            chunk.input_top_logprobs = list(self.req.input_top_logprobs)
        if self.req.params.return_logprob:
            end = start + len(tokens)
            chunk.logprobs = self.req.token_logprobs[start:end]
            chunk.top_logprobs = self.req.top_logprobs[start:end]
        return chunk


def make_result(req: Request, text: str) -> GenerateResult:
    meta = {
        "prompt_tokens": len(req.prompt_ids),
        "cached_tokens": req.num_cached_tokens,
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finish_reason,
        "matched_stop": req.matched_stop,
        "num_preemptions": req.num_preemptions,
        "e2e_latency": (req.finish_time or 0) - req.arrival_time,
        "ttft": (req.first_token_time - req.arrival_time) if req.first_token_time else None,
        # when the request arrived, on the host's monotonic clock (`time.perf_counter`): a
        # client on the same host places its own marks against it (bench.pd_overhead)
        "arrival_s": round(req.arrival_time, 6),
    }
    meta.update(req.extra_meta)
    if req.error:
        meta["error"] = req.error
    if req.params.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.token_logprobs, req.output_ids))
        if req.params.top_logprobs_num:
            meta["output_top_logprobs"] = req.top_logprobs
    first = req.params.input_logprobs_from
    if first is not None:
        meta["input_token_logprobs"] = list(zip(req.input_logprobs, req.prompt_ids[first:]))
        meta["input_top_logprobs"] = req.input_top_logprobs
    return GenerateResult(req.rid, text, list(req.output_ids), req.finish_reason, meta)
