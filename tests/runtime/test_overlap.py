"""Overlapped scheduling: the next step is planned and launched while the one before runs, its
newest tokens read on the device. Output is identical with overlap on and off, through chunked
prefill, stops, penalties, seeded sampling, preemption and aborts; no page is held after."""

from __future__ import annotations

import pytest
import torch

from dserve.runtime import SamplingParams
from tests.conftest import random_prompts

PARAMS = [
    {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
    {"temperature": 0.9, "seed": 3, "max_new_tokens": 17, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 20, "repetition_penalty": 1.4, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 6},
    {"temperature": 0.7, "top_k": 8, "seed": 9, "max_new_tokens": 11, "ignore_eos": True},
]


def run(engine, prompts, stop_token: int | None = None):
    params = [dict(p) for p in PARAMS]
    if stop_token is not None:
        params[0]["stop_token_ids"] = [stop_token]
    seen = []
    step = engine.step

    def counted():
        out = step()
        seen.append(len(engine.in_flight))
        return out

    engine.step = counted
    results = engine.generate(input_ids=prompts, sampling_params=params)
    return [(r.output_ids, r.finish_reason) for r in results], max(seen)


def test_overlap_on_and_off_give_identical_output(tiny_dir, make_engine):
    """A small pool (requests are preempted and recomputed), chunked prompts, a stop token met
    while the next step is already in flight."""
    path = tiny_dir("deepseek_v3")
    kwargs = dict(page_size=4, max_total_tokens=112, chunked_prefill_size=16)
    prompts = random_prompts(5, 512, [9, 30, 5, 17, 24], seed=11)
    off = make_engine(path, disable_overlap_schedule=True, **kwargs)
    want, most_off = run(off, prompts)
    stop = want[0][0][7]  # the first request stops at its eighth token
    want, _ = run(off, prompts, stop)
    on = make_engine(path, **kwargs)
    got, most_on = run(on, prompts, stop)
    assert got == want
    assert want[0][1] == "stop" and len(want[0][0]) <= 8
    assert on.preempted_total > 0, "the pool is small enough to preempt"
    assert most_on == 1 and most_off == 0  # a step stays in flight between calls, or none does
    on.check_invariants()


def test_abort_while_a_step_is_in_flight(tiny_dir, make_engine):
    """Aborting a request whose next token is being computed frees its pages at once; the step's
    token for it is dropped when it arrives, and the others go on."""
    engine = make_engine(tiny_dir("glm4_moe"))
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    prompts = random_prompts(2, 512, [7, 12], seed=12)
    rids = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    while len(engine.requests[rids[0]].output_ids) < 3:
        engine.step()
    assert engine.in_flight, "the next step was launched before this one's tokens were read"
    engine.abort(rids[0])
    engine.check_invariants()
    gone = engine.pop_result(rids[0])
    assert gone.finish_reason == "abort"
    while not engine.requests[rids[1]].finished:
        engine.step()
    alone = make_engine(tiny_dir("glm4_moe")).generate(input_ids=prompts[1], sampling_params=params)
    assert engine.pop_result(rids[1]).output_ids == alone.output_ids


def test_seeded_sampling_survives_preemption(tiny_dir, make_engine):
    """A seeded request preempted and recomputed draws what it draws undisturbed: each draw depends
    on its seed and the token's position, not on a generator's history."""
    path = tiny_dir("glm4_moe")
    seeded = {"temperature": 1.0, "seed": 21, "max_new_tokens": 24, "ignore_eos": True}
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompts = random_prompts(3, 512, [20, 18, 22], seed=13)
    alone = make_engine(path).generate(input_ids=prompts[0], sampling_params=seeded)
    small = make_engine(path, page_size=4, max_total_tokens=96)
    crowd = small.generate(input_ids=prompts, sampling_params=[seeded, greedy, greedy])
    assert small.preempted_total > 0
    assert crowd[0].output_ids == alone.output_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decode_steps_launch_without_waiting_for_the_device(tiny_dir, make_engine):
    """On a GPU a plain decode step is launched with no host sync (torch's sync detector set to
    error): the newest tokens come from the device, the result's copy is only started. Greedy
    tokens equal the eager engine's without overlap."""
    path = tiny_dir("deepseek_v3")
    cuda = dict(device="cuda", dtype="float32", max_total_tokens=4096)
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = random_prompts(3, 512, [9, 30, 5], seed=14)
    want = make_engine(path, disable_cuda_graph=True, disable_overlap_schedule=True, **cuda)
    want = want.generate(input_ids=prompts, sampling_params=params)
    engine = make_engine(path, cuda_graph_max_bs=8, **cuda)
    steps, launch, checked = engine.executor.steps, engine.executor.steps.launch, []

    def watched(plan):
        decoding = all(s.length == 1 and not s.draft for g in plan.groups for s in g.spans)
        if not (decoding and plan.overlaps and plan.step > 4):
            return launch(plan)
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked.append(plan.step)
        return pending

    steps.launch = watched
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert len(checked) >= 8
