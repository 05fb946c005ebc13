"""Parallel ranks on the CPU with gloo: TP, DP attention and EP give the single-rank engine's and
transformers' greedy tokens; each rank holds its share of the weights; bad sizes fail before any
weight is read; a dead rank takes the instance down promptly instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dserve.runtime import Engine, SamplingParams
from dserve.runtime.executor import RankFailure
from tests.conftest import random_prompts
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
SHAPES = {
    "tp2": dict(tp_size=2),
    "tp2-dp2": dict(tp_size=2, dp_size=2),  # two attention groups of one rank, MoE over both
    "tp4-dp2": dict(tp_size=4, dp_size=2),  # two attention groups of two ranks (attention-TP 2)
    "ep2": dict(tp_size=2, ep_size=2),
}


@pytest.mark.slow
def test_gqa_kv_heads_replicated_over_more_ranks(tiny_dir, make_engine):
    """GLM tiny has 2 KV heads: with 4 attention ranks each pair of ranks shares (replicates) one."""
    path = tiny_dir("glm4_moe")
    engine = make_engine(path, tp_size=4)
    shapes = [
        info.parameter_shapes["layers.0.self_attn.qkv_proj.weight"]
        for info in engine.executor.rank_info
    ]
    head_dim = engine.model_config.head_dim
    assert all(shape[0] == 3 * head_dim for shape in shapes)  # one q head, one k head, one v head
    prompts = random_prompts(2, engine.model_config.vocab_size, [21, 8], seed=43)
    for prompt, result in zip(prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY)):
        assert result.output_ids == hf_greedy(path, prompt, 24)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch_name", ["deepseek_v3", "glm4_moe"])
def test_parallel_greedy_matches_single_rank_and_transformers(
    tiny_dir, make_engine, arch_name, shape
):
    check_parallel_parity(tiny_dir(arch_name), make_engine, SHAPES[shape], device="cpu")


# every shape of both MoE models, and sparse attention (GLM-5's indexer, DeepSeek-V3.2's) split
GPU_CASES = [(a, s) for a in ("deepseek_v3", "glm4_moe") for s in SHAPES] + [
    ("glm_moe_dsa", "tp2"),
    ("deepseek_v32", "tp2-dp2"),
]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("arch_name,shape", GPU_CASES, ids=[f"{a}-{s}" for a, s in GPU_CASES])
def test_parallel_greedy_on_gpus_with_nccl(tiny_dir, make_engine, arch_name, shape):
    """Each shape on as many GPUs as it has ranks (tp4-dp2: four), CUDA graphs on."""
    ranks = SHAPES[shape]["tp_size"]
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{shape} needs {ranks} GPUs")
    check_parallel_parity(tiny_dir(arch_name), make_engine, SHAPES[shape], device="cuda")


def check_parallel_parity(path: str, make_engine, shape: dict, device: str) -> None:
    # explicit pools: two engines share a GPU here, and one sized from free memory would take it all
    engine = make_engine(path, device=device, dtype="float32", max_total_tokens=8192, **shape)
    prompts = random_prompts(4, engine.model_config.vocab_size, [5, 23, 40, 17], seed=41)
    rids = [engine.add_request(input_ids=p, sampling_params=GREEDY) for p in prompts]
    if engine.config.dp_size > 1:
        assert set(engine.group_of.values()) == {0, 1}, (
            "requests are spread over the DP groups by load"
        )
    while engine.groups[0].scheduler.has_work or engine.groups[-1].scheduler.has_work:
        engine.step()
    outputs = [engine.pop_result(rid).output_ids for rid in rids]
    single = make_engine(path, device=device, dtype="float32", max_total_tokens=8192).generate(
        input_ids=prompts, sampling_params=GREEDY
    )
    for prompt, output, alone in zip(prompts, outputs, single):
        assert output == alone.output_ids == hf_greedy(path, prompt, 24)


def _local_bytes(shape, dtype_bytes=4) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype_bytes


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, split", [(dict(tp_size=2), 2), (dict(tp_size=2, ep_size=2), 2)])
def test_each_rank_loads_its_share_of_the_weights(tiny_dir, make_engine, kwargs, split):
    """Measured parameter bytes per rank == replicated parameters + 1/T of the split ones."""
    path = tiny_dir("deepseek_v3")
    whole = {
        n: tuple(p.shape) for n, p in make_engine(path).executor.runner.model.named_parameters()
    }
    total = sum(_local_bytes(s) for s in whole.values())
    engine = make_engine(path, **kwargs)
    for info in engine.executor.rank_info:
        assert set(info.parameter_shapes) == set(whole)
        replicated = sum(_local_bytes(s) for n, s in whole.items() if info.parameter_shapes[n] == s)
        assert info.parameter_bytes == replicated + (total - replicated) // split
        assert replicated < 0.25 * total  # most of the model is split
        assert info.parameter_bytes < 0.65 * total


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(tp_size=3),
            r"num_attention_heads = 4 does not divide by attention ranks \(tp_size / dp_size\) = 3",
        ),
        (dict(tp_size=8, ep_size=8), "n_routed_experts = 8|num_attention_heads = 4"),
        (dict(tp_size=2, ep_size=3), "tp_size = 2 does not divide by ep_size = 3"),
        (dict(tp_size=2, dp_size=4), "tp_size = 2 does not divide by dp_size = 4"),
        (dict(tp_size=2, device="cuda"), "tp_size = 2 needs 2 GPUs"),
    ],
)
def test_bad_parallel_sizes_fail_before_loading(tiny_dir, kwargs, message):
    if kwargs.get("device") == "cuda":
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this host has the GPUs")
    path = tiny_dir("glm4_moe")  # written before the clock starts
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        Engine(path, load_progress=False, **{"device": "cpu", **kwargs})
    assert time.perf_counter() - start < 5, "the check runs before any rank starts"


@pytest.mark.slow
def test_dead_rank_fails_requests_promptly_and_reaps_every_rank(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"), tp_size=2, collective_timeout_s=30)
    rid = engine.add_request(
        input_ids=[10, 11, 12, 13, 14], sampling_params=SamplingParams(max_new_tokens=200)
    )
    engine.step()
    procs = engine.executor.procs
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RankFailure, match="rank 1 died"):
        for _ in range(200):
            engine.step()
    assert time.perf_counter() - start < 20
    assert not any(p.is_alive() for p in procs), "every rank is reaped"
    result = engine.pop_result(rid)
    assert result.finish_reason == "abort" and "rank 1 died" in result.meta["error"]
    with pytest.raises(RankFailure, match="shut down"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
