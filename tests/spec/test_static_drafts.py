"""The two-pass draft's passes from static buffers (`runtime/cuda_graphs.py`): the same drafts as eager."""

from __future__ import annotations

import pytest

from tests.conftest import count_calls
from tests.spec.test_pd_spec import trained_draft

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.mark.gpu  # on the GPU where there is one
@pytest.mark.parametrize("algorithm,arch", [("eagle3", "deepseek_v3"), ("mtp", "glm4_moe")])
def test_draft_passes_through_static_steps(
    algorithm, arch, trained_dir, trained_eagle3, make_engine
):
    """The two-pass draft's chain passes (its catch-up after each verify, its further steps) run from
    static buffers too (CUDA graphs on a GPU, eagerly under the Triton interpreter here). EAGLE-3's
    catch-up reads the target's three aux states and its later steps its own state: one set of
    buffers for each width. Tokens are the plain engine's, drafts the eager two-pass engine's."""
    import torch

    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    spec = {**spec, "speculative_num_steps": 2}
    ids, params = info["prompts"][:2], {**GREEDY, "max_new_tokens": 16}
    kwargs = dict(
        page_size=4,
        dtype="float32",
        max_total_tokens=4096,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    plain = make_engine(path, **kwargs).generate(input_ids=ids, sampling_params=params)
    eager = make_engine(path, **kwargs, **spec).generate(input_ids=ids, sampling_params=params)
    engine = make_engine(path, attention_backend="triton", **kwargs, **spec)
    target, *drafts = engine.executor.runner.statics
    assert len(drafts) == (2 if algorithm == "eagle3" else 1)
    runs = [count_calls(static, "run") for static in drafts]
    got = engine.generate(input_ids=ids, sampling_params=params)
    assert [g.output_ids for g in got] == [p.output_ids for p in plain]
    assert [g.meta["spec_accepted_per_step"] for g in got] == [
        e.meta["spec_accepted_per_step"] for e in eager
    ]
    assert all(len(calls) >= 5 for calls in runs)
