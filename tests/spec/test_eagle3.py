"""EAGLE-3 speculative decoding, colocated: the target hands the draft the outputs of the configured
layers (as transformers' own hidden states say they are), the draft layer computes what transformers'
Llama attention and MLP compute when wired the EAGLE-3 way, and speculation changes no output while
target and draft pools (MLA + MHA for DeepSeek) stay accounted for."""

from __future__ import annotations

import pytest
import torch

from dserve.scheduler.kv_manager import KVCacheManager
from dserve.step.batch import Seq, assemble, assemble_draft, table_rows
from tests.reference import relative_error
from tests.spec.test_mtp import (
    CHUNKED,
    assert_drafting_changes_no_output,
    checkpoint_tensors,
    prompts,
)

ARCHES = ("deepseek_v3", "glm4_moe")


def eagle3_engine(make_engine, target: str, draft: str, **kwargs):
    return make_engine(
        target, speculative_algorithm="eagle3", speculative_draft_model_path=draft, **kwargs
    )


@torch.no_grad()
def reference_draft_logits(
    draft: str, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor
) -> torch.Tensor:
    """The EAGLE-3 layer written with transformers' LlamaAttention (its q/k/v read 2 * hidden, its
    o_proj writes hidden), LlamaMLP and rotary embedding (the module bench/train_eagle3.py trains);
    logits over the draft vocabulary."""
    from tests.drafts import Eagle3Head

    return Eagle3Head.from_checkpoint(draft)(embed[tokens][None], aux[None])[0]


@pytest.mark.parametrize("arch", ARCHES)
def test_target_hands_over_the_configured_layer_outputs(arch, eagle3_dir, make_engine):
    """Our aux states are transformers' hidden states at the configured layers (-1: the embedding)."""
    import transformers

    target, draft = eagle3_dir(arch)
    engine = eagle3_engine(make_engine, target, draft)
    runner = engine.executor.runner
    ids = prompts(2)[1]
    kv = KVCacheManager(runner.num_pages, runner.pool.layout.page_size)
    assert kv.allocate_slots("r", len(ids))
    rows = table_rows(kv.tables, ["r"])
    runner.forward(assemble([Seq("r", 0, ids, [len(ids) - 1])], rows, kv.page_size))  # a prompt
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i + 1][0] for i in runner.aux_layers], dim=-1)
    assert runner.last_hidden.shape == want.shape
    assert relative_error(runner.last_hidden, want) < 1e-4


@pytest.mark.parametrize("arch", ARCHES)
def test_draft_layer_matches_transformers(arch, eagle3_dir, make_engine):
    target, draft = eagle3_dir(arch)
    engine = eagle3_engine(make_engine, target, draft)
    runner = engine.executor.runner
    assert runner.draft_pool.layout.kind == "mha"  # on an MLA target too
    gen = torch.Generator().manual_seed(0)
    T, h = 21, engine.model_config.hidden_size
    tokens = torch.randint(0, engine.model_config.vocab_size, (T,), generator=gen)
    aux = torch.randn(T, 3 * h, generator=gen)
    kv = KVCacheManager(runner.num_pages, runner.draft_pool.layout.page_size)
    assert kv.allocate_slots("r", T)
    runner.last_hidden = aux
    seq = Seq("r", 0, tokens.tolist(), list(range(T)), list(range(T)))
    ours = runner.forward(assemble_draft([seq], table_rows(kv.tables, ["r"]), kv.page_size))
    embed = runner.model.embed_tokens.weight
    ref = reference_draft_logits(draft, embed, tokens, aux)
    hot = torch.arange(ref.shape[-1]) + checkpoint_tensors(draft, "")["d2t"]
    assert relative_error(ours[:, hot], ref) < 1e-4
    others = torch.ones(ours.shape[-1], dtype=torch.bool)
    others[hot] = False
    assert torch.isneginf(ours[:, others]).all()  # a draft proposes only tokens of its vocabulary


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("steps,topk", [(1, 1), (3, 1), (3, 4)])
def test_speculation_changes_no_output(arch, steps, topk, eagle3_dir, make_engine):
    """As for MTP (`MIXED`): every page of both pools back at the end."""
    target, draft = eagle3_dir(arch)
    engine = eagle3_engine(
        make_engine,
        target,
        draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        **CHUNKED,
    )
    assert_drafting_changes_no_output(make_engine, target, engine)


def test_bad_draft_is_refused(eagle3_dir, tiny_dir, make_engine):
    from dserve.runtime.config import EngineConfig

    target, draft = eagle3_dir("deepseek_v3")
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        EngineConfig(target, speculative_algorithm="eagle3")
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        eagle3_engine(make_engine, target, target)  # a target checkpoint is no EAGLE-3 draft
