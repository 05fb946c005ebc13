"""What an instance says about its work as it goes, as SGLang's servers do: one log line per
finished request (id, prompt / cached / output tokens, time to first token, latency) and, while
the instance is busy, a batch line every `batch_log_interval_s` (running and queued requests, KV
pages in use, generated tokens per second, speculative acceptance). Both run on the engine thread (`EngineLoop`), and the
finished requests feed the token counters of `/metrics`.
"""

from __future__ import annotations

import logging
import time

from dserve.runtime.metrics import InstanceMetrics, token_usage
from dserve.scheduler.request import Request

log = logging.getLogger("dserve.stats")


class Stats:
    def __init__(self, engine, metrics: InstanceMetrics, interval_s: float):
        self.engine, self.metrics, self.interval_s = engine, metrics, interval_s
        self.idle()

    def finished(self, req: Request) -> None:
        """A request whose answer goes out now."""
        queued = None
        if req.scheduled_time is not None:
            queued = req.scheduled_time - req.arrival_time
        generated = len(req.output_ids)
        cached = req.num_cached_tokens
        self.metrics.finished(len(req.prompt_ids), generated, cached, queued)
        ttft = "-"
        if req.first_token_time is not None:
            ttft = f"{req.first_token_time - req.arrival_time:.3f}s"
        latency = (req.finish_time or time.perf_counter()) - req.arrival_time
        log.info(
            "finished %s: prompt %d tokens (cached %d), output %d tokens, ttft %s, "
            "latency %.3fs, finish %s",
            req.rid,
            len(req.prompt_ids),
            cached,
            generated,
            ttft,
            latency,
            req.finish_reason,
        )

    def after_step(self) -> None:
        """The batch line, when the interval has passed (called while the engine is busy)."""
        now = time.monotonic()
        if self.interval_s <= 0 or now - self.last_time < self.interval_s:
            return
        tokens = self.engine.generated_tokens
        rate = (tokens - self.last_tokens) / (now - self.last_time)
        groups = self.engine.groups
        line = (
            f"batch: running {sum(len(g.scheduler.running) for g in groups)}, "
            f"queued {sum(len(g.scheduler.waiting) for g in groups)}, "
            f"token usage {token_usage(self.engine):.2f} "
            f"({sum(g.kv.num_used_pages for g in groups)} of "
            f"{sum(g.kv.num_pages for g in groups)} pages), gen throughput {rate:.1f} tok/s"
        )
        if self.engine.config.speculative_algorithm:
            line += f", accept length {self._accept_length():.2f}"
        log.info(line)
        self.idle()

    def _accept_length(self) -> float:
        """Tokens per verify since the last batch line (accepted drafts plus one)."""
        spec = self.engine.speculation
        verifies = spec.verify_steps - self.last_verifies
        accepted = sum(spec.accepted) - self.last_accepted
        return 1 + accepted / verifies if verifies else 0.0

    def idle(self) -> None:
        """Nothing to do: the next batch line measures from here."""
        self.last_time = time.monotonic()
        self.last_tokens = self.engine.generated_tokens
        spec = self.engine.speculation
        self.last_verifies, self.last_accepted = spec.verify_steps, sum(spec.accepted)
