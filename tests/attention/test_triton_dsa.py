"""Sparse attention's Triton kernels against torch: the indexer's scores over paged keys (ragged
contexts, pages scattered), MLA decode over each row's selected positions (`selected=`), and
an engine with the triton backend on a GLM-5-shaped tiny model giving the reference tokens. On
a CPU host under TRITON_INTERPRET=1 at small shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.index_cache import key_scales, read_keys, write_keys  # noqa: E402
from dserve.attention.triton_dsa import indexer_scores  # noqa: E402
from dserve.attention.triton_mla import mla_decode  # noqa: E402
from dserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402
from tests.attention.test_triton_mla import case  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


@pytest.mark.parametrize("fp8", [False, True], ids=["keys", "fp8-keys"])
def test_indexer_scores_match_torch(fp8):
    """Over an indexer pool's pages (FP8: a page's keys, then their scales)."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, page_size, lens = 16, 32, 4, [1, 9, 23, 40]
    dtype = torch.uint8 if fp8 else torch.float32
    pool = KVPool(KVLayout("index", 1, page_size, dtype, latent_dim=dim), 40, DEVICE)
    every = torch.arange(40 * page_size, device=DEVICE)
    write_keys(pool, 0, every, torch.randn(40 * page_size, dim, generator=gen).to(DEVICE))
    keys = read_keys(pool, 0, every).cpu().view(40, page_size, dim)  # FP8: widened, exactly
    buffers = pool.buffers[0]
    scales = key_scales(buffers[1]) if fp8 else None
    table = torch.randperm(40, generator=gen).view(4, 10).to(torch.int32)
    q = torch.randn(4, heads, dim, generator=gen)
    w = torch.randn(4, heads, generator=gen)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    ctx = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(4, dtype=torch.int32)
    got = indexer_scores(
        to(q), to(w), buffers[0], to(table), to(rows), to(ctx), 0.2, 40, key_scales=scales
    ).cpu()
    for t, n in enumerate(lens):
        pos = torch.arange(n)
        k = keys[table[t, pos // page_size].long(), pos % page_size]
        want = (w[t][:, None] * torch.relu(q[t] @ k.T * 0.2)).sum(0)
        torch.testing.assert_close(got[t, :n], want, rtol=1e-5, atol=1e-5)
        assert torch.isinf(got[t, n:]).all()


@pytest.mark.parametrize("launch", [{}, {"both_halves": True, "block_v": 16}])
def test_mla_decode_over_selected_positions_matches_torch(launch):
    """Also with both halves of the value columns in one program (a GPU's default from 8 rows
    on)."""
    q_latent, q_rope, cache, table, lens = case(
        heads=20, rank=32, rope=16, page_size=4, seq_lens=[5, 16, 37], dtype=torch.float32,
        device=DEVICE,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    selected = torch.full((3, 6), -1, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        picks = torch.randperm(n, generator=gen)[:6]
        selected[b, : len(picks)] = picks
        selected[b] = selected[b, torch.randperm(6, generator=gen)]  # -1 anywhere
    got = mla_decode(
        q_latent,
        q_rope,
        cache,
        table,
        None,
        0.3,
        max_len=6,
        selected=selected.to(DEVICE),
        **launch,
    )
    for b in range(3):
        pos = selected[b][selected[b] >= 0].to(DEVICE)
        ctx = cache[table[b, pos // 4].long(), pos % 4].float()
        scores = (q_latent[b] @ ctx[:, :32].T + q_rope[b] @ ctx[:, 32:].T) * 0.3
        want = scores.softmax(-1) @ ctx[:, :32]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GLM-5's shapes run on a GPU")
@pytest.mark.parametrize("rows", [3, 12])
def test_glm5_sparse_mla_matches_torch(rows):
    """64 heads, latent 512 + 64, page size 64, bf16, each row over 2048 selected positions of
    its context (fewer where the context is shorter, -1 anywhere): the default launch for few
    rows and for many (both halves of the value columns in one program)."""
    lens = [4096, 2100, 900, 3000, 1, 2048, 4000, 64, 2500, 3333, 1500, 4095][:rows]
    q_latent, q_rope, cache, table, _ = case(
        heads=64, rank=512, rope=64, page_size=64, seq_lens=lens, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    selected = torch.full((rows, 2048), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        picks = torch.randperm(n, generator=gen)[:2048]
        selected[b, : len(picks)] = picks
        selected[b] = selected[b, torch.randperm(2048, generator=gen)]
    scale = 192**-0.5
    got = mla_decode(
        q_latent, q_rope, cache, table.long(), None, scale, max_len=2048,
        selected=selected.cuda(),
    ).float()  # fmt: skip
    for b in range(rows):
        pos = selected[b][selected[b] >= 0].cuda()
        ctx = cache[table[b, pos // 64].long(), pos % 64].float()
        scores = q_latent[b].float() @ ctx[:, :512].T + q_rope[b].float() @ ctx[:, 512:].T
        want = (scores * scale).softmax(-1) @ ctx[:, :512]
        assert (got[b] - want).abs().max() / want.abs().max() < 2e-2


def test_engine_with_the_triton_backend_gives_the_reference_tokens(tiny_dir, make_engine):
    path = tiny_dir("glm_moe_dsa")
    kwargs = dict(dtype="float32", device=DEVICE, page_size=4, chunked_prefill_size=16)
    kwargs.update(max_total_tokens=4096)  # a pool of its own size: workers share the GPU
    engine = make_engine(path, attention_backend="triton", **kwargs)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = random_prompts(2, 512, [9, 30], seed=21)
    for prompt, result in zip(prompts, engine.generate(input_ids=prompts, sampling_params=params)):
        assert result.output_ids == hf_greedy(path, prompt, 6)


def test_triton_backend_with_fp8_indexer_keys_selects_as_torch(tiny_dir, make_engine):
    """The production layout of the indexer cache on the triton backend: the same tokens as
    the torch backend reading the same FP8 keys (float32, where the two differ only in the
    order of their float sums)."""
    path = tiny_dir("glm_moe_dsa")
    kwargs = dict(dtype="float32", page_size=4, chunked_prefill_size=16)
    kwargs.update(indexer_cache_dtype="fp8", max_total_tokens=4096)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = random_prompts(2, 512, [9, 30], seed=22)
    tokens = []
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        engine = make_engine(path, attention_backend=backend, device=device, **kwargs)
        results = engine.generate(input_ids=prompts, sampling_params=params)
        tokens.append([r.output_ids for r in results])
    assert tokens[0] == tokens[1]
