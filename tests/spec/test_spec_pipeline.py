"""Speculative decoding with pipeline stages: the draft lives on the last stage, which verifies,
catches the draft up and proposes; the earlier stages follow each verdict from the next plan (the
accepted path's KV moves to consecutive positions in their pools too), and EAGLE-3's aux hidden
states travel with the activations. Greedy tokens equal the plain engine's and transformers', and
every verify accepts what it accepts without stages (trained drafts); seeded sampling draws the
same tokens as one stage and keeps the target's distribution; colocated and disaggregated."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import static_passes_per_step
from tests.reference import hf_greedy
from tests.spec.test_acceptance import chi_square_same_distribution, sampled_tokens
from tests.spec.test_pd_spec import check_pair, trained_draft
from tests.spec.test_spec_ranks import three_runs

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "seed": 4, "max_new_tokens": 16, "ignore_eos": True}
CHAIN = dict(speculative_num_steps=2)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=6)
NAIVE = dict(speculative_naive=True, speculative_num_steps=1, speculative_num_draft_tokens=2)
PP2 = dict(pp_size=2)
SAMPLES = 1000  # draws per engine: equal to one stage's, one by one, and chi-square to the plain
PP2_TP2_DP2 = dict(pp_size=2, tp_size=2, dp_size=2, ep_size=2)

CASES = {  # id: (algorithm, arch, speculation, parallel shape)
    "mtp-chain-pp2": ("mtp", "deepseek_v3", CHAIN, PP2),
    "mtp-tree-pp2": ("mtp", "glm4_moe", TREE, PP2),
    "mtp-naive-pp2": ("mtp", "deepseek_v3", NAIVE, PP2),
    "eagle3-tree-pp2": ("eagle3", "deepseek_v3", TREE, PP2),
    "mtp-tree-pp2xtp2-dp2": ("mtp", "deepseek_v3", TREE, PP2_TP2_DP2),
    "eagle3-chain-pp2xtp2-dp2": ("eagle3", "glm4_moe", CHAIN, PP2_TP2_DP2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stages_with_speculation_are_lossless(case, trained_dir, trained_eagle3, make_engine):
    runs = three_runs(CASES[case], trained_dir, trained_eagle3, make_engine)
    path, ids, plain, one, engine, got = runs
    for i in range(3):
        assert got[i].output_ids == plain[i].output_ids
        assert got[i].output_ids == hf_greedy(path, ids[i], GREEDY["max_new_tokens"])
        # the same drafts taken, verify by verify: the last stage's draft sees what it sees
        # without stages, and the earlier stages' KV follows each verdict
        assert got[i].meta["spec_accepted_per_step"] == one[i].meta["spec_accepted_per_step"]
        assert got[i].meta["spec_accept_length"] > 1.3  # trained drafts: most are taken
    assert got[3].output_ids == one[3].output_ids  # seeded draws through the sampled walk
    assert got[3].meta["spec_verify_ct"] >= 1
    assert_engine_pages_free(engine)


def assert_engine_pages_free(engine) -> None:
    for group in engine.groups:
        assert group.kv.num_used_pages == 0
    engine.check_invariants()


def test_sampling_with_stages_keeps_the_target_distribution(trained_dir, make_engine):
    """A tree of topk 4 under pp 2: every seeded draw equals one stage's (itself chi-square
    tested with 2000 draws in test_acceptance), and the tokens at each verified position are the
    plain engine's distribution (chi-square)."""
    path, info = trained_dir("deepseek_v3")
    prompt = info["prompts"][0]
    spec = dict(speculative_algorithm="mtp", max_running_requests=512, **TREE)
    plain = sampled_tokens(make_engine(path, max_running_requests=512), prompt, SAMPLES)
    one = sampled_tokens(make_engine(path, **spec), prompt, SAMPLES)
    engine = make_engine(path, **spec, **PP2)
    staged = sampled_tokens(engine, prompt, SAMPLES)
    assert staged == one
    stats = engine.speculation
    assert 0 < sum(stats.accepted) < sum(stats.proposed), (stats.accepted, stats.proposed)
    for position in (1, 2, 3):
        ours, theirs = [s[position] for s in staged], [p[position] for p in plain]
        assert len(set(theirs)) > 3
        assert chi_square_same_distribution(ours, theirs) > 1e-3, position


def test_aborts_mid_verify_free_every_stage(trained_dir, make_engine):
    """Requests aborted while their verify steps are in flight, and many rejections (an
    untrained topk 4 tree on a sampled request): every page of every stage comes back."""
    path, info = trained_dir("glm4_moe")
    engine = make_engine(path, speculative_algorithm="mtp", **TREE, **PP2)
    long = {"temperature": 1.5, "seed": 3, "max_new_tokens": 64, "ignore_eos": True}
    rids = [engine.add_request(input_ids=p, sampling_params=long) for p in info["prompts"][:6]]
    for _ in range(6):
        engine.step()
    for rid in rids[::2]:
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    finished = [engine.pop_result(rid) for rid in rids]
    assert {r.finish_reason for r in finished[::2]} == {"abort"}
    assert all(len(r.output_ids) == 64 for r in finished[1::2])
    assert_engine_pages_free(engine)


PD_SHAPES = {  # id: (algorithm, arch, speculation, prefill flags, decode flags)
    "mtp-p-tp2-d-pp2": ("mtp", "deepseek_v3", CHAIN, ["--tp", "2"], ["--pp-size", "2"]),
    "eagle3-tree-p-pp2-d-pp2xtp2-dp2": (
        "eagle3",
        "glm4_moe",
        TREE,
        ["--pp-size", "2"],
        ["--pp-size", "2", "--tp", "2", "--dp", "2", "--ep", "2"],
    ),
}


@pytest.mark.parametrize("shape", list(PD_SHAPES))
def test_disaggregated_decode_with_stages_and_speculation(
    shape, trained_dir, trained_eagle3, tmp_path, make_engine
):
    """The prefill's draft KV lands on the decode stage that holds the draft, whatever the
    prefill's stages; the first draft tree travels with the first token."""
    algorithm, arch, steps, prefill, decode = PD_SHAPES[shape]
    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    args = dict(path=path, prompts=info["prompts"][:3], spec_kwargs={**spec, **steps})
    check_pair(
        **args,
        prefill_tp=prefill,
        decode_tp=decode,
        tmp_path=tmp_path,
        make_engine=make_engine,
        min_accept_length=1.3,
    )


STATIC_CASES = {  # id: (algorithm, speculation, static passes a step at least)
    "eagle3-chain": ("eagle3", CHAIN, 2),  # the verify, then the draft's own passes
    "mtp-naive": ("mtp", NAIVE, 1),  # one pass: the target and the draft's fused step
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter, on the CPU")
@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_stages_run_static_passes(case, trained_dir, trained_eagle3, make_engine):
    """pp 2 on the triton backend (gloo): each stage runs its decode steps and chain verifies
    from static buffers (CUDA graphs on a GPU), the last stage its draft's passes too (or the
    naive fused step), EAGLE-3's aux states crossing from the first stage to the last in them;
    the greedy tokens are the torch backend's on one rank, and every verify accepts the same
    drafts."""
    algorithm, steps, least = STATIC_CASES[case]
    path, info, spec = trained_draft(algorithm, "deepseek_v3", trained_dir, trained_eagle3)
    ids = info["prompts"][:3]
    params = {**GREEDY, "max_new_tokens": 12}
    one = make_engine(path, **spec, **steps).generate(input_ids=ids, sampling_params=params)
    static = dict(attention_backend="triton", cuda_graph_max_bs=4)
    engine = make_engine(path, **spec, **steps, **PP2, **static)
    passes = static_passes_per_step(engine)
    got = engine.generate(input_ids=ids, sampling_params=params)
    for mine, theirs in zip(got, one):
        assert mine.output_ids == theirs.output_ids
        assert mine.meta["spec_accepted_per_step"] == theirs.meta["spec_accepted_per_step"]
    assert any(n >= least for (n,) in passes)
    assert_engine_pages_free(engine)
