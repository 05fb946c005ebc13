"""The engine's one seam to KV that comes from or goes to another instance.

Anchored on vLLM v1's KVConnector (its scheduler half): the engine asks the connector how many
of a request's prompt tokens arrive from elsewhere, tells it which pages it allocated for them,
and tells it when a request finishes (or is preempted), so the connector may keep the pages to
send them; it never learns the transport, the rooms or the role. `KVConnector` itself is a
colocated instance's: nothing comes or goes. A prefill instance's (`pd_prefill.py`) caps each
request at its first token and keeps its pages; a decode instance's (`pd_decode.py`) says the
whole prompt arrives and joins each request once its KV and first token did (`Engine.join`).

The same object is what the front and the engine thread meet per role: `check_bootstrap` and
`starts` (the HTTP front, `Instance.prepare`), `poll`, `busy`, `abort` (the engine thread
between steps, `EngineLoop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dserve.runtime.protocol import BadRequest
from dserve.scheduler.request import Request


@dataclass(frozen=True)
class Prefilled:
    """A prompt computed elsewhere: its first token and what came with it."""

    token: int
    logprob: float | None = None
    top_logprobs: list = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)
    """The draft's proposals after the prompt: the decode verifies them first."""
    draft_parents: list[int] = field(default_factory=list)
    input_logprobs: list | None = None
    """The prompt's logprobs (`logprob_start_len`), None when not asked for."""
    input_top_logprobs: list | None = None

    @classmethod
    def of(cls, req: Request) -> Prefilled:
        """What `req`'s first step produced (on the instance that computed it)."""
        logprob, top = None, []
        if req.params.return_logprob and req.token_logprobs:
            logprob = req.token_logprobs[0]
            top = [list(x) for x in req.top_logprobs[0]]
        inputs, input_top = None, None
        if req.params.input_logprobs_from is not None:
            inputs = list(req.input_logprobs)
            input_top = [[list(x) for x in row] for row in req.input_top_logprobs]
        return cls(
            req.output_ids[0],
            logprob,
            top,
            list(req.draft_tokens),
            list(req.draft_parents),
            inputs,
            input_top,
        )


class KVConnector:
    """A colocated instance's connector: every prompt is computed here, every page freed here."""

    def __init__(self, engine):
        self.engine = engine

    # ---- asked and told by the engine ----------------------------------------------------------
    def max_new_tokens(self, req: Request) -> int | None:
        """A cap on `req`'s output that the connector sets (None: the request's own). A
        request that reaches it ends there, whatever its token, with `request_finished`."""
        return None

    def arriving_tokens(self, req: Request) -> int:
        """Tokens of `req`'s prompt whose KV arrives from elsewhere (0: all computed here). The
        engine allocates their pages once it has them, then calls `allocated`."""
        return 0

    def allocated(self, req: Request, pages: list[int]) -> None:
        """The pages `req`'s arriving prompt goes to."""

    def request_finished(self, req: Request) -> None:
        """`req` reached the connector's cap; its pages are freed after this returns unless
        the connector holds them (`Engine.hold`)."""

    def request_preempted(self, req: Request) -> bool:
        """`req` is preempted: True when the connector took its pages (`Engine.hold`)."""
        return False

    # ---- the engine thread, between steps ------------------------------------------------------
    has_work = False
    events_socket = None
    """What the engine thread waits on beside its jobs (a transfer manager's socket)."""

    def poll(self) -> bool:
        """Events and deadlines; True when a request joined or ended (its answer may go out)."""
        return False

    def busy(self, rid: str) -> bool:
        """Whether an ended request's answer must still wait (its KV is being sent)."""
        return False

    def abort(self, rid: str) -> bool:
        """End `rid` here if the connector owns it now; False: the engine aborts it."""
        return False

    # ---- the HTTP front ----------------------------------------------------------------------
    def check_bootstrap(self, bootstrap) -> None:
        """Refuse a body whose bootstrap fields do not fit this instance (BadRequest)."""
        if bootstrap is not None:
            raise BadRequest(
                "bootstrap_* fields are for disaggregated instances; this one serves alone"
            )

    async def starts(self, bootstrap, reqs: list[Request], rooms: list[int], loop) -> list[tuple]:
        """Each request and how to start it on the engine thread (`loop`: the EngineLoop)."""
        return [(req, self.engine.submit) for req in reqs]
