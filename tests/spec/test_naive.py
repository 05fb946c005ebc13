"""Naive (fused) speculation: the draft's extend runs inside the target's forward call. Greedy
requests get exactly the two-pass engine's drafts (so the same acceptance, verify by verify) and the
target's tokens; a sampled request and one with logprobs share the batches; pages all come back."""

from __future__ import annotations

import pytest

from tests.conftest import count_calls
from tests.spec.test_pd_spec import check_pair, trained_draft

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
MIXED = [GREEDY] * 3 + [
    {"temperature": 0.8, "seed": 3, "max_new_tokens": 24, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "return_logprob": True},
]


@pytest.mark.parametrize("algorithm", ["mtp", "eagle3"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_naive_equals_two_passes(algorithm, arch, trained_dir, trained_eagle3, make_engine):
    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    ids = info["prompts"][:5]
    kwargs = dict(chunked_prefill_size=8, page_size=4)
    plain = make_engine(path, **kwargs).generate(input_ids=ids, sampling_params=MIXED)
    two = make_engine(path, **kwargs, **spec).generate(input_ids=ids, sampling_params=MIXED)
    engine = make_engine(path, **kwargs, **spec, speculative_naive=True)
    calls, steps = (
        count_calls(engine.executor.runner, "forward"),
        count_calls(engine.executor.steps, "launch"),
    )
    naive = engine.generate(input_ids=ids, sampling_params=MIXED)
    assert len(calls) == len(steps) > 0  # one forward call per step
    for i in (0, 1, 2, 4):  # greedy: the target's tokens
        assert naive[i].output_ids == plain[i].output_ids
    for i in (0, 1, 2):  # and the two-pass drafts, verify by verify
        assert naive[i].meta["spec_accepted_per_step"] == two[i].meta["spec_accepted_per_step"]
        assert naive[i].meta["spec_accept_length"] > 1.5
    assert "spec_verify_ct" not in naive[4].meta  # logprobs: no drafts
    # sampled: drafts verified
    assert len(naive[3].output_ids) == 24 and naive[3].meta["spec_verify_ct"] >= 1
    engine.check_invariants()
    assert all(not g.kv.tables for g in engine.groups)


def test_naive_across_ranks(trained_dir, make_engine):
    """TP 2 with DP attention 2: the draft joins every rank's forward call, empty groups included."""
    path, info = trained_dir("deepseek_v3")
    ids = info["prompts"][:4]
    plain = make_engine(path).generate(input_ids=ids, sampling_params=GREEDY)
    engine = make_engine(
        path, tp_size=2, dp_size=2, speculative_algorithm="mtp", speculative_naive=True
    )
    got = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert [g.output_ids for g in got] == [p.output_ids for p in plain]
    assert sum(len(g.output_ids) for g in got) / sum(g.meta["spec_verify_ct"] for g in got) > 1.5


def test_naive_settings_are_checked():
    from dserve.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_naive runs steps 1, topk 1, 2 draft tokens"):
        EngineConfig(
            "x", speculative_algorithm="mtp", speculative_naive=True, speculative_num_steps=2
        )


@pytest.mark.parametrize(
    "algorithm,arch,prefill_tp,decode_tp",
    [("mtp", "deepseek_v3", 2, 1), ("eagle3", "glm4_moe", 1, 2)],
)
def test_naive_pair_matches_colocated(
    algorithm, arch, prefill_tp, decode_tp, trained_dir, trained_eagle3, tmp_path, make_engine
):
    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    check_pair(
        path,
        info["prompts"][:3],
        {**spec, "speculative_naive": True},
        prefill_tp,
        decode_tp,
        tmp_path,
        make_engine,
        min_accept_length=1.5,
    )


@pytest.mark.gpu  # on the GPU where there is one
@pytest.mark.parametrize("algorithm,arch", [("eagle3", "deepseek_v3"), ("mtp", "glm4_moe")])
def test_naive_through_static_steps(algorithm, arch, trained_dir, trained_eagle3, make_engine):
    """With the triton backend the fused step runs from the static buffers (a CUDA graph per bucket on
    a GPU; eagerly under the Triton interpreter here): an MLA target with the MHA EAGLE-3 draft, an
    MHA target with its MHA MTP draft. Greedy tokens are the plain engine's, drafts the two-pass's."""
    import torch

    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    ids, params = info["prompts"][:2], {**GREEDY, "max_new_tokens": 16}
    kwargs = dict(
        page_size=4,
        dtype="float32",
        max_total_tokens=4096,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    plain = make_engine(path, **kwargs).generate(input_ids=ids, sampling_params=params)
    two = make_engine(path, **kwargs, **spec).generate(input_ids=ids, sampling_params=params)
    engine = make_engine(path, attention_backend="triton", speculative_naive=True, **kwargs, **spec)
    runs = count_calls(engine.executor.runner.statics[0], "run")
    naive = engine.generate(input_ids=ids, sampling_params=params)
    assert [n.output_ids for n in naive] == [p.output_ids for p in plain]
    assert [n.meta["spec_accepted_per_step"] for n in naive] == [
        t.meta["spec_accepted_per_step"] for t in two
    ]
    assert len(runs) >= 5
