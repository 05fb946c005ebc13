"""The scheduler on its own, with no model: a `Scheduler` over a `KVCacheManager`, requests of
fake token ids, and a stand-in for the runner that answers each step (vLLM's
tests/v1/core/test_scheduler.py style). Budgets, chunking, admission order, slots, preemption,
overlapped steps, micro-batches, prefix hits, draft verification and the page invariants."""

from __future__ import annotations

import pytest

from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request, SamplingParams, Status
from dserve.scheduler.scheduler import Scheduler, SchedulerConfig, Span

PAGE = 4


def make(
    pages: int = 64, budget: int = 64, chunk: int = 32, running: int = 8, micro: int = 1
) -> Scheduler:
    config = SchedulerConfig(budget, chunk, running, micro)
    return Scheduler(config, KVCacheManager(pages, PAGE))


def request(rid: str, prompt_len: int, max_new: int = 4, first: int = 100) -> Request:
    req = Request(
        rid, list(range(first, first + prompt_len)), SamplingParams(max_new_tokens=max_new)
    )
    req.stop_length = prompt_len + max_new
    return req


def launch(sched: Scheduler, spans: list[Span]) -> list[Span]:
    """Put the spans in a step; returns those that sample a token after them (to `answer`)."""
    sampling = [span for span in spans if span.completes]
    sched.launched(spans)
    return sampling


def answer(sched: Scheduler, sampling: list[Span], token: int = 7) -> None:
    """The runner's result of a step: each sampling span's request gets `token`; those that
    reach their length end and free their pages."""
    for span in sampling:
        req = span.req
        req.num_pending_tokens -= 1
        if req.finished:
            continue
        req.output_ids.append(token)
        sched.received(req)
        if req.num_tokens >= req.stop_length:
            sched.finish_and_free(req, "length")


def step(sched: Scheduler) -> list[Span]:
    spans = sched.schedule()
    answer(sched, launch(sched, spans))
    return spans


def check(sched: Scheduler) -> None:
    sched.kv.check_invariants(sched.live_rids())


def test_a_prompt_is_chunked_then_decoded_one_token_a_step():
    sched = make(chunk=8)
    req = request("a", 20, max_new=3)
    sched.add(req)
    lengths = [[s.length for s in step(sched)] for _ in range(6)]
    assert lengths == [[8], [8], [4], [1], [1], []]
    assert req.finished and req.output_ids == [7, 7, 7]
    assert sched.kv.num_used_pages == 0
    check(sched)


def test_running_requests_go_first_then_waiting_ones_join_in_order_within_budget():
    sched = make(budget=10, chunk=8)
    a, b, c = request("a", 6), request("b", 6, first=200), request("c", 6, first=300)
    sched.add(a)
    assert [(s.req.rid, s.length) for s in step(sched)] == [("a", 6)]
    sched.add(b)
    sched.add(c)
    spans = step(sched)  # a decodes (1), b takes 6, c gets the last 3 of the budget
    assert [(s.req.rid, s.length) for s in spans] == [("a", 1), ("b", 6), ("c", 3)]
    assert [r.rid for r in sched.running] == ["a", "b", "c"]
    check(sched)


def test_admission_stops_at_max_running_requests_and_slots_are_reused():
    sched = make(running=2)
    reqs = [request(r, 4, max_new=1) for r in "abc"]
    for req in reqs:
        sched.add(req)
    first = step(sched)
    assert [s.req.rid for s in first] == ["a", "b"]
    slots_used = {0, 1}
    assert reqs[2].status is Status.WAITING
    assert sorted(sched.ended_slots) == sorted(slots_used)  # a and b ended after one token
    assert [s.req.rid for s in step(sched)] == ["c"]
    assert reqs[2].finished
    check(sched)


def test_pages_run_short_the_latest_admitted_is_preempted_and_comes_back():
    sched = make(pages=6, budget=64, chunk=64)
    a, b = request("a", 8, max_new=6), request("b", 8, max_new=6, first=300)
    sched.add(a)
    sched.add(b)
    step(sched)  # 2 pages each, and each token after needs room
    for _ in range(12):
        step(sched)
        check(sched)
        if a.finished and b.finished:
            break
    assert a.finished and b.finished
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the later one gave way
    assert sched.preempted_total == b.num_preemptions
    assert sched.kv.num_used_pages == 0


def test_a_request_larger_than_the_pool_ends_with_an_error():
    sched = make(pages=2, chunk=64)
    req = request("a", 6, max_new=10)  # admitted (2 pages), then outgrows the pool
    sched.add(req)
    for _ in range(6):
        step(sched)
    assert req.finished and req.finish_reason == "abort"
    assert "too small" in req.error
    check(sched)


def test_a_request_alone_waits_while_pages_held_elsewhere_fill_the_pool():
    """Pages held past their request (KV being sent) are not the running request's to take:
    it goes back to waiting and runs once they are released."""
    sched = make(pages=4, chunk=64)
    held = request("held", 8, max_new=1)
    sched.add(held)
    step(sched)
    sched.kv.allocate_slots("sending", 8)  # 2 pages kept for a transfer
    req = request("a", 9, max_new=2, first=500)
    sched.add(req)
    assert sched.schedule() == [] and req.status is Status.WAITING
    sched.kv.free("sending")
    while not req.finished:
        step(sched)
    assert req.finish_reason == "length" and not req.error
    check(sched)


def test_the_keep_pages_hook_takes_a_preempted_requests_pages():
    sched = make(pages=5, chunk=64)
    kept: list[str] = []

    def keep(req: Request) -> bool:
        sched.kv.hold(req.rid, "kept-" + req.rid)
        kept.append(req.rid)
        return True

    sched.keep_pages_of = keep
    a, b = request("a", 8, max_new=8), request("b", 8, max_new=8, first=300)
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        step(sched)
    assert kept == ["b"] and "kept-b" in sched.kv.tables
    assert sched.kv.tables["kept-b"], "its pages are still allocated"
    sched.kv.free("kept-b")
    while not (a.finished and b.finished):
        step(sched)
    check(sched)


def test_overlapped_steps_never_schedule_a_request_past_its_last_token():
    """With a step in flight (launched, not yet answered) the next step continues where it
    ends; a request whose last token is owed is left out."""
    sched = make()
    req = request("a", 5, max_new=2)
    sched.add(req)
    first = sched.schedule()
    sampling_first = launch(sched, first)  # in flight: one token owed
    assert req.num_pending_tokens == 1
    second = sched.schedule()  # planned before the first step's answer
    assert [(s.start, s.length) for s in second] == [(5, 1)]
    sampling_second = launch(sched, second)
    assert req.ends_in_flight
    assert sched.schedule() == []  # both tokens owed: nothing more to compute
    answer(sched, sampling_first)
    answer(sched, sampling_second)
    assert req.finished and req.output_ids == [7, 7]
    check(sched)


def test_micro_batches_take_disjoint_shares_of_the_requests():
    sched = make(micro=2)
    reqs = [request(r, 4, max_new=3, first=100 * (i + 1)) for i, r in enumerate("abcd")]
    for req in reqs:
        sched.add(req)
    one = sched.schedule()
    sampling_one = launch(sched, one)
    two = sched.schedule()
    launch(sched, two)
    assert len(one) == len(two) == 2
    assert {s.req.rid for s in one}.isdisjoint({s.req.rid for s in two})
    assert sched.schedule() == [], "every request owes a token to a step in flight"
    answer(sched, sampling_one)
    assert {s.req.rid for s in sched.schedule()} == {s.req.rid for s in one}
    check(sched)


def test_a_prompt_seen_before_starts_after_its_cached_pages():
    sched = make(chunk=64)
    a = request("a", 13, max_new=1)
    sched.add(a)
    step(sched)
    b = request("b", 13, max_new=1)  # the same prompt
    sched.add(b)
    spans = step(sched)
    assert b.num_cached_tokens == 12  # 3 full pages of 4; one token left to compute
    assert [(s.start, s.length) for s in spans] == [(12, 1)]
    check(sched)


def test_rejected_draft_tokens_give_their_pages_back():
    sched = make(chunk=64)
    req = request("a", 7, max_new=20)
    sched.add(req)
    step(sched)  # the prompt and a first token
    req.draft_tokens, req.draft_parents = [1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4]
    (span,) = sched.schedule()
    assert span.length == 7 and span.draft == (1, 2, 3, 4, 5, 6)
    sched.launched([span])
    assert len(sched.kv.tables["a"]) == 4  # 15 tokens' pages
    sched.verified(span, rejected=5)  # one draft kept: 8 + 1 tokens have KV
    assert req.num_computed_tokens == 9
    assert len(sched.kv.tables["a"]) == 3
    check(sched)


def test_finish_frees_running_and_waiting_requests_alike():
    sched = make(running=1)
    a, b = request("a", 6, max_new=5), request("b", 6, max_new=5, first=400)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    sched.finish_and_free(a, "abort", error="aborted")
    sched.finish_and_free(b, "abort", error="aborted")
    assert a.finished and b.finished and not sched.has_work
    assert sched.kv.num_used_pages == 0
    check(sched)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_every_token_is_computed_once_whatever_the_chunk(chunk):
    sched = make(chunk=chunk, budget=5)
    reqs = [request(r, 11 + i, max_new=3, first=50 * (i + 1)) for i, r in enumerate("abc")]
    for req in reqs:
        sched.add(req)
    computed = {r.rid: [] for r in reqs}
    for _ in range(200):
        for span in step(sched):
            computed[span.req.rid].append((span.start, span.length))
        check(sched)
        if all(r.finished for r in reqs):
            break
    for req in reqs:
        covered = sorted(computed[req.rid])
        ends = [s + n for s, n in covered]
        assert [s for s, _ in covered] == [0] + ends[:-1], "contiguous, no overlap"
        assert ends[-1] == len(req.prompt_ids) + 2  # the last sampled token has no KV


def test_a_request_alone_is_ended_when_waiting_requests_hold_the_pages_it_lacks():
    """A decode's received prompts wait with their pages: they run only after the queue's head,
    so a lone running request that needs their pages would wait forever: it ends instead."""
    sched = make(pages=4, chunk=64, running=1)
    req = request("a", 8, max_new=6)
    sched.add(req)
    step(sched)  # 2 pages, then it needs a third
    joined = request("joined", 8, max_new=2, first=700)
    assert sched.kv.allocate_slots(joined.rid, 8)  # its received prompt: 2 pages
    joined.num_computed_tokens = 8
    sched.add(joined)
    for _ in range(4):
        step(sched)
    assert req.finished and req.finish_reason == "abort" and "too small" in req.error
    while not joined.finished:
        step(sched)
    check(sched)


# ---- page accounting after aborts and preemptions ----------------------------------------------


def test_an_abort_mid_prompt_gives_back_its_pages_and_slot():
    sched = make(chunk=4)
    a = request("a", 13, max_new=2)
    sched.add(a)
    step(sched)  # the first chunk
    slot = a.slot
    assert len(sched.kv.tables["a"]) == 1
    sched.finish_and_free(a, "abort", error="aborted")
    assert a.slot is None and sched.ended_slots == [slot] and slot in sched.free_slots
    assert sched.kv.num_used_pages == 0 and "a" not in sched.kv.tables
    check(sched)


def test_an_abort_while_a_step_is_in_flight_drops_that_steps_token():
    sched = make(chunk=64)
    a = request("a", 6, max_new=5)
    sched.add(a)
    sampling = launch(sched, sched.schedule())  # the prompt's step, not answered yet
    sched.finish_and_free(a, "abort", error="aborted")
    answer(sched, sampling)  # its token comes back after the abort
    assert a.output_ids == [] and a.finish_reason == "abort"
    assert sched.kv.num_used_pages == 0 and not sched.has_work
    check(sched)


def test_aborting_one_sharer_keeps_the_prefix_for_the_other():
    sched = make(chunk=64)
    a = request("a", 9, max_new=3)
    sched.add(a)
    step(sched)
    b = request("b", 9, max_new=3)  # the same prompt: 2 pages shared
    sched.add(b)
    step(sched)
    shared = sched.kv.tables["b"][:2]
    assert sched.kv.tables["a"][:2] == shared
    sched.finish_and_free(a, "abort", error="aborted")
    assert [sched.kv.allocator.ref[p] for p in shared] == [1, 1]
    while not b.finished:
        step(sched)
        check(sched)
    assert b.output_ids == [7, 7, 7] and sched.kv.num_used_pages == 0


def test_a_preempted_request_holds_nothing_and_finds_its_own_pages_again():
    sched = make(pages=5, budget=64, chunk=64)
    a, b = request("a", 8, max_new=4), request("b", 8, max_new=4, first=300)
    sched.add(a)
    sched.add(b)
    step(sched)  # 2 pages each, 1 free
    step(sched)  # a grows into the free page; b's next token needs one: b gives way
    assert b.status is Status.WAITING and b.num_preemptions == 1
    assert "b" not in sched.kv.tables and b.num_computed_tokens == 0
    check(sched)
    while not (a.finished and b.finished):
        step(sched)
        check(sched)
    assert b.num_cached_tokens == 0  # its first admission saw no cache
    assert sched.kv.num_used_pages == 0


def test_finishing_a_request_twice_or_before_it_was_added_is_harmless():
    sched = make()
    a = request("a", 5)
    sched.finish_and_free(a, "abort", error="aborted")  # never added
    sched.finish_and_free(a, "abort", error="again")
    assert a.finished and a.error == "aborted"
    assert sched.kv.num_used_pages == 0 and not sched.has_work
    check(sched)


def test_pages_add_up_to_the_tokens_each_running_request_holds():
    sched = make(pages=32, chunk=5)
    reqs = [
        request(r, n, max_new=6, first=100 * i)
        for i, (r, n) in enumerate([("a", 3), ("b", 9), ("c", 14)])
    ]
    for req in reqs:
        sched.add(req)
    for _ in range(12):
        step(sched)
        check(sched)
        for req in sched.running:
            pages = len(sched.kv.tables[req.rid])
            assert pages == -(-req.num_computed_tokens // PAGE)
    assert all(r.finished for r in reqs) and sched.kv.num_used_pages == 0
