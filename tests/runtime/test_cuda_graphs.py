"""Decode-like steps from static buffers (`runtime/cuda_graphs.py`). On a CPU host the static path
runs eagerly under the Triton interpreter, with the padding, scratch page and row selection of the
GPU path; on a GPU host the steps replay captured CUDA graphs, with no host sync inside a step."""

from __future__ import annotations

import pytest
import torch

from dserve.runtime import cuda_graphs
from dserve.runtime.cuda_graphs import context_buckets, token_buckets
from tests.conftest import count_calls, random_prompts, static_passes_per_step
from tests.reference import hf_greedy

pytest.importorskip("triton")
# the interpreter runs the kernels on a CPU host
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`
EXACT = dict(page_size=4, dtype="float32", device=DEVICE, max_total_tokens=4096)
LENGTHS = [4, 8, 13]  # requests end at different steps: batches of 3, 2 and 1 sequences


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    sizes = token_buckets(1000)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 1000 and 256 in sizes and 320 in sizes


def test_context_buckets():
    assert context_buckets(163840, sparse=False) == [163840]
    assert context_buckets(163840, sparse=True) == [4096, 16384, 65536, 163840]
    assert context_buckets(4096, sparse=True) == [4096]
    assert context_buckets(2048, sparse=True) == [2048]


def test_sparse_attention_steps_run_statically_by_context_width(tiny_dir, make_engine, monkeypatch):
    """A DSA model's decode steps run from static buffers (CUDA graphs on a GPU), each in the
    narrowest context width that holds its longest context (the indexer's scores and top-k
    span that width), with the reference's tokens as they grow through the widths."""
    monkeypatch.setattr(cuda_graphs, "SPARSE_FIRST_CONTEXT", 16)
    path = tiny_dir("glm_moe_dsa")
    engine = make_engine(path, attention_backend="triton", chunked_prefill_size=16, **EXACT)
    (static,) = engine.executor.runner.statics
    assert static.contexts[:3] == [16, 64, 256]
    used, run = [], static.run
    static.run = lambda batch, bucket, *rest: used.append(bucket) or run(batch, bucket, *rest)
    prompt = random_prompts(1, 512, [9], seed=5)[0]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    (result,) = engine.generate(input_ids=[prompt], sampling_params=params)
    assert result.output_ids == hf_greedy(path, prompt, 12)
    assert {context for _, context in used} == {16, 64}  # contexts 10 to 21
    if DEVICE == "cuda":
        assert {(1, 16), (1, 64)} <= set(static.graphs)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"], ids=["mla-decode", "mha-decode"])
def test_static_steps_give_the_reference_tokens(arch, tiny_dir, make_engine):
    """Greedy tokens equal the torch backend's plain engine. With room for two sequences' tokens,
    steps of three sequences run eagerly and the later ones statically, padded to a bucket. (The
    drafts' static passes: tests/spec/test_static_drafts.py and test_naive.py.)"""
    path = tiny_dir(arch)
    prompts = random_prompts(3, 512, [5, 40, 13], seed=1)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    expected = make_engine(path, **EXACT).generate(input_ids=prompts, sampling_params=params)
    engine = make_engine(path, attention_backend="triton", cuda_graph_max_bs=2, **EXACT)
    statics = engine.executor.runner.statics
    assert len(statics) == 1
    assert statics[0].scratch_slot == engine.groups[0].kv.num_pages * 4
    runs = [count_calls(static, "run") for static in statics]
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    for static, calls in zip(statics, runs):
        # at least the steps where one request is left
        assert len(calls) >= LENGTHS[-1] - LENGTHS[1] - 1
        if DEVICE == "cuda":
            assert sorted(static.graphs) == [(n, static.max_context) for n in static.buckets]


def test_backends_hear_each_static_pass_before_it_runs(tiny_dir, make_engine):
    """A backend that plans on the host (FlashInfer) is told before every static pass (a replay
    on a GPU) its padded token count and each token's context length: the real tokens' and one
    position for each pad token."""
    engine = make_engine(tiny_dir("deepseek_v3"), attention_backend="triton", **EXACT)
    runner = engine.executor.runner
    (static,) = runner.statics
    told, passes, run = [], [], static.run

    def tell(tokens, ctx_lens):
        told.append((tokens, ctx_lens.tolist()))

    def counted(batch, bucket, *rest):
        passes.append((bucket[0], batch.token_ctx_lens.tolist()))
        return run(batch, bucket, *rest)

    runner.backend.prepare_static, static.run = tell, counted
    prompts = random_prompts(3, 512, [5, 40, 13], seed=2)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    engine.generate(input_ids=prompts, sampling_params=params)
    assert len(passes) >= LENGTHS[-1] - 1 and len(told) == len(passes)
    for (tokens, ctx_lens), (bucket, real) in zip(told, passes):
        assert tokens == bucket and ctx_lens == real + [1] * (bucket - len(real))
    assert any(bucket > len(real) for bucket, real in passes)  # 3 sequences padded to 4


def test_disabled_static_steps_run_eagerly(tiny_dir, make_engine):
    """`disable_cuda_graph` runs every step eagerly, and the KV manager gets every page (no scratch)."""
    off = make_engine(
        tiny_dir("deepseek_v3"), attention_backend="triton", disable_cuda_graph=True, **EXACT
    )
    assert off.executor.runner.statics == []
    assert off.groups[0].kv.num_pages == off.executor.runner.pool.num_pages == 4096 // 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_has_no_host_sync(tiny_dir):
    """A replayed decode step raises nothing under torch's sync detector set to error, and its
    logits equal the eager step's."""
    from dserve.runtime.config import EngineConfig
    from dserve.runtime.model_runner import ModelRunner
    from dserve.scheduler.kv_manager import KVCacheManager
    from tests.kernel_cases import step_batch

    path = tiny_dir("deepseek_v3")
    config = lambda **kw: EngineConfig(
        path, load_progress=False, attention_backend="triton", **EXACT, **kw
    )
    graphed, eager = (
        ModelRunner(config(cuda_graph_max_bs=8)),
        ModelRunner(config(disable_cuda_graph=True)),
    )
    kv = KVCacheManager(graphed.num_pages, 4, False)
    context = torch.randn(eager.pool.pages.shape, generator=torch.Generator().manual_seed(0))
    # the same random context in both pools (the graphed one has a scratch page)
    eager.pool.pages.copy_(context)
    graphed.pool.pages[: graphed.num_pages].copy_(context)
    batch = step_batch(kv, 5, 30, 1)
    want = eager.forward(batch)
    graphed.forward(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = graphed.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # GEMMs of 8 padded rows may round differently
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"], ids=["mla", "mha"])
def test_pipeline_stages_replay_their_eager_passes(arch, tiny_dir):
    """Two pipeline stages (three layers as 2 + 1) in one process, each with its own pool: a
    decode pass from static buffers (a replayed CUDA graph on a GPU) gives what the eager pass
    gives on each stage: the first stage what it sends (a tensor of its own: the next pass
    writes the static output while a send may still read it), the last its logits from what it
    received (copied into its static input, or received there in place)."""
    from dserve.attention.backend import PassShape
    from dserve.models.parallel import ParallelContext, Stage, split_layers
    from dserve.runtime.config import EngineConfig
    from dserve.runtime.model_runner import ModelRunner
    from dserve.scheduler.kv_manager import KVCacheManager
    from tests.kernel_cases import step_batch

    path = tiny_dir(arch, layers=3)
    layers = split_layers(3, 2, [2, 1])

    def runner(stage: int, static: bool) -> ModelRunner:
        kw = dict(cuda_graph_max_bs=8) if static else dict(disable_cuda_graph=True)
        config = EngineConfig(path, load_progress=False, attention_backend="triton", **EXACT, **kw)
        return ModelRunner(config, ParallelContext(stage=Stage(stage, 2, layers[stage])))

    first, last = [runner(0, s) for s in (False, True)], [runner(1, s) for s in (False, True)]
    kv = KVCacheManager(first[1].num_pages, 4, False)
    for eager, graphed in (first, last):  # the same random context in both pools
        context = torch.randn(eager.pool.pages.shape, generator=torch.Generator().manual_seed(0))
        eager.pool.pages.copy_(context)
        graphed.pool.pages[: graphed.num_pages].copy_(context)
    batch, other = step_batch(kv, 5, 30, 1), step_batch(kv, 3, 30, 1)
    sent = [stage.forward(batch) for stage in first]
    kept = sent[1].clone()
    first[1].forward(other)  # the next pass: the same static output buffer
    logits = [stage.forward(batch, received=sent[0]) for stage in last]
    assert [r.static_passes for r in first + last] == [0, 2, 0, 1]
    assert sent[1].shape == sent[0].shape == (5, first[0].stage_output_width())
    assert torch.equal(sent[1], kept)
    # GEMMs of 8 padded rows may round differently
    assert torch.allclose(sent[1], sent[0], atol=1e-4, rtol=1e-4)
    assert logits[1].shape == logits[0].shape == (5, last[0].model_config.vocab_size)
    assert torch.allclose(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    # what a stage receives in place: the static pass's own input, or a tensor of its own
    shapes = [PassShape.of(batch)]
    inboxes = [stage.stage_input(batch, shapes, 5) for stage in last]
    assert inboxes[1].data_ptr() == last[1].statics[0].received.data_ptr()
    assert inboxes[0].shape == inboxes[1].shape == sent[0].shape
    inboxes[1].copy_(sent[0])
    assert torch.equal(last[1].forward(batch, received=inboxes[1]), logits[1])
    if DEVICE == "cuda":
        assert all(r.statics[0].graphs for r in (first[1], last[1]))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter, on the CPU")
def test_static_passes_on_parallel_ranks(tiny_dir, make_engine):
    """TP 2 with DP attention 2 and EP 2, gloo: every DP group pads its part of a pass to the same
    bucket (a group with nothing left to do runs padding only), so the gathers before the MoE
    match; decode steps and MTP's draft passes run from static buffers on every rank, and the
    greedy tokens are the torch backend's on one rank."""
    path = tiny_dir("deepseek_v3", mtp=True)
    prompts = random_prompts(3, 512, [5, 12, 9], seed=5)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (4, 9, 6)]
    cpu = dict(page_size=4, dtype="float32", device="cpu", max_total_tokens=4096)
    want = make_engine(path, **cpu).generate(input_ids=prompts, sampling_params=params)
    ranks = dict(tp_size=2, dp_size=2, ep_size=2, attention_backend="triton", cuda_graph_max_bs=2)
    engine = make_engine(path, speculative_algorithm="mtp", **ranks, **cpu)
    static = static_passes_per_step(engine)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert any(all(n >= 2 for n in step) for step in static)  # the verify and the catch-up
