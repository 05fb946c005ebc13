"""What SGLang's router (`sglang-router`, `--pd-disaggregation`) does that a dserve instance
meets: fields it puts in every request at their default values, whether or not the caller asked
for anything (at those values they ask for nothing, so an instance drops them before it parses
the body; at any other value they stay, and the parser serves them or refuses them by name, HTTP
400, as any field), and the HTTP/2 preface it sends each instance once to see whether it speaks
gRPC (aiohttp refuses it, as it should; `quiet_h2_probes` keeps that from logging a traceback).
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

# field -> the value at which it asks for nothing (SGLang's default)
NO_OP_VALUES = {
    "return_hidden_states": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_text_in_logprobs": False,
    "background": False,
    "no_logs": False,
    "log_metrics": True,  # this instance logs every request's figures anyway
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,  # SGLang's default; without a reasoning parser a no-op
    "stream_reasoning": True,
}


def drop_no_op_fields(body: dict) -> dict:
    """`body` without the fields that carry their no-op value (and without `model`: null,
    which sglang-router adds to `/generate` bodies for its own routing)."""
    return {
        k: v
        for k, v in body.items()
        if not (k in NO_OP_VALUES and v is NO_OP_VALUES[k]) and not (k == "model" and v is None)
    }


class _H2Probe(logging.Filter):
    """Drops aiohttp's error record of an HTTP/2 connection preface ("PRI * HTTP/2.0")."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, BadHttpMessage) and "PRI" in str(error))


def quiet_h2_probes() -> None:
    logging.getLogger("aiohttp.server").addFilter(_H2Probe())
