"""Speculative decoding across a prefill/decode pair: the prefill runs the draft over the prompt and
sends the draft's KV (its own pool, remapped by the same rules as the target's) and its proposals
with the first token; the decode verifies them in its first step. Output equals the plain colocated
engine's; with equal TP on both sides even the acceptance counts equal the colocated speculative
engine's, so the draft KV and proposals arrived intact."""

from __future__ import annotations

import pytest

from tests.servers import assert_all_pages_free, post, start_cluster

pytest.importorskip("ucxx")

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
SPEC = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]


# equal TP sizes (1 -> 1) run in the draft-tree pairs below and in test_naive's pairs
PAIRS = [("deepseek_v3", 2, 1), ("glm4_moe", 1, 2)]


def check_pair(
    path: str,
    prompts,
    spec_kwargs: dict,
    prefill_tp: int | list[str],
    decode_tp: int | list[str],
    tmp_path,
    make_engine,
    min_accept_length: float = 0.0,
) -> None:
    """Pair with the speculative flags of `spec_kwargs` on both sides and the TP size (or the
    parallel flags) of each: its output equals the plain colocated engine's, and at equal shapes
    the acceptance per step equals the colocated speculative engine's (so the draft KV and
    proposals arrived intact); every page free after."""
    plain = make_engine(path).generate(input_ids=prompts, sampling_params=GREEDY)
    colocated = make_engine(path, **spec_kwargs)
    spec = [
        colocated.generate(input_ids=ids, sampling_params=GREEDY) for ids in prompts
    ]  # one at a time, as posted
    flags = []
    for k, v in spec_kwargs.items():
        # a switch takes no value
        flags += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    shapes = [["--tp", str(x)] if isinstance(x, int) else x for x in (prefill_tp, decode_tp)]
    cluster = start_cluster(path, tmp_path, flags + shapes[0], flags + shapes[1])
    try:
        answers = [
            post(cluster.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY})
            for ids in prompts
        ]
        for (status, body), want, colocated in zip(answers, plain, spec):
            assert status == 200, body
            assert body["output_ids"] == want.output_ids
            meta = body["meta_info"]
            assert meta["spec_accept_length"] > min_accept_length, meta
            if shapes[0] == shapes[1]:
                assert meta["spec_accepted_per_step"] == colocated.meta["spec_accepted_per_step"]
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()


def trained_draft(algorithm: str, arch: str, trained_dir, trained_eagle3) -> tuple[str, dict, dict]:
    """(target path, its training info, the Engine's draft arguments) for a trained MTP or EAGLE-3 draft."""
    if algorithm == "mtp":
        path, info = trained_dir(arch)
        return path, info, {"speculative_algorithm": "mtp"}
    target, draft, info = trained_eagle3(arch)
    return target, info, {"speculative_algorithm": "eagle3", "speculative_draft_model_path": draft}


@pytest.mark.parametrize("arch,prefill_tp,decode_tp", PAIRS)
def test_pair_with_mtp_matches_colocated(
    arch, prefill_tp, decode_tp, trained_dir, tmp_path, make_engine
):
    """A trained draft: most drafts are taken (> 1.5 tokens per verify) across the pair too."""
    path, info = trained_dir(arch)
    check_pair(
        path,
        info["prompts"][:3],
        dict(speculative_algorithm="mtp", speculative_num_steps=2),
        prefill_tp,
        decode_tp,
        tmp_path,
        make_engine,
        min_accept_length=1.5,
    )


@pytest.mark.parametrize("arch,prefill_tp,decode_tp", PAIRS)
def test_pair_with_eagle3_matches_colocated(
    arch, prefill_tp, decode_tp, trained_eagle3, tmp_path, make_engine
):
    """An MHA draft beside an MLA target (DeepSeek) or an MHA one (GLM): the draft pool travels in its
    own layout, head-sliced where the TP differs. A trained draft, one step: most drafts are taken."""
    target, draft, info = trained_eagle3(arch)
    check_pair(
        target,
        info["prompts"][:3],
        dict(
            speculative_algorithm="eagle3",
            speculative_draft_model_path=draft,
            speculative_num_steps=1,
        ),
        prefill_tp,
        decode_tp,
        tmp_path,
        make_engine,
        min_accept_length=1.5,
    )


def test_pair_with_and_without_draft_is_refused(tiny_dir, tmp_path):
    """A speculative prefill and a plain decode have different pool lists: refused at first contact
    with the difference named (400, as any incompatible pair), and nothing held after."""
    path = tiny_dir("deepseek_v3", mtp=True)
    cluster = start_cluster(path, tmp_path, SPEC, [])
    try:
        status, body = post(
            cluster.url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
        )
        assert status == 400 and "KV pools differs" in body["error"]["message"], body
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()


TREES = [("mtp", "glm4_moe", 1, 2), ("eagle3", "deepseek_v3", 1, 1)]


@pytest.mark.parametrize("algorithm,arch,prefill_tp,decode_tp", TREES)
def test_pair_with_draft_trees_matches_colocated(
    algorithm, arch, prefill_tp, decode_tp, trained_dir, trained_eagle3, tmp_path, make_engine
):
    """topk 4: the prefill's first draft tree (tokens and parents) travels with the first token and
    the decode verifies it, then grows its own; at equal TP every verify takes what the colocated
    engine's takes."""
    path, info, spec = trained_draft(algorithm, arch, trained_dir, trained_eagle3)
    spec.update(speculative_num_steps=3 if algorithm == "mtp" else 2, speculative_eagle_topk=4)
    check_pair(
        path,
        info["prompts"][:3],
        spec,
        prefill_tp,
        decode_tp,
        tmp_path,
        make_engine,
        min_accept_length=1.5,
    )
