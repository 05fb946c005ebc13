"""MLA in its expanded form (prompt-sized passes: per-head keys and values decompressed from the
latents, `attention/mla_expanded.py`): the same attention output as the absorbed form over the
same pool and batch, and the reference tokens through the engine (forced on every pass with
`mla_expand_min_tokens=1`), chunked prompts over a cached prefix and TP 2 included."""

from __future__ import annotations

import pytest
import torch

from dserve.attention.backend import ForwardBatch
from dserve.attention.torch_backend import TorchBackend
from dserve.memory.kv_pool import KVLayout, KVPool
from tests.conftest import random_prompts
from tests.reference import hf_greedy

PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_expanded_equals_absorbed_attention():
    """Two spans, a chunk over a prefix already in the pages and a whole prompt: the expanded
    output through W_UV equals the absorbed latents taken out through W_UV."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank, page = 4, 16, 8, 12, 32, 4
    layout = KVLayout("mla", 1, page, torch.float32, latent_dim=rank + rope, kv_lora_rank=rank)
    pool = KVPool(layout, 32, "cpu")
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen))
    batch = _batch([(5, 21), (9, 9)], page, gen)
    t = batch.num_tokens
    q_nope = torch.randn(t, heads, nope, generator=gen)
    q_rope = torch.randn(t, heads, rope, generator=gen)
    latent = torch.randn(t, rank + rope, generator=gen)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / rank**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / rank**0.5
    scale = (nope + rope) ** -0.5
    backend = TorchBackend(pool)
    backend.plan(batch)
    expanded = backend.forward_mla_expanded(0, q_nope, q_rope, latent, w_uk, w_uv, scale)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    absorbed = backend.forward_mla(0, q_latent, q_rope, latent, scale)
    torch.testing.assert_close(expanded, torch.einsum("thr,hvr->thv", absorbed, w_uv))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_engine_tokens_with_every_pass_expanded(arch, tiny_dir, make_engine):
    path = tiny_dir(arch)
    engine = make_engine(path, mla_expand_min_tokens=1, chunked_prefill_size=16)
    prompts = random_prompts(3, 512, [9, 40, 71], seed=11)
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 6)
    again = engine.generate(input_ids=prompts[1], sampling_params=PARAMS)  # a prefix hit
    assert again.output_ids == results[1].output_ids
    assert again.meta["cached_tokens"] > 0


@pytest.mark.slow
def test_expanded_under_tensor_parallelism(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, mla_expand_min_tokens=1, tp_size=2)
    prompt = random_prompts(1, 512, [33], seed=12)[0]
    result = engine.generate(input_ids=prompt, sampling_params=PARAMS)
    assert result.output_ids == hf_greedy(path, prompt, 6)


def _batch(spans: list[tuple[int, int]], page: int, gen) -> ForwardBatch:
    """Spans of (new tokens, context after the step) over scattered pages of a 32-page pool,
    each span's new tokens in its last positions."""
    order = torch.randperm(32, generator=gen)
    table = torch.zeros(len(spans), 8, dtype=torch.int64)
    slots, positions, used = [], [], 0
    for i, (q_len, seq_len) in enumerate(spans):
        n = -(-seq_len // page)
        table[i, :n] = order[used : used + n]
        used += n
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[i, pos // page] * page + pos % page)
        positions.append(pos)
    tokens = sum(q for q, _ in spans)
    q_lens, seq_lens = [q for q, _ in spans], [s for _, s in spans]
    ids = torch.zeros(tokens, dtype=torch.int64)
    return ForwardBatch(
        ids, torch.cat(positions), q_lens, seq_lens, table, torch.cat(slots), torch.arange(tokens)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_expanded_on_a_gpu_gives_the_reference_tokens(tiny_dir, make_engine):
    """PyTorch's fused attention on the GPU (float32, the triton backend), every pass expanded."""
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, device="cuda", dtype="float32", mla_expand_min_tokens=1)
    prompts = random_prompts(2, 512, [40, 90], seed=13)
    for prompt, result in zip(prompts, engine.generate(input_ids=prompts, sampling_params=PARAMS)):
        assert result.output_ids == hf_greedy(path, prompt, 6)
