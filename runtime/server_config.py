"""Configuration of a serving instance (`dserve serve|prefill|decode`) beside its `EngineConfig`:
where it listens, its role in a disaggregated pair, and how long each wait may last."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Decode: wait for a room's KV once its pages are registered."""
    prealloc_timeout_s: float = 60.0
    """Decode: wait for free pages to receive a prompt into."""
    max_request_bytes: int = 4 * 2**20
    """Larger bodies get HTTP 400 (413)."""
    transfer_fail_rate: float = 0.0
    """TEST ONLY: fraction of rooms whose KV sending fails on purpose."""
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
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "prealloc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
