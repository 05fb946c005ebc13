"""MTP speculative decoding, colocated: the NextN draft computes what the published layer computes
(transformers' own decoder layer of that index, loaded from the checkpoint, between the NextN
projections), and speculation changes no request's output while its pages stay accounted for."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from dserve.scheduler.kv_manager import KVCacheManager
from dserve.step.batch import Seq, assemble_draft, table_rows
from tests.reference import relative_error

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
MTP_ARCHES = ("deepseek_v3", "glm4_moe")


def checkpoint_tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    import glob

    out = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        with safe_open(file, "pt") as f:
            names = [k for k in f.keys() if k.startswith(prefix)]  # noqa: SIM118 - not iterable
            out.update({k[len(prefix) :]: f.get_tensor(k) for k in names})
    return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_draft_logits(path: str, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' decoder layer `num_hidden_layers` (the MTP layer's own weights, loaded by
    from_pretrained with one more layer) between the NextN projections, written out in torch."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    n = cfg.num_hidden_layers
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, num_hidden_layers=n + 1, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    w = checkpoint_tensors(path, f"model.layers.{n}.")
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight)
    eps = cfg.rms_norm_eps
    x = torch.cat(
        [rms(embed[tokens], w["enorm.weight"], eps), rms(hidden, w["hnorm.weight"], eps)], -1
    )
    x = x @ w["eh_proj.weight"].T
    pos = torch.arange(len(tokens))[None]
    cos_sin = hf.model.rotary_emb(x[None], pos)
    y = hf.model.layers[n](x[None], position_ids=pos, position_embeddings=cos_sin)
    y = (y[0] if isinstance(y, tuple) else y)[0]
    return rms(y, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T


@pytest.mark.parametrize("arch", MTP_ARCHES)
def test_draft_layer_matches_transformers(arch, tiny_dir, make_engine):
    path = tiny_dir(arch, mtp=True)
    engine = make_engine(path, speculative_algorithm="mtp")
    runner = engine.executor.runner
    gen = torch.Generator().manual_seed(0)
    T = 21
    tokens = torch.randint(0, engine.model_config.vocab_size, (T,), generator=gen)
    hidden = torch.randn(T, engine.model_config.hidden_size, generator=gen)
    kv = KVCacheManager(runner.num_pages, runner.draft_pool.layout.page_size)
    assert kv.allocate_slots("r", T)
    runner.last_hidden = hidden
    seq = Seq("r", 0, tokens.tolist(), list(range(T)), list(range(T)))
    batch = assemble_draft([seq], table_rows(kv.tables, ["r"]), kv.page_size)
    ours = runner.forward(batch)
    ref = reference_draft_logits(path, tokens, hidden)
    assert relative_error(ours, ref) < 1e-4


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for length in (5, 20, 37, 70)[:n]]


# three greedy requests that draft and a seeded sampling one with logprobs (which does not),
# in one batch; chunked prefill so the draft catches up over prompt chunks too, small pages
MIXED = [GREEDY] * 3 + [
    {
        "temperature": 0.8,
        "seed": 7,
        "max_new_tokens": 24,
        "ignore_eos": True,
        "return_logprob": True,
    }
]
CHUNKED = dict(chunked_prefill_size=16, page_size=4)


def assert_drafting_changes_no_output(make_engine, target: str, engine) -> list:
    """`engine` (speculating, with `CHUNKED`) answers `MIXED` as the target alone does, every
    drafting request verified drafts, and every page of its pools is back at the end (the
    fixture checks the invariants after each step too). Returns its results."""
    plain = make_engine(target, **CHUNKED)
    expected = plain.generate(input_ids=prompts(4), sampling_params=MIXED)
    got = engine.generate(input_ids=prompts(4), sampling_params=MIXED)
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    assert all(g.meta["spec_verify_ct"] >= 1 for g in got[:3])
    engine.check_invariants()
    assert all(not g.kv.tables for g in engine.groups)
    return got


@pytest.mark.parametrize("arch", MTP_ARCHES)
@pytest.mark.parametrize("steps,topk", [(1, 1), (3, 1), (3, 4)])
def test_speculation_changes_no_output(arch, steps, topk, tiny_dir, make_engine):
    """`MIXED` with and without MTP. Random weights: most drafts are rejected, so pages come
    and go every step."""
    path = tiny_dir(arch, mtp=True)
    engine = make_engine(
        path,
        speculative_algorithm="mtp",
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        **CHUNKED,
    )
    got = assert_drafting_changes_no_output(make_engine, path, engine)
    for g in got[:3]:
        assert g.meta["spec_accept_length"] >= 1
        assert g.meta["spec_verify_ct"] <= len(g.output_ids)
    assert "spec_verify_ct" not in got[3].meta  # requests with logprobs decode without drafts


def oracle_drafts(engine, answer: list[int], steps: int = 3) -> None:
    """Replace the engine's draft passes by the known answer (prompt + greedy output): every verify
    then takes all `steps` drafts."""
    oracle = answer + [0] * 2 * steps

    def chain(req):
        return oracle[req.num_tokens : req.num_tokens + steps], list(range(-1, steps - 1))

    replace_drafts(engine, chain)


def replace_drafts(engine, drafts_for) -> None:
    """The trees the front keeps for the next verify become `drafts_for(req)` -> (tokens,
    parents) instead of the draft's proposals (which still run on the ranks)."""
    settle = engine.speculation.settle

    def settled(span, outcome):
        settle(span, outcome)
        if not span.req.finished:
            span.req.draft_tokens, span.req.draft_parents = drafts_for(span.req)

    engine.speculation.settle = settled


def test_drafts_that_the_target_agrees_with_are_all_taken(tiny_dir, make_engine):
    """A draft that proposes exactly the target's greedy continuation: every verify takes all
    drafts, so k drafts per step yield k + 1 tokens, and the output is still the target's own."""
    path = tiny_dir("deepseek_v3", mtp=True)
    ids = prompts(1)[0]
    expected = make_engine(path).generate(input_ids=[ids], sampling_params=GREEDY)[0].output_ids
    engine = make_engine(path, speculative_algorithm="mtp", speculative_num_steps=3)
    oracle_drafts(engine, ids + expected)
    got = engine.generate(input_ids=[ids], sampling_params=GREEDY)[0]
    assert got.output_ids == expected
    # 4 tokens per verify, bar the last one's cut at max_new_tokens
    assert got.meta["spec_accept_length"] > 3.5
    assert got.meta["spec_verify_ct"] == 6  # 1 + 6 * 4 >= 24 tokens


def test_verified_tokens_reach_the_prefix_cache(tiny_dir, make_engine):
    """Pages filled by accepted drafts are published to the prefix cache with their true token ids:
    a follow-up prompt that repeats the conversation hits as many cached tokens as after plain
    decoding (before, a page was hashed before its accepted ids were appended, and missed)."""
    path = tiny_dir("deepseek_v3", mtp=True)
    ids = prompts(1)[0]
    one_more = {**GREEDY, "max_new_tokens": 1}
    plain = make_engine(path, page_size=4)
    expected = plain.generate(input_ids=[ids], sampling_params=GREEDY)[0].output_ids
    again = ids + expected[:-1]  # the last token's KV was never computed
    cached = [plain.generate(input_ids=[again], sampling_params=one_more)[0].meta["cached_tokens"]]
    engine = make_engine(path, page_size=4, speculative_algorithm="mtp", speculative_num_steps=3)
    oracle_drafts(engine, ids + expected)  # every verify fills pages with accepted drafts
    assert engine.generate(input_ids=[ids], sampling_params=GREEDY)[0].output_ids == expected
    cached.append(
        engine.generate(input_ids=[again], sampling_params=one_more)[0].meta["cached_tokens"]
    )
    # every full page but the one of the last prompt token
    assert cached[0] == (len(again) - 1) // 4 * 4
    assert cached[1] == cached[0]


def test_bad_speculative_settings_are_refused(tiny_dir, make_engine):
    from dserve.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineConfig(
            "x",
            speculative_algorithm="mtp",
            speculative_num_steps=2,
            speculative_num_draft_tokens=5,
        )
    # 4 root children at most
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[2, 5\]"):
        EngineConfig(
            "x",
            speculative_algorithm="mtp",
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=6,
        )
    with pytest.raises(ValueError, match="topk must be >= 1"):
        EngineConfig("x", speculative_algorithm="mtp", speculative_eagle_topk=0)
    with pytest.raises(ValueError, match="must be mtp or eagle3"):
        EngineConfig("x", speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="no model.layers.3"):
        make_engine(tiny_dir("deepseek_v3"), speculative_algorithm="mtp")


def test_served_with_mtp(tiny_dir, tmp_path, make_engine):
    """`dserve serve --speculative-algorithm mtp`: the HTTP answer equals the plain engine's, carries
    the acceptance figures in meta_info, and /metrics counts drafts and accepted tokens per position."""
    from tests.servers import assert_all_pages_free, get, post, start_instance, stream

    path = tiny_dir("glm4_moe", mtp=True)
    ids = prompts(2)
    expected = make_engine(path).generate(input_ids=ids, sampling_params=GREEDY)
    server = start_instance(
        "serve", path, tmp_path, "--speculative-algorithm", "mtp", "--speculative-num-steps", "2"
    ).wait_ready()
    try:
        for prompt, want in zip(ids, expected):
            status, body = post(
                server.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY}
            )
            assert status == 200, body
            assert body["output_ids"] == want.output_ids
            assert body["meta_info"]["spec_verify_ct"] >= 1
        events = stream(server.url + "/generate", {"input_ids": ids[0], "sampling_params": GREEDY})
        assert events[-1]["output_ids"] == expected[0].output_ids  # several tokens a step
        status, text = get(server.url + "/metrics")
        assert status == 200
        assert 'dserve_spec_draft_tokens_total{position="1"}' in text
        assert 'dserve_spec_verify_steps_total{algorithm="mtp"}' in text
        assert_all_pages_free(server)
    finally:
        server.stop()
