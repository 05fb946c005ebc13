"""MTP on a sparse-attention model (GLM-5 with a "shared" layer): the NextN layer has its own
indexer and indexer pool; accepted tree paths move the target's indexer keys with its latents.
Transformers ignores the NextN layer, so the check is speculation on == off, on a target and
draft trained together (bench/train_mtp.py) so that drafts are accepted."""

from __future__ import annotations

import pytest

from tests.conftest import made_once
from tests.drafts import train

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SHAPES = {
    "chain": dict(speculative_num_steps=3),
    "tree": dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4),
}


@pytest.fixture(scope="module")
def trained_dsa(tmp_path_factory):
    return made_once(
        tmp_path_factory,
        "mtp_trained_glm_moe_dsa",
        lambda out: train("glm_moe_dsa", out, steps=60, log=lambda *_: None),
    )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mtp_on_sparse_attention_is_lossless(shape, trained_dsa, make_engine):
    path, info = trained_dsa
    prompts = info["prompts"][:3]
    plain = make_engine(path).generate(input_ids=prompts, sampling_params=GREEDY)
    engine = make_engine(path, speculative_algorithm="mtp", **SHAPES[shape])
    assert engine.executor.runner.draft_index_pool is not None
    spec = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    accepted = [r.meta["spec_accept_length"] for r in spec]
    assert min(accepted) > 1.5, accepted  # accepted drafts: tree paths moved in both pools


@pytest.mark.slow
def test_disaggregated_mtp_on_sparse_attention(trained_dsa, tmp_path, make_engine):
    """A pair with MTP: the draft's latents and its indexer keys travel ("draft" and
    "draft-index" pools) with the target's; tokens equal the plain engine's and, both sides of
    one rank, every step accepts what the colocated engine accepts (the decode's draft selects
    over the prompt's draft keys as the colocated one does)."""
    pytest.importorskip("ucxx")
    from tests.spec.test_pd_spec import check_pair

    path, info = trained_dsa
    spec = {"speculative_algorithm": "mtp", **SHAPES["tree"]}
    args = dict(path=path, prompts=info["prompts"][:3], spec_kwargs=spec)
    check_pair(**args, prefill_tp=1, decode_tp=1, tmp_path=tmp_path, make_engine=make_engine,
               min_accept_length=1.5)  # fmt: skip
