"""Continuous batching under pressure: preemption and recompute keep tokens exact; aborts free pages."""

from __future__ import annotations

from dserve.runtime import SamplingParams
from dserve.scheduler.request import Status
from tests.conftest import random_prompts
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def test_preemption_under_tiny_page_budget_gives_identical_tokens(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    # 4 requests of up to 20 + 24 tokens need ~44 slots each; the pool holds 64.
    engine = make_engine(path, page_size=4, max_total_tokens=64)
    prompts = random_prompts(4, engine.model_config.vocab_size, [20, 14, 17, 9], seed=11)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert engine.preempted_total > 0, "the budget was meant to force preemption"
    assert any(r.meta["num_preemptions"] for r in results)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 24)
    assert engine.groups[0].kv.tables == {}


def test_preemption_with_glm_and_no_prefix_cache(tiny_dir, make_engine):
    path = tiny_dir("glm4_moe")
    engine = make_engine(path, page_size=2, max_total_tokens=48, enable_prefix_caching=False)
    prompts = random_prompts(3, engine.model_config.vocab_size, [15, 12, 10], seed=12)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert engine.preempted_total > 0
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 24)


def test_new_requests_join_a_running_batch(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v2")
    engine = make_engine(path)
    prompts = random_prompts(2, engine.model_config.vocab_size, [12, 19], seed=13)
    first = engine.add_request(input_ids=prompts[0], sampling_params=GREEDY)
    for _ in range(5):
        engine.step()
    second = engine.add_request(input_ids=prompts[1], sampling_params=GREEDY)
    engine.step()
    running = {r.rid for r in engine.groups[0].scheduler.running}
    assert {first, second} <= running  # decoding and prefilling in the same step
    while engine.groups[0].scheduler.has_work:
        engine.step()
    for rid, prompt in zip((first, second), prompts):
        assert engine.pop_result(rid).output_ids == hf_greedy(path, prompt, 24)


def test_abort_of_a_running_request_frees_its_pages(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"), page_size=4)
    prompt = random_prompts(1, engine.model_config.vocab_size, [30], seed=14)[0]
    rid = engine.add_request(
        input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=100, temperature=0)
    )
    for _ in range(3):
        engine.step()
    req = engine.requests[rid]
    assert req.status is Status.RUNNING and len(engine.groups[0].kv.tables[rid]) >= 8
    engine.abort(rid)
    assert rid not in engine.groups[0].kv.tables
    engine.check_invariants()
    result = engine.pop_result(rid)
    assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 100


def test_abort_of_a_waiting_request(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"), max_running_requests=1)
    prompts = random_prompts(2, engine.model_config.vocab_size, [10, 10], seed=15)
    a = engine.add_request(input_ids=prompts[0], sampling_params=GREEDY)
    b = engine.add_request(input_ids=prompts[1], sampling_params=GREEDY)
    engine.step()
    assert engine.requests[b].status is Status.WAITING
    engine.abort(b)
    engine.check_invariants()
    while not engine.requests[a].finished:
        engine.step()
    assert engine.pop_result(b).finish_reason == "abort"
    assert engine.pop_result(a).finish_reason == "length"


def test_request_larger_than_the_pool_ends_with_an_error(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"), page_size=4, max_total_tokens=32)
    prompt = random_prompts(1, engine.model_config.vocab_size, [20], seed=16)[0]
    result = engine.generate(
        input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=50, ignore_eos=True)
    )
    assert result.finish_reason == "abort" and "KV cache" in result.meta["error"]
    # 32 slots: 20 prompt tokens, then 12 decode steps; the 13th sampled token had no slot to go to
    assert len(result.output_ids) == 13
