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


# ---- prefix sharing and eviction ---------------------------------------------------------------


def committed(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """`rid` computes `tokens` from scratch (after a prefix match) and publishes its pages."""
    kv.match_prefix(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens))
    return list(kv.tables[rid])


def test_eviction_takes_the_least_recently_freed_pages_and_a_tail_before_its_prefix():
    kv = KVCacheManager(num_pages=6, page_size=2)
    tokens = list(range(10, 17))  # 7 tokens: 3 full pages and a partial one
    pages = committed(kv, "a", tokens)
    kv.free("a")
    assert kv.allocate_slots("x", 2 * 2)  # the two pages never used go first
    assert kv.match_prefix("b", tokens) == 6  # all three cached pages still there
    kv.free("b")
    assert kv.allocate_slots("y", 2 * 2)  # the oldest free pages: a's tail, last page first
    assert kv.tables["y"] == [pages[3], pages[2]]
    assert kv.match_prefix("c", tokens) == 4  # the prefix survives its tail
    for rid in ("x", "y", "c"):
        kv.free(rid)
    kv.check_invariants(set())


def test_a_shared_page_outlives_one_owner_and_is_never_given_out_while_held():
    kv = KVCacheManager(num_pages=4, page_size=2)
    tokens = list(range(5))
    pages = committed(kv, "a", tokens)
    assert kv.match_prefix("b", tokens) == 4
    kv.free("a")
    assert [kv.allocator.ref[p] for p in kv.tables["b"]] == [1, 1]
    assert kv.allocate_slots("x", 2 * kv.num_free_pages)  # every free page
    assert not set(kv.tables["x"]) & set(kv.tables["b"])
    assert kv.tables["b"] == pages[:2]
    assert kv.allocator.cached  # b's pages keep their entries
    kv.free("b")
    kv.free("x")
    kv.check_invariants(set())


def test_two_requests_computing_one_prefix_publish_it_once():
    kv = KVCacheManager(num_pages=8, page_size=2)
    tokens = list(range(20, 25))
    kv.match_prefix("a", tokens)
    kv.match_prefix("b", tokens)  # before a published anything: no hit
    for rid in ("a", "b"):
        assert kv.allocate_slots(rid, len(tokens))
    kv.commit("a", tokens, len(tokens))
    kv.commit("b", tokens, len(tokens))
    assert sorted(kv.allocator.cached.values()) == sorted(kv.tables["a"][:2])
    assert all(kv.allocator.page_hash[p] is None for p in kv.tables["b"])
    assert kv.match_prefix("c", tokens) == 4
    assert kv.tables["c"] == kv.tables["a"][:2]
    for rid in ("a", "b", "c"):
        kv.free(rid)
    kv.check_invariants(set())


def test_a_page_is_published_only_once_its_token_ids_are_known():
    kv = KVCacheManager(num_pages=4, page_size=2)
    tokens = list(range(4))
    kv.match_prefix("a", tokens)
    assert kv.allocate_slots("a", 6)
    kv.commit("a", tokens[:3], 6)  # KV of 6 tokens, ids of 3: one full page known
    assert len(kv.hashes["a"]) == 1 and len(kv.allocator.cached) == 1
    kv.commit("a", tokens + [9, 9], 6)
    assert len(kv.hashes["a"]) == 3
    kv.free("a")
    kv.check_invariants(set())


def test_prefixes_differing_in_an_early_page_share_nothing_after_it():
    kv = KVCacheManager(num_pages=8, page_size=2)
    committed(kv, "a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.match_prefix("b", [1, 2, 0, 4, 5, 6, 7]) == 2  # the chain breaks at page 1
    assert kv.match_prefix("c", [0, 2, 3, 4, 5, 6, 7]) == 0
    for rid in ("a", "b", "c"):
        kv.free(rid)
    kv.check_invariants(set())


def test_without_prefix_caching_nothing_is_matched_or_published():
    kv = KVCacheManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    tokens = list(range(7))
    committed(kv, "a", tokens)
    assert kv.allocator.cached == {} and kv.hashes["a"] == []
    assert kv.match_prefix("b", tokens) == 0 and kv.tables["b"] == []
    kv.free("a")
    kv.free("b")
    kv.check_invariants(set())


def test_forgetting_the_cache_keeps_every_page_where_it_is():
    kv = KVCacheManager(num_pages=8, page_size=2)
    tokens = list(range(7))
    pages = committed(kv, "a", tokens)
    assert kv.allocator.forget_cached() == 3
    assert kv.tables["a"] == pages and kv.num_used_pages == 4
    assert kv.match_prefix("b", tokens) == 0
    kv.free("a")
    kv.free("b")
    kv.check_invariants(set())


# ---- trims, holds and slots --------------------------------------------------------------------


def test_a_trim_gives_back_the_tail_and_says_where_a_copy_may_differ():
    kv = KVCacheManager(num_pages=8, page_size=2)
    assert kv.allocate_slots("a", 10)  # 5 pages
    head = kv.tables["a"][:2]
    kv.trim("a", 3)  # keeps 2 pages
    assert kv.tables["a"] == head and kv.num_used_pages == 2
    kv.trim("a", 4)  # nothing past 2 pages: no cut
    assert kv.changed_from("a", 5) == 2
    assert kv.changed_from("a", 5) == 5  # the cut is reported once
    kv.free("a")
    kv.check_invariants(set())


def test_trimming_a_shared_prefix_page_only_drops_this_owners_reference():
    kv = KVCacheManager(num_pages=8, page_size=2)
    tokens = list(range(5))
    committed(kv, "a", tokens)
    assert kv.match_prefix("b", tokens) == 4
    kv.trim("b", 1)
    assert kv.tables["b"] == kv.tables["a"][:1]
    assert [kv.allocator.ref[p] for p in kv.tables["a"]] == [2, 1, 1]
    kv.free("a")
    kv.free("b")
    kv.check_invariants(set())


def test_held_pages_outlive_their_request_until_freed():
    kv = KVCacheManager(num_pages=4, page_size=2)
    assert kv.allocate_slots("a", 4)
    pages = list(kv.tables["a"])
    assert kv.hold("a", "a#send") == pages
    assert "a" not in kv.tables
    kv.check_invariants({"a#send"})
    with pytest.raises(ValueError, match="already held"):
        kv.allocate_slots("b", 2)
        kv.hold("b", "a#send")
    kv.free("b")
    kv.free("a#send")
    assert kv.num_free_pages == 4
    kv.check_invariants(set())


def test_slots_cross_page_boundaries():
    kv = KVCacheManager(num_pages=4, page_size=4)
    assert kv.allocate_slots("x", 4)  # page 0
    assert kv.allocate_slots("a", 8)  # pages 1, 2
    assert kv.slots("a", 2, 6) == [6, 7, 8, 9]
    kv.free("x")
    kv.free("a")


def test_random_operations_keep_every_invariant():
    import random

    rng = random.Random(0)
    kv = KVCacheManager(num_pages=24, page_size=2)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 14))] for _ in range(8)]
    live: dict[str, list[int]] = {}
    for i in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            rid, tokens = f"r{i}", rng.choice(prompts)
            cached = kv.match_prefix(rid, tokens)
            assert cached % 2 == 0 and cached < len(tokens)
            if kv.allocate_slots(rid, len(tokens)):
                kv.commit(rid, tokens, len(tokens))
                live[rid] = tokens
            else:
                kv.free(rid)
        elif op < 0.6:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            kv.trim(rid, rng.randrange(1, len(live[rid]) + 1))
            live[rid] = live[rid][: len(kv.tables[rid]) * 2]
        elif op < 0.82:
            kv.allocator.forget_cached()
        kv.check_invariants(set(live))
    for rid in list(live):
        kv.free(rid)
    assert kv.num_free_pages == kv.num_pages
    kv.check_invariants(set())
