"""The page allocator, page tables and prefix cache, and the invariant checker itself."""

from __future__ import annotations

import pytest

from dserve.scheduler.kv_manager import KVCacheManager


def test_allocate_and_free_return_every_page():
    kv = KVCacheManager(num_pages=8, page_size=4)
    assert kv.allocate_slots("a", 10)  # 3 pages
    assert kv.allocate_slots("b", 4)  # 1 page
    assert kv.num_used_pages == 4 and len(kv.tables["a"]) == 3
    assert kv.allocate_slots("a", 12)  # still 3 pages
    assert len(kv.tables["a"]) == 3
    kv.check_invariants({"a", "b"})
    kv.free("a")
    kv.free("b")
    assert kv.num_free_pages == 8
    kv.check_invariants(set())


def test_allocation_failure_takes_nothing():
    kv = KVCacheManager(num_pages=4, page_size=2)
    assert kv.allocate_slots("a", 6)
    assert not kv.allocate_slots("b", 4)
    assert kv.tables["b"] == [] and kv.num_free_pages == 1
    kv.free("a")
    kv.free("b")
    kv.check_invariants(set())


def test_prefix_pages_are_shared_and_refcounted():
    kv = KVCacheManager(num_pages=8, page_size=4)
    tokens = list(range(100, 113))  # 13 tokens: 3 full pages
    assert kv.match_prefix("a", tokens) == 0
    assert kv.allocate_slots("a", 13)
    kv.commit("a", tokens, 13)
    # a second request with the same first 8 tokens shares two pages
    assert kv.match_prefix("b", tokens[:8] + [1, 2, 3]) == 8
    assert kv.tables["b"] == kv.tables["a"][:2]
    assert [kv.allocator.ref[p] for p in kv.tables["a"][:2]] == [2, 2]
    kv.check_invariants({"a", "b"})
    kv.free("a")
    kv.free("b")
    # pages stay cached after their owners left, until allocation evicts them
    assert kv.match_prefix("c", tokens) == 12
    kv.free("c")
    assert kv.allocate_slots("d", 32)  # takes all 8 pages: the cache is evicted
    assert kv.allocator.cached == {}
    assert kv.match_prefix("e", tokens) == 0
    kv.free("d")
    kv.free("e")
    kv.check_invariants(set())


def test_match_always_leaves_a_token_to_compute():
    kv = KVCacheManager(num_pages=4, page_size=4)
    tokens = list(range(8))
    kv.allocate_slots("a", 8)
    kv.commit("a", tokens, 8)
    assert kv.match_prefix("b", tokens) == 4  # not 8: the last token's logits are needed
    kv.free("a")
    kv.free("b")


def test_invariant_checker_catches_leaks_and_double_ownership():
    kv = KVCacheManager(num_pages=4, page_size=4)
    kv.allocate_slots("gone", 4)
    with pytest.raises(AssertionError, match="ended requests still hold pages"):
        kv.check_invariants(live=set())
    kv.tables["gone"].append(kv.tables["gone"][0])
    with pytest.raises(AssertionError, match="holds a page twice"):
        kv.check_invariants()
    kv.tables["gone"].pop()
    kv.allocator.ref[kv.tables["gone"][0]] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        kv.check_invariants()


def test_page_size_must_be_positive():
    with pytest.raises(ValueError, match="page_size"):
        KVCacheManager(num_pages=4, page_size=0)
