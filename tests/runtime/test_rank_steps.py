"""Steps run on the ranks: under TP 2 only plans and tokens cross the pipes (no logits),
sampling with seeds, penalties and logprobs gives what one rank gives, and a rank answers a
held step as soon as its tokens are on the host, launching first only a plan that comes before
them."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import threading

import pytest
import torch

from dserve.runtime.worker import run_steps
from dserve.step.plan import GroupPlan, Settle, StepPlan, StepResult
from tests.conftest import random_prompts

MIXED = [
    {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_new_tokens": 12, "ignore_eos": True},
    {
        "temperature": 0.8,
        "top_k": 20,
        "seed": 5,
        "max_new_tokens": 10,
        "ignore_eos": True,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.2,
    },
    {
        "temperature": 0,
        "max_new_tokens": 8,
        "ignore_eos": True,
        "return_logprob": True,
        "top_logprobs_num": 3,
    },
]


def tensors_in(value) -> list:
    """Every torch.Tensor inside a message (dataclasses, lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def record_traffic(executor) -> tuple[list, list]:
    """What the front sends the ranks and what they answer, as the executor sees it."""
    sent, received = [], []
    send, gather = executor._send, executor._gather

    def recording_send(message):
        sent.append(message)
        send(message)

    def recording_gather(*args):
        replies = gather(*args)
        received.extend(payload for _, payload in replies)
        return replies

    executor._send, executor._gather = recording_send, recording_gather
    return sent, received


@pytest.mark.slow
def test_tp2_moves_plans_and_tokens_not_logits(tiny_dir, make_engine):
    """Every reply is the leader's StepResult or the other rank's digest of it: no tensor, a few
    hundred bytes where one row of logits alone is vocab x 4 bytes. Plans carry no tensor either,
    and some overlap (the ranks hold a result back until the next plan is launched)."""
    engine = make_engine(tiny_dir("deepseek_v3"), tp_size=2)
    sent, received = record_traffic(engine.executor)
    prompts = random_prompts(4, engine.model_config.vocab_size, [9, 30, 5, 17], seed=7)
    results = engine.generate(input_ids=prompts, sampling_params=MIXED)
    assert [len(r.output_ids) for r in results] == [12, 12, 10, 8]
    results_seen = [r for r in received if isinstance(r, StepResult)]
    digests = [r for r in received if isinstance(r, int)]
    assert len(results_seen) == len(digests) > 10  # one of each per step
    one_row = engine.model_config.vocab_size * 4
    for reply in results_seen:
        assert not tensors_in(reply)
        assert len(pickle.dumps(reply)) < one_row
    plans = [m for m in sent if isinstance(m, StepPlan)]
    assert plans and not any(tensors_in(p) for p in plans)
    assert any(p.overlaps for p in plans)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(tp_size=2), dict(tp_size=2, dp_size=2)], ids=["tp2", "dp2"])
def test_sampling_under_tp2_equals_one_rank(shape, tiny_dir, make_engine):
    """Seeded draws (each request's generator lives on its group's ranks), penalties over the
    tokens sampled so far, logprobs of the chosen tokens: the same as on one rank."""
    path = tiny_dir("glm4_moe")
    prompts = random_prompts(4, 512, [9, 30, 5, 17], seed=8)
    one = make_engine(path).generate(input_ids=prompts, sampling_params=MIXED)
    two = make_engine(path, **shape).generate(input_ids=prompts, sampling_params=MIXED)
    assert [r.output_ids for r in two] == [r.output_ids for r in one]
    ours, theirs = two[3].meta, one[3].meta
    for (lp, token), (want, want_token) in zip(
        ours["output_token_logprobs"], theirs["output_token_logprobs"]
    ):
        assert token == want_token and lp == pytest.approx(want, abs=1e-4)
    for top, want in zip(ours["output_top_logprobs"], theirs["output_top_logprobs"]):
        assert [t for t, _ in top] == [t for t, _ in want]


class RecordedSteps:
    """`run_steps`' side of a `StepRunner`, recording the order of its calls; a step's
    tokens are on the host once the test says so (`on_host`)."""

    def __init__(self):
        self.calls: list[str] = []
        self.on_host: set[int] = set()

    def launch(self, plan: StepPlan) -> int:
        self.calls.append(f"launch {plan.step}")
        return plan.step

    def ready(self, step: int) -> bool:
        return step in self.on_host

    def finish(self, step: int) -> StepResult:
        self.calls.append(f"finish {step}")
        return StepResult(step, [])


def test_a_held_result_is_answered_once_on_the_host():
    """Overlapped plans: the rank holds a step's result (the device runs it while the front
    reads the one before) and answers it as soon as its tokens are on the host, without
    waiting for the next plan; when the next plan comes first, it launches that plan, then
    answers (the device keeps a step queued). Answers leave in step order."""
    front, rank = mp.Pipe()
    steps = RecordedSteps()
    loop = threading.Thread(target=run_steps, args=(steps, rank, True), daemon=True)
    loop.start()

    def send(message):
        front.send_bytes(pickle.dumps(message))

    def plan(step):
        send(StepPlan(step, [GroupPlan()], overlaps=True))

    plan(1)
    assert not front.poll(0.2), "held while its tokens are on the device"
    steps.on_host.add(1)
    assert front.poll(2) and front.recv()[1].step == 1  # no plan needed
    plan(2)
    plan(3)  # before step 2's tokens reach the host
    assert front.recv()[1].step == 2
    steps.on_host.add(3)
    assert front.recv()[1].step == 3
    send(Settle())  # nothing left to answer
    send(None)
    loop.join(timeout=5)
    assert not loop.is_alive()
    assert not front.poll(0.1), "one answer a step"
    assert steps.calls == [
        "launch 1",
        "finish 1",  # on the host while the rank waited
        "launch 2",
        "launch 3",
        "finish 2",  # plan 3 came first
        "finish 3",
    ]
