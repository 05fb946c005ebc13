"""Configuration of a serving instance (`dserve serve|prefill|decode`) beside its `EngineConfig`:
where it listens, its role in a disaggregated pair, and how long each wait may last; and of the
router (`dserve router`): its policy, retries and circuit breaker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ServerConfig:
    role: str = "colocated"
    """Colocated | prefill | decode."""
    host: str = "127.0.0.1"
    """Bind address of the HTTP API and bootstrap server; 127.0.0.1 also keeps UCX on loopback."""
    port: int = 30000
    """HTTP port of the instance."""
    bootstrap_port: int = 8998
    """Prefill: where decode instances register rooms."""
    served_model_name: str | None = None
    """The model name in /v1/models (default: the checkpoint's directory)."""
    bootstrap_timeout_s: float = 30.0
    """Prefill: wait for the decode's pages of a computed prompt."""
    transfer_timeout_s: float = 60.0
    """Decode: wait for a room's KV once its pages are registered. Prefill: the most a transfer
    agent takes to send a room (it reports the room failed then)."""
    transfer_report_margin_s: float = 5.0
    """Prefill: how long past `transfer_timeout_s` the front waits for its agents' reports of a
    room's push before it fails the room and frees its pages (an agent wedged or dead, a
    report lost)."""
    prealloc_timeout_s: float = 60.0
    """Decode: wait for free pages to receive a prompt into."""
    max_request_bytes: int = 4 * 2**20
    """Larger bodies get HTTP 400 (413)."""
    batch_log_interval_s: float = 10.0
    """Seconds between the log lines on the running batch while the instance is busy (0:
    none)."""
    transfer_fail_rate: float = 0.0
    """TEST ONLY: fraction of rooms whose KV sending fails on purpose."""
    transfer_stall_rooms: int = 0
    """TEST ONLY: how many rooms (the first ones) each prefill transfer agent holds unsent,
    reporting them only long after the front's report deadline (a wedged agent)."""
    kv_streaming: bool = True
    """Prefill: send a prompt's pages chunk by chunk while the rest of it is computed (in
    messages of at most `chunked_prefill_size` tokens), not all once it is done."""
    reasoning_parser: str | None = None
    """Split a chat answer's reasoning into `reasoning_content`: `deepseek-r1` or `glm45`."""
    tool_call_parser: str | None = None
    """Read tool calls in the model's own format from a chat answer: `deepseekv3` or `glm45`."""
    chat_template: str | None = None
    """A Jinja chat template file (or the template itself) used instead of the checkpoint's."""
    incremental_streaming_output: bool = False
    """/generate streams only what is new in each event (default: the whole text so far, as
    SGLang does)."""

    def __post_init__(self) -> None:
        from dserve.runtime.reasoning import PARSERS as REASONING
        from dserve.runtime.tool_calls import PARSERS as TOOLS

        for name, value, allowed in (
            ("reasoning_parser", self.reasoning_parser, REASONING),
            ("tool_call_parser", self.tool_call_parser, TOOLS),
        ):
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {self.role!r}")
        if not 0 <= self.transfer_fail_rate <= 1:
            raise ValueError(f"transfer_fail_rate must be in [0, 1], got {self.transfer_fail_rate}")
        if self.transfer_stall_rooms < 0:
            raise ValueError(f"transfer_stall_rooms must be >= 0, got {self.transfer_stall_rooms}")
        if self.transfer_report_margin_s < 0:
            raise ValueError(
                f"transfer_report_margin_s must be >= 0, got {self.transfer_report_margin_s}"
            )
        if self.batch_log_interval_s < 0:
            raise ValueError(f"batch_log_interval_s must be >= 0, got {self.batch_log_interval_s}")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "prealloc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    """Bind address of the router."""
    port: int = 30000
    """HTTP port of the router."""
    policy: Literal["random", "round_robin", "least_load", "power_of_two", "cache_aware"] = (
        "round_robin"
    )
    """How to pick instances: `least_load` the fewest requests in flight, `power_of_two` the
    less loaded of two drawn at random, `cache_aware` the prefill that saw the longest prefix
    of the prompt (the decode by least load)."""
    health_interval_s: float = 2.0
    """Seconds between health probes of each instance."""
    request_timeout_s: float = 3600.0
    """A try that takes longer (from sending to the end of the answer) fails."""
    max_request_bytes: int = 4 * 2**20
    """Larger bodies get HTTP 400."""
    retry_max_retries: int = 3
    """Tries on other instances for a request whose instance failed before any token was sent
    to the client (refused connection, dead instance, failed KV transfer); 0: none."""
    shared_streams: bool = True
    """A stream gets each request's first token's events from the prefill as soon as it
    computed it, the rest from the decode (`SharedStream`): its time to first token waits for
    neither the KV transfer nor the decode, and a KV transfer that fails after that first
    token ends the stream with an error event. Off (`--no-shared-streams`): every stream
    comes whole from the decode, as with SGLang's and vLLM's routers."""
    cb_failure_threshold: int = 5
    """Failures in a row (5xx answers, lost connections; 4xx answers do not count) that open
    an instance's circuit: it leaves rotation for `cb_timeout_s`."""
    cb_timeout_s: float = 10.0
    """How long an open circuit keeps its instance out of rotation before it is tried again."""
    cache_threshold: float = 0.3
    """cache_aware: the least share of the prompt a prefill must have seen to be picked for it;
    below, the prefill that has seen the least so far."""
    balance_abs_threshold: int = 64
    """cache_aware: requests in flight by which the busiest prefill must exceed the idlest
    (and by the factor `balance_rel_threshold`) for load to win over prefix affinity."""
    balance_rel_threshold: float = 1.5
    """cache_aware: see balance_abs_threshold."""

    def __post_init__(self) -> None:
        needs = {
            "health_interval_s": (self.health_interval_s > 0, "> 0"),
            "request_timeout_s": (self.request_timeout_s > 0, "> 0"),
            "retry_max_retries": (self.retry_max_retries >= 0, ">= 0"),
            "cb_failure_threshold": (self.cb_failure_threshold >= 1, ">= 1"),
            "cb_timeout_s": (self.cb_timeout_s > 0, "> 0"),
            "cache_threshold": (0 <= self.cache_threshold <= 1, "in [0, 1]"),
            "balance_abs_threshold": (self.balance_abs_threshold >= 0, ">= 0"),
            "balance_rel_threshold": (self.balance_rel_threshold >= 1, ">= 1"),
        }
        for name, (ok, need) in needs.items():
            if not ok:
                raise ValueError(f"{name} must be {need}, got {getattr(self, name)}")
