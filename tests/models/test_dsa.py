"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 with and without "shared" indexer layers):
greedy tokens equal transformers' in float32 on tiny checkpoints whose `index_topk` (6) is well
below the prompts, in the deployment shapes that touch the indexer pool (page size 1, chunked
prefill, a prefix-cache hit, preemption, TP 2, DP attention, pipeline stages); the same weights
with a top-k above every context (dense attention) give other tokens; what is not supported
yet stops with an error that says so. MTP: tests/spec/test_dsa_mtp.py; the Triton kernels:
tests/attention/test_triton_dsa.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import random_prompts
from tests.reference import hf_greedy

NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
LENGTHS = [9, 30, 17]  # index_topk = 6

CASES = {  # id: (arch, engine arguments)
    "v32": ("deepseek_v32", {}),
    "glm5-shared": ("glm_moe_dsa", {}),
    "glm5-full": ("glm_moe_dsa_full", {}),
    "v32-page1": ("deepseek_v32", dict(page_size=1)),
    "glm5-shared-chunked": ("glm_moe_dsa", dict(chunked_prefill_size=8, page_size=4)),
    "glm5-shared-tp2": ("glm_moe_dsa", dict(tp_size=2)),
    "v32-dp-attention": ("deepseek_v32", dict(tp_size=2, dp_size=2)),
    "glm5-shared-pp2": ("glm_moe_dsa", dict(pp_size=2, pp_layer_partition="2,1")),
}


def check_reference_tokens(engine, path: str, prompts) -> list:
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, NEW_TOKENS), prompt
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_gives_the_reference_tokens(case, tiny_dir, make_engine):
    arch, kwargs = CASES[case]
    path = tiny_dir(arch)
    engine = make_engine(path, dtype="float32", **kwargs)
    prompts = random_prompts(3, engine.model_config.vocab_size, LENGTHS, seed=21)
    check_reference_tokens(engine, path, prompts)


def test_prefix_cache_hit_reads_both_pools(tiny_dir, make_engine):
    """A prompt that extends a finished one reuses its pages: the latents and the indexer keys
    of the shared prefix come from the cache (SGLang once lost the indexer state there)."""
    path = tiny_dir("glm_moe_dsa")
    engine = make_engine(path, dtype="float32", page_size=4)
    (first,) = random_prompts(1, engine.model_config.vocab_size, [24], seed=22)
    check_reference_tokens(engine, path, [first])
    longer = first + [7, 99, 5, 250, 31]
    (result,) = check_reference_tokens(engine, path, [longer])
    assert result.meta["cached_tokens"] >= 20, result.meta


def test_preemption_recomputes_both_pools(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v32")
    engine = make_engine(path, dtype="float32", page_size=4, max_total_tokens=64)
    prompts = random_prompts(4, engine.model_config.vocab_size, [20, 14, 17, 9], seed=23)
    results = check_reference_tokens(engine, path, prompts)
    assert engine.preempted_total > 0, "the budget was meant to force preemption"
    assert any(r.meta["num_preemptions"] for r in results)


def test_dense_attention_on_the_same_weights_gives_other_tokens(tiny_dir, make_engine, tmp_path):
    """With a top-k above every context the indexer selects everything: dense MLA (transformers
    agrees); the sparse model's tokens differ from it, so the selection is what the tests see."""
    path = tiny_dir("glm_moe_dsa")
    dense = str(tmp_path / "dense")
    shutil.copytree(path, dense)
    with open(os.path.join(dense, "config.json")) as f:
        config = json.load(f)
    config["index_topk"] = 4096
    with open(os.path.join(dense, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = random_prompts(3, 512, LENGTHS, seed=21)
    sparse = make_engine(path, dtype="float32").generate(input_ids=prompts, sampling_params=GREEDY)
    full = check_reference_tokens(make_engine(dense, dtype="float32"), dense, prompts)
    differ = [s.output_ids != d.output_ids for s, d in zip(sparse, full)]
    assert sum(differ) >= 2, "the selection of 6 of up to 40 positions changes the tokens"


FP8_KEYS = ["--indexer-cache-dtype", "fp8"]
PAIRS = {  # id: (arch, prefill flags, decode flags)
    "v32-p-tp2-d-dp2": ("deepseek_v32", ["--tp", "2"], ["--tp", "2", "--dp", "2"]),
    "glm5-shared-p-pp2-d-tp2": (
        "glm_moe_dsa",
        ["--pp-size", "2", "--pp-layer-partition", "2,1"],
        ["--tp", "2"],
    ),
    # FP8 keys: two buffers a layer (a page's keys, then their scales), across stages and TP
    "glm5-fp8-keys-p-pp2-d-tp2": (
        "glm_moe_dsa",
        ["--pp-size", "2", "--pp-layer-partition", "2,1", *FP8_KEYS],
        ["--tp", "2", *FP8_KEYS],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_disaggregated_pair_moves_the_indexer_keys(pair, tiny_dir, tmp_path, make_engine):
    """The indexer pool travels with the latents (replicated over attention TP: one sender per
    decode rank), across TP, DP attention and pipeline stages (its layers numbered over the
    model's indexer layers): the decode's selections, hence its tokens, are the reference's
    (with FP8 keys: a colocated engine's with FP8 keys)."""
    pytest.importorskip("ucxx")
    from tests.servers import check_and_stop, start_cluster

    arch, prefill, decode = PAIRS[pair]
    path = tiny_dir(arch)
    flags = ["--dtype", "float32"]
    cluster = start_cluster(path, tmp_path, flags + prefill, flags + decode)
    prompts = random_prompts(3, 512, LENGTHS, seed=24)
    expected = lambda ids: hf_greedy(path, ids, NEW_TOKENS)  # noqa: E731
    if FP8_KEYS[-1] in decode:
        engine = make_engine(path, dtype="float32", indexer_cache_dtype="fp8")
        expected = lambda ids: (
            engine.generate(  # noqa: E731
                input_ids=ids, sampling_params=GREEDY
            ).output_ids
        )
    check_and_stop(cluster, prompts, expected, GREEDY)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_backend="flashinfer"), "no sparse attention"),
        (dict(pp_size=2, pp_layer_partition="1,2"), "start at 'full' indexer layers"),
    ],
    ids=["flashinfer", "pp-at-shared-layer"],
)
def test_what_is_not_supported_yet_is_refused(kwargs, message, tiny_dir, make_engine):
    from dserve.runtime.executor import RankFailure

    with pytest.raises((ValueError, RankFailure), match=message):
        make_engine(tiny_dir("glm_moe_dsa"), **kwargs)
