"""What the HTTP routes answer: the engine's output chunks of one HTTP request (one or more engine
requests, by index) -> SGLang's or OpenAI's JSON, whole or as SSE events.

Every chunk is taken (`Answer.take`, or `Answer.event` for a stream, which also says what to
send), and a whole answer is made from the same state once every choice ended. `/generate` streams the whole text so far in each event
(SGLang's default) or only what is new (`--incremental-streaming-output`); the OpenAI routes
stream what is new, with a closing usage chunk (empty `choices`) only when
`stream_options.include_usage` asks for it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from dserve.runtime.chat_output import ChatText, merge_deltas
from dserve.runtime.output import GenerateResult, StreamChunk
from dserve.runtime.protocol import GenerateInput
from dserve.scheduler.request import Request


@dataclass
class Choice:
    """One engine request's output as the client has been sent it so far."""

    index: int
    req: Request
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[int, float]]] = field(default_factory=list)
    result: GenerateResult | None = None
    started: bool = False
    sent_chars: int = 0

    def add(self, chunk: StreamChunk) -> None:
        self.text += chunk.text
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs or [])
        self.top.extend(chunk.top_logprobs or [])
        if chunk.input_logprobs is not None:
            self.input_logprobs = chunk.input_logprobs
            self.input_top = chunk.input_top_logprobs
        self.result = chunk.result or self.result

    @property
    def finish_reason(self) -> str | None:
        return self.result.finish_reason if self.result else None


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the character standing for each byte) inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_OF = _byte_level_map()


class TokenTexts:
    """Token id -> its text and its bytes (cached; the tokenizer is the engine's). A byte-level
    BPE token that holds part of a character has its own bytes, though its text cannot show
    them."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self.cache[token]

    def bytes_of(self, token: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token) if self.byte_level else None
        if piece and all(ch in BYTE_OF for ch in piece):
            return [BYTE_OF[ch] for ch in piece]
        return list(self(token).encode())


class Answer:
    """The answer to one HTTP request; `choices` in index order."""

    def __init__(self, inp: GenerateInput, reqs: list[Request], model: str, tokenizer):
        self.inp, self.model = inp, model
        self.choices = [Choice(i, req) for i, req in enumerate(reqs)]
        self.texts = TokenTexts(tokenizer)
        self.id = self.choices[0].req.rid
        self.created = int(time.time())

    def take(self, index: int, chunk: StreamChunk) -> None:
        """Take `chunk` of choice `index` (a whole answer)."""
        self.choices[index].add(chunk)

    def event(self, index: int, chunk: StreamChunk) -> list[dict]:
        """Take `chunk` of choice `index` (a stream); the SSE payloads it makes."""
        raise NotImplementedError

    def closing(self) -> list[dict]:
        """Payloads after every choice ended."""
        return []

    def whole(self) -> dict | list:
        raise NotImplementedError


class GenerateAnswer(Answer):
    """SGLang's `/generate`: text, output_ids, meta_info (an object, or a list for a batch)."""

    def __init__(self, inp, reqs, model, tokenizer, incremental: bool):
        super().__init__(inp, reqs, model, tokenizer)
        self.incremental = incremental

    def event(self, index: int, chunk: StreamChunk) -> list[dict]:
        c = self.choices[index]
        c.add(chunk)
        if self.incremental:
            piece = {"text": chunk.text, "output_ids": chunk.token_ids}
            meta = self._meta(c, len(c.ids) - len(chunk.token_ids))
        else:
            piece = {"text": c.text, "output_ids": list(c.ids)}
            meta = self._meta(c, 0)
        piece["meta_info"] = meta
        if self.inp.batched:
            piece["index"] = index
        return [piece]

    def whole(self) -> dict | list:
        bodies = []
        for c in self.choices:
            r = c.result
            bodies.append(
                {"text": r.text, "output_ids": r.output_ids, "meta_info": self._meta(c, 0)}
            )
        return bodies if self.inp.batched else bodies[0]

    def _meta(self, c: Choice, since: int) -> dict:
        """meta_info: the result's once it ended, else what is known so far; logprobs of the
        output tokens from `since` (SGLang's (logprob, id, text) triples)."""
        if c.result is not None:
            meta = {"id": c.req.rid, **c.result.meta}
        else:
            meta = {
                "id": c.req.rid,
                "finish_reason": None,
                "prompt_tokens": len(c.req.prompt_ids),
                "completion_tokens": len(c.ids),
                "cached_tokens": c.req.num_cached_tokens,
            }
        if c.req.params.input_logprobs_from is not None and c.result is not None:
            first = c.req.params.input_logprobs_from
            ids = c.req.prompt_ids[first:]
            meta["input_token_logprobs"] = [
                self._triple(lp, t) for lp, t in zip(c.input_logprobs, ids)
            ]
            meta["input_top_logprobs"] = [
                [self._triple(lp, t) for t, lp in top] for top in c.input_top
            ]
        if c.req.params.return_logprob:
            meta["output_token_logprobs"] = [
                self._triple(lp, t) for lp, t in zip(c.logprobs[since:], c.ids[since:])
            ]
            meta["output_top_logprobs"] = [
                [self._triple(lp, t) for t, lp in top] for top in c.top[since:]
            ]
        return meta

    def _triple(self, logprob: float | None, token: int) -> list:
        return [logprob, token, self.texts(token) if self.inp.text_in_logprobs else None]


class OpenAIAnswer(Answer):
    """What `/v1/completions` and `/v1/chat/completions` share: ids, usage, the closing chunk."""

    object_name = ""
    prefix = ""

    def __init__(self, inp, reqs, model, tokenizer):
        super().__init__(inp, reqs, model, tokenizer)
        self.options = inp.openai
        shared = inp.shared  # the pair's two instances answer as one
        self.id = self.prefix + (shared.id if shared else uuid.uuid4().hex[:24])
        if shared:
            self.created = shared.created

    def _base(self, name: str) -> dict:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict) -> dict:
        payload = {**self._base(self.object_name + ".chunk"), "choices": [choice]}
        if self.options.include_usage:
            payload["usage"] = None
        return payload

    def usage(self) -> dict:
        """Prompt tokens once per prompt (its first choice's), completion tokens of every choice."""
        firsts = self.choices[:: self.inp.n]
        prompt = sum(len(c.req.prompt_ids) for c in firsts)
        cached = sum(c.result.meta.get("cached_tokens", 0) for c in firsts)
        completion = sum(len(c.result.output_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def closing(self) -> list[dict]:
        if not self.options.include_usage:
            return []
        return [{**self._base(self.object_name + ".chunk"), "choices": [], "usage": self.usage()}]

    def _wants_logprobs(self) -> bool:
        return self.options.top_logprobs is not None


class CompletionAnswer(OpenAIAnswer):
    object_name = "text_completion"
    prefix = "cmpl-"

    def event(self, index: int, chunk: StreamChunk) -> list[dict]:
        c = self.choices[index]
        text, echo = chunk.text, not c.started and self.options.echo
        if echo:
            text = self._prompt_text(c) + text
        c.started = True
        c.add(chunk)
        if not (text or chunk.token_ids or chunk.finished):
            return []
        logprobs = None
        if self._wants_logprobs():
            ids, lps, tops = chunk.token_ids, chunk.logprobs, chunk.top_logprobs
            if echo:
                ids, lps, tops = self._with_prompt(c, ids, lps, tops)
            logprobs = self._logprobs(ids, lps, tops, c.sent_chars)
        c.sent_chars += len(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        # a stream's chunks are "text_completion" objects too
        return [{**self._chunk(choice), "object": self.object_name}]

    def whole(self) -> dict:
        out = []
        for c in self.choices:
            text = c.result.text
            if self.options.echo:
                text = self._prompt_text(c) + text
            logprobs = None
            if self._wants_logprobs():
                ids, lps, tops = c.ids, c.logprobs, c.top
                if self.options.echo:
                    ids, lps, tops = self._with_prompt(c, ids, lps, tops)
                logprobs = self._logprobs(ids, lps, tops, 0)
            out.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        return {**self._base(self.object_name), "choices": out, "usage": self.usage()}

    def _prompt_text(self, c: Choice) -> str:
        prompt = self.inp.prompts[c.index // self.inp.n]
        if prompt.text is not None:
            return prompt.text
        return self.texts.tokenizer.decode(c.req.prompt_ids)

    @staticmethod
    def _with_prompt(c: Choice, ids, logprobs, tops):
        """Echo: the prompt's tokens and logprobs (the first one None) before the output's."""
        all_ids = list(c.req.prompt_ids) + list(ids)
        logprobs = list(c.input_logprobs) + list(logprobs or [])
        tops = list(c.input_top) + list(tops or [[] for _ in ids])
        return all_ids, logprobs, tops

    def _logprobs(self, ids, logprobs, tops, at: int) -> dict:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset
        (from `at`, the characters of the choice's text before them)."""
        tokens = [self.texts(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = [{self.texts(t): lp for t, lp in row} for row in tops or [[]] * len(ids)]
        if self.options.top_logprobs == 0:
            top = [None] * len(ids)
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs or []),
            "top_logprobs": top,
            "text_offset": offsets,
        }


class ChatAnswer(OpenAIAnswer):
    object_name = "chat.completion"
    prefix = "chatcmpl-"

    def __init__(self, inp, reqs, model, tokenizer, make_text=ChatText):
        super().__init__(inp, reqs, model, tokenizer)
        self.parsers = [make_text() for _ in reqs]
        self.finals: dict[int, dict] = {}

    def event(self, index: int, chunk: StreamChunk) -> list[dict]:
        c = self.choices[index]
        out = []
        if not c.started:
            c.started = True
            out.append(self._piece(index, {"role": "assistant", "content": ""}))
        c.add(chunk)
        parser = self.parsers[index]
        deltas = parser.feed(chunk.text)
        if chunk.finished:
            deltas += parser.finish()
        logprobs = None
        if self._wants_logprobs() and chunk.token_ids:
            logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            out.append(self._piece(index, delta, logprobs if k == 0 else None))
        if chunk.finished:
            out.append(self._piece(index, {}, finish=self._finish(c)))
        return out

    def _piece(self, index: int, delta: dict, logprobs=None, finish=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk(choice)

    def _finish(self, c: Choice) -> str | None:
        if self.parsers[c.index].called and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    def whole(self) -> dict:
        out = []
        for c in self.choices:
            parser = self.parsers[c.index]
            message = merge_deltas(parser.feed(c.result.text) + parser.finish())
            logprobs = None
            if self._wants_logprobs():
                logprobs = self._logprobs(c.ids, c.logprobs, c.top)
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": self._finish(c),
                }
            )
        return {**self._base(self.object_name), "choices": out, "usage": self.usage()}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.texts(token)
        return {"token": text, "logprob": logprob, "bytes": self.texts.bytes_of(token)}

    def _logprobs(self, ids, logprobs, tops) -> dict:
        content = []
        for i, (token, logprob) in enumerate(zip(ids, logprobs or [])):
            entry = self._entry(token, logprob)
            row = tops[i] if tops else []
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in row]
            content.append(entry)
        return {"content": content}


def make_answer(inp: GenerateInput, reqs: list[Request], model: str, tokenizer, **kw) -> Answer:
    if inp.route == "generate":
        return GenerateAnswer(inp, reqs, model, tokenizer, kw.get("incremental", False))
    if inp.route == "completions":
        return CompletionAnswer(inp, reqs, model, tokenizer)
    return ChatAnswer(inp, reqs, model, tokenizer, kw.get("make_text", ChatText))
