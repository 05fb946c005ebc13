"""How `dserve router` picks instances: the instances as it sees them (`Backend`: in rotation
or not, requests in flight, its circuit breaker) and the policies over those available.

Policies: `random`, `round_robin`, `least_load` (fewest requests in flight), `power_of_two`
(the less loaded of two drawn at random), `cache_aware` (prefix affinity, as SGLang's router:
the prefill whose cache most likely holds the longest prefix of the prompt, unless the load is
too uneven; the decode by least load, since a decode receives every page of the prompt).

The circuit breaker counts an instance's failures in a row (5xx answers, lost connections; a 4xx
is the client's fault and does not count); at `cb_failure_threshold` the instance leaves rotation
for `cb_timeout_s`, then takes requests again: one success closes the circuit, one failure opens
it anew.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlparse

from dserve.runtime.server_config import RouterConfig

POLICIES = ("random", "round_robin", "least_load", "power_of_two", "cache_aware")
BLOCK_IDS = 16  # cache_aware: prompt token ids per hashed block
BLOCK_CHARS = 64  # ... and characters of a text prompt
PREFIX_CAPACITY = 1 << 16  # blocks remembered per instance
UTF32 = "utf-32-le"  # text hashed at 4 bytes a character


@dataclass
class Breaker:
    threshold: int
    timeout_s: float
    failures: int = 0
    opened_at: float | None = None

    def allows(self, now: float) -> bool:
        return self.opened_at is None or now - self.opened_at >= self.timeout_s

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now


@dataclass(eq=False)
class Backend:
    url: str
    role: str  # prefill | decode
    breaker: Breaker
    healthy: bool = False
    slow_probes: int = 0  # probes in a row that timed out
    in_flight: int = 0
    bootstrap_port: int | None = None
    prefixes: "PrefixSet" = field(default_factory=lambda: PrefixSet(PREFIX_CAPACITY))

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)


class PrefixSet:
    """The prompt blocks (chained hashes) last sent to one instance, least recently used
    first out: what its prefix cache most likely holds."""

    def __init__(self, capacity: int):
        self.capacity, self.blocks = capacity, OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, blocks: list[bytes]) -> int:
        """How many of `blocks`, from the first, are here."""
        n = 0
        while n < len(blocks) and blocks[n] in self.blocks:
            n += 1
        return n

    def insert(self, blocks: list[bytes]) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def prompt_blocks(body: dict) -> list[bytes]:
    """The prompt of a request body as hashes of its prefixes, one per fixed-size block: token
    ids in blocks of BLOCK_IDS, text (a prompt, or a chat's messages) in blocks of BLOCK_CHARS
    characters. Two prompts share their first k blocks exactly when they share that prefix.
    Token ids are hashed as 64-bit integers (16k ids: 1 ms, against 4 ms as decimal text)."""
    ids = body.get("input_ids")
    if ids is None and isinstance(body.get("prompt"), list):
        ids = body["prompt"]
    text = None
    if isinstance(ids, list) and {int, bool}.issuperset(map(type, ids)):
        try:
            data, step = array("q", ids).tobytes(), BLOCK_IDS * 8
        except OverflowError:  # past 64 bits (the instance refuses it): as text
            text = "".join(f"{t}," for t in ids)
    else:
        text = _prompt_text(body)
    if text is not None:
        data, step = text.encode(UTF32, "surrogatepass"), BLOCK_CHARS * 4
    out, prefix = [], hashlib.blake2b(digest_size=16)
    for start in range(0, len(data) - step + 1, step):
        prefix.update(data[start : start + step])
        out.append(prefix.copy().digest())
    return out


def _prompt_text(body: dict) -> str:
    for name in ("text", "prompt"):
        if isinstance(body.get(name), str):
            return body[name]
    messages = body.get("messages")
    if isinstance(messages, list):
        return json.dumps(messages, sort_keys=True)
    return ""


class Picker:
    """One policy over the instances of each role."""

    def __init__(self, config: RouterConfig):
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
        self.config = config
        self.turns = {"prefill": itertools.count(), "decode": itertools.count()}

    @property
    def reads_prompt(self) -> bool:
        """Whether the policy reads a request's prompt (`blocks`)."""
        return self.config.policy == "cache_aware"

    def blocks(self, body: dict) -> list[bytes]:
        """The prompt's blocks (`prompt_blocks`) where the policy reads them, else none (hashing
        a 16k-token prompt would add a millisecond before the request leaves)."""
        return prompt_blocks(body) if self.reads_prompt else []

    def pick(self, role: str, pool: list[Backend], blocks: list[bytes]) -> Backend:
        """One of `pool` (not empty) for a prompt of `blocks`."""
        policy = self.config.policy
        if policy == "cache_aware":
            if role == "prefill":
                return self._by_prefix(pool, blocks)
            policy = "least_load"
        if policy == "random":
            return random.choice(pool)
        if policy == "least_load":
            return _least_loaded(pool)
        if policy == "power_of_two":
            return _least_loaded(random.sample(pool, min(2, len(pool))))
        return pool[next(self.turns[role]) % len(pool)]

    def _by_prefix(self, pool: list[Backend], blocks: list[bytes]) -> Backend:
        c = self.config
        loads = [b.in_flight for b in pool]
        uneven = max(loads) - min(loads) > c.balance_abs_threshold and max(loads) > (
            c.balance_rel_threshold * min(loads)
        )
        if uneven:
            chosen = _least_loaded(pool)
        else:
            matched = {b.url: b.prefixes.match(blocks) for b in pool}
            best = max(pool, key=lambda b: (matched[b.url], -b.in_flight))
            if blocks and matched[best.url] / len(blocks) >= c.cache_threshold:
                chosen = best
            else:  # nothing much cached anywhere: the instance that holds the least
                chosen = min(pool, key=lambda b: (len(b.prefixes), b.in_flight))
        chosen.prefixes.insert(blocks)
        return chosen


def _least_loaded(pool: list[Backend]) -> Backend:
    fewest = min(b.in_flight for b in pool)
    return random.choice([b for b in pool if b.in_flight == fewest])
