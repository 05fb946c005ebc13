"""Acceptance that means something: a tiny target and its MTP draft trained briefly on a synthetic
phrase corpus (bench/train_mtp.py, ~10 s on the CPU) accept well over one draft token per verify,
with the output equal to the plain engine's, also split over ranks (TP=2, DP attention 2); so does
an EAGLE-3 draft trained for that target (bench/train_eagle3.py)."""

from __future__ import annotations

import pytest

from tests.drafts import measure


def test_trained_draft_is_accepted(trained):
    path, info = trained
    assert info["final_draft_loss"] < 1.0, info  # the phrases were learned
    rows = {
        r["steps"]: r["accept_length"] for r in measure(path, info["prompts"], steps_list=(1, 3))
    }
    assert rows[1] > 1.5, rows  # measure() also checks the output equals the plain engine's
    assert rows[3] > 2.0, rows
    tree = measure(path, info["prompts"], steps_list=(3,), topk=4)[1]["accept_length"]
    assert tree > 2.0, (tree, rows)  # a draft tree of 4 branches per pass, 12 nodes


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_trained_eagle3_draft_is_accepted(arch, trained_eagle3):
    """Its first step is trained (no training-time-test unrolling), so one draft step is measured."""
    target, draft, info = trained_eagle3(arch)
    assert info["final_draft_loss"] < 1.0, info
    spec = {"speculative_algorithm": "eagle3", "speculative_draft_model_path": draft}
    rows = measure(target, info["prompts"], steps_list=(1,), speculative=spec)
    assert rows[1]["accept_length"] > 1.5, rows
    tree = measure(target, info["prompts"], steps_list=(1,), speculative=spec, topk=4)[1][
        "accept_length"
    ]
    # the chain's guess is one of the root's 4 children
    assert tree >= rows[1]["accept_length"], (
        tree,
        rows,
    )


@pytest.mark.parametrize("topk", [1, 4])
def test_speculation_across_ranks_is_lossless(topk, trained, make_engine):
    path, info = trained
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    expected = make_engine(path).generate(input_ids=info["prompts"][:4], sampling_params=params)
    engine = make_engine(
        path,
        tp_size=2,
        dp_size=2,
        speculative_algorithm="mtp",
        speculative_num_steps=2,
        speculative_eagle_topk=topk,
    )
    got = engine.generate(input_ids=info["prompts"][:4], sampling_params=params)
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    assert sum(len(g.output_ids) for g in got) / sum(g.meta["spec_verify_ct"] for g in got) > 1.5


def chi_square_same_distribution(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test that `a` and `b` come from one distribution (rare
    values pooled so every expected count is at least 5)."""
    import torch

    values = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(v), b.count(v)] for v in values], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    rare = expected.min(1).values < 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
        expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.shape[0] - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )


SAMPLES = 1500


def sampled_tokens(engine, prompt: list[int], samples: int = SAMPLES) -> list[list[int]]:
    params = [
        {"temperature": 3.0, "top_k": 8, "max_new_tokens": 4, "ignore_eos": True, "seed": s}
        for s in range(samples)
    ]
    return [
        r.output_ids for r in engine.generate(input_ids=[prompt] * samples, sampling_params=params)
    ]


# a chain on the MLA model, a tree on the MHA one (the sampling code is the same for both models;
# all four took a minute of the CPU suite)
@pytest.mark.parametrize("arch,topk", [("deepseek_v3", 1), ("glm4_moe", 4)])
def test_speculative_sampling_keeps_the_target_distribution(arch, topk, trained_dir, make_engine):
    """Seeded sampling with drafts (accepted with probability p(d), else a draw from the rest; in a
    tree the next sibling is tried on what is left) against the plain engine's: the tokens at each
    verified position are one distribution."""
    path, info = trained_dir(arch)
    prompt = info["prompts"][0]
    plain = sampled_tokens(make_engine(path, max_running_requests=512), prompt)
    engine = make_engine(
        path,
        max_running_requests=512,
        speculative_algorithm="mtp",
        speculative_num_steps=2,
        speculative_eagle_topk=topk,
    )
    spec = sampled_tokens(engine, prompt)
    assert [s[0] for s in spec] == [
        p[0] for p in plain
    ]  # the first token comes from the prefill alike
    stats = engine.speculation
    assert 0 < sum(stats.accepted) < sum(stats.proposed), (stats.accepted, stats.proposed)
    for position in (1, 2, 3):
        ours, theirs = [s[position] for s in spec], [p[position] for p in plain]
        assert len(set(theirs)) > 3  # a real distribution, not one token
        p_value = chi_square_same_distribution(ours, theirs)
        assert p_value > 1e-3, (position, p_value)
