"""Speculative decoding on parallel ranks: the verification and the draft passes run on every rank
of each attention group (TP) and in every DP group (each with its own requests, all groups joining
the MoE collectives of every draft pass). Greedy tokens are the single-rank plain engine's."""

from __future__ import annotations

import pytest

from tests.spec.test_pd_spec import trained_draft

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "seed": 4, "max_new_tokens": 16, "ignore_eos": True}

CASES = {
    "mtp-chain-tp2": ("mtp", "deepseek_v3", dict(speculative_num_steps=2), dict(tp_size=2)),
    "mtp-tree-dp2": (
        "mtp",
        "glm4_moe",
        dict(speculative_num_steps=3, speculative_eagle_topk=2),
        dict(tp_size=2, dp_size=2),
    ),
    "eagle3-tree-tp2": (
        "eagle3",
        "deepseek_v3",
        dict(speculative_num_steps=2, speculative_eagle_topk=2),
        dict(tp_size=2),
    ),
    "eagle3-chain-dp2": (
        "eagle3",
        "glm4_moe",
        dict(speculative_num_steps=2),
        dict(tp_size=2, dp_size=2),
    ),
}


def three_runs(case: tuple, trained_dir, trained_eagle3, make_engine):
    """(path, prompts, plain one-rank results, speculative one-rank results, the engine of
    `case`'s shape, its results): three greedy requests and a seeded sampled one."""
    algorithm, arch, steps, shape = case
    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    ids = info["prompts"][:4]
    params = [GREEDY] * 3 + [SAMPLED]
    plain = make_engine(path).generate(input_ids=ids, sampling_params=params)
    one = make_engine(path, **spec, **steps).generate(input_ids=ids, sampling_params=params)
    engine = make_engine(path, **spec, **steps, **shape)
    got = engine.generate(input_ids=ids, sampling_params=params)
    return path, ids, plain, one, engine, got


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_on_ranks_is_token_exact(case, trained_dir, trained_eagle3, make_engine):
    _, _, plain, one, _, got = three_runs(CASES[case], trained_dir, trained_eagle3, make_engine)
    for i in range(3):
        assert got[i].output_ids == plain[i].output_ids
        assert got[i].meta["spec_accept_length"] > 1.3  # trained drafts: most are taken
    assert got[3].output_ids == one[3].output_ids  # seeded draws through the sampled walk
    assert got[3].meta["spec_verify_ct"] >= 1
