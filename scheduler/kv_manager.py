"""Page-table KV manager for one pool: a ref-counted page allocator, per-request page tables and a
prefix cache over full pages keyed by chained page hashes.

The allocator owns every page with ref count 0 in one ordered free queue that doubles as the LRU
of cached pages (as in vLLM's block pool): a freed page keeps its hash and can be taken back by a
later request with the same prefix until allocation evicts it from the queue's front.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            if self.page_hash[page] is not None:  # evict the cached content
                del self.cached[self.page_hash[page]]
                self.page_hash[page] = None
            self.ref[page] = 1
            pages.append(page)
        return pages

    def take(self, page: int) -> None:
        """Share a cached page with one more owner."""
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        assert self.ref[page] > 0, f"page {page} released more often than taken"
        self.ref[page] -= 1
        if self.ref[page] == 0:
            self.free[page] = None

    def forget_cached(self) -> int:
        """Drop every cached prefix (the pages themselves stay as they are); returns how many."""
        count = len(self.cached)
        for page in self.cached.values():
            self.page_hash[page] = None
        self.cached.clear()
        return count

    def register(self, page: int, key: bytes) -> None:
        if key not in self.cached and self.page_hash[page] is None:
            self.cached[key] = page
            self.page_hash[page] = key


def chain_hash(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(
        previous + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16
    ).digest()


class KVCacheManager:
    """Which pages each holder owns in one pool, and which full pages a new request can reuse.

    A page table's **holder** is a running request (by its rid) or, once `hold` moved a
    request's pages past its end (KV being sent), the name they are held under."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        """Holder -> its pages, in order."""
        self.hashes: dict[str, list[bytes]] = {}
        self.cut: dict[str, int] = {}
        """Per table, the fewest pages it kept since `changed_from` last looked (trims)."""

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.allocator.num_free

    def match_prefix(self, holder: str, tokens: list[int]) -> int:
        """Give `holder` the cached pages of its longest cached full-page prefix; returns tokens covered.
        At least one token is always left to compute, so the last position's logits exist."""
        pages, hashes, key = [], [], b""
        if self.enable_prefix_caching:
            for i in range((len(tokens) - 1) // self.page_size):
                key = chain_hash(key, tokens[i * self.page_size : (i + 1) * self.page_size])
                page = self.allocator.cached.get(key)
                if page is None:
                    break
                pages.append(page)
                hashes.append(key)
        for page in pages:
            self.allocator.take(page)
        self.tables[holder], self.hashes[holder] = pages, hashes
        return len(pages) * self.page_size

    def allocate_slots(self, holder: str, num_tokens_total: int) -> bool:
        """Grow `holder`'s table to hold `num_tokens_total` tokens; False (nothing taken) if pages run out."""
        table = self.tables.setdefault(holder, [])
        self.hashes.setdefault(holder, [])
        need = -(-num_tokens_total // self.page_size) - len(table)
        if need <= 0:
            return True
        pages = self.allocator.allocate(need)
        if pages is None:
            return False
        table.extend(pages)
        return True

    def commit(self, holder: str, tokens: list[int], num_computed: int) -> None:
        """Publish the now fully computed pages of `holder` to the prefix cache. A page goes only once all
        its token ids are in `tokens`: a verify's accepted drafts have KV before their ids are
        appended, so their pages are published at a later step."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[holder], self.hashes[holder]
        for i in range(len(hashes), min(num_computed, len(tokens)) // self.page_size):
            previous = hashes[-1] if hashes else b""
            key = chain_hash(previous, tokens[i * self.page_size : (i + 1) * self.page_size])
            hashes.append(key)
            self.allocator.register(table[i], key)

    def free(self, holder: str) -> None:
        """Return every page of `holder` (tail first, so its tail is evicted before its shared prefix)."""
        for page in reversed(self.tables.pop(holder, [])):
            self.allocator.release(page)
        self.hashes.pop(holder, None)
        self.cut.pop(holder, None)

    def trim(self, holder: str, num_tokens: int) -> None:
        """Give back the pages of `holder` past its first `num_tokens` tokens (rejected draft tokens)."""
        table = self.tables[holder]
        keep = -(-num_tokens // self.page_size)
        if len(table) > keep:
            self.cut[holder] = min(self.cut.get(holder, keep), keep)
        while len(table) > keep:
            self.allocator.release(table.pop())

    def changed_from(self, holder: str, known: int) -> int:
        """The first index of `holder`'s table that may differ from a copy of its first `known`
        pages taken earlier (pages past a trim may have been given out again)."""
        return min(known, self.cut.pop(holder, known))

    def hold(self, rid: str, holder: str) -> list[int]:
        """Move request `rid`'s pages to `holder` (pages in flight outlive their request);
        `free(holder)` gives them back."""
        if holder in self.tables:
            raise ValueError(f"pages are already held under {holder!r}")
        self.tables[holder] = self.tables.pop(rid, [])
        self.hashes[holder] = self.hashes.pop(rid, [])
        self.cut.pop(rid, None)
        return self.tables[holder]

    def slots(self, holder: str, start: int, end: int) -> list[int]:
        table, ps = self.tables[holder], self.page_size
        return [table[pos // ps] * ps + pos % ps for pos in range(start, end)]

    def check_invariants(self, live: set[str] | None = None) -> None:
        """free + used == total; each page's ref count equals the tables holding it; free pages are
        exactly the zero-ref pages; with `live`, no table belongs to a request that has ended."""
        alloc = self.allocator
        owners = [0] * alloc.num_pages
        for holder, table in self.tables.items():
            assert len(set(table)) == len(table), f"{holder} holds a page twice: {table}"
            for page in table:
                owners[page] += 1
        assert owners == alloc.ref, "page ref counts differ from the page tables"
        zero = {p for p in range(alloc.num_pages) if alloc.ref[p] == 0}
        assert zero == set(alloc.free), "free queue differs from the pages nobody holds"
        assert alloc.num_free + sum(1 for r in alloc.ref if r) == alloc.num_pages
        for key, page in alloc.cached.items():
            assert alloc.page_hash[page] == key, f"prefix cache entry of page {page} is stale"
        if live is not None:
            stale = set(self.tables) - live
            assert not stale, f"ended requests still hold pages: {sorted(stale)}"
