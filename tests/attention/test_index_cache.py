"""The sparse-attention indexer pool in FP8 (`indexer_cache_dtype="fp8"`): per token the key in
e4m3 with a float32 scale (132 bytes at head dim 128), within e4m3's rounding of the key; the
selection it gives differs from the exact cache's only between positions whose exact scores lie
within that rounding of each other; an engine serves with it."""

from __future__ import annotations

import torch

from dserve.attention.backend import ForwardBatch
from dserve.attention.index_cache import read_keys, write_keys
from dserve.attention.torch_backend import TorchBackend
from dserve.memory.kv_pool import KVLayout, KVPool
from tests.conftest import random_prompts

E4M3_STEP = 2**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_TINY = 2**-9  # e4m3's smallest subnormal, over its scale


def index_pool(fp8: bool, head_dim: int, pages: int = 8, page_size: int = 16) -> KVPool:
    dtype = torch.uint8 if fp8 else torch.float32
    return KVPool(KVLayout("index", 1, page_size, dtype, latent_dim=head_dim), pages, "cpu")


def test_fp8_rows_hold_each_key_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(40, 128, generator=gen) * torch.rand(40, 1, generator=gen) * 10
    pool = index_pool(True, 128)
    assert pool.layout.bytes_per_token == 132
    slots = torch.randperm(128, generator=gen)[:40]
    write_keys(pool, 0, slots, keys)
    back = read_keys(pool, 0, slots)
    scale = keys.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    bound = E4M3_STEP * keys.abs() + E4M3_TINY * scale
    assert ((back - keys).abs() <= bound).all()


def test_fp8_pages_hold_their_keys_then_their_scales():
    """The production layout (DeepGEMM's paged MQA logits read it so): in a page of a layer,
    the FP8 bytes of its keys back to back, then their float32 scales; a key row starts at a
    multiple of its width, 16-byte aligned at head dim 128."""
    gen = torch.Generator().manual_seed(2)
    page_size, dim, layers = 4, 128, 2
    pool = KVPool(KVLayout("index", layers, page_size, torch.uint8, latent_dim=dim), 3, "cpu")
    keys = torch.randn(page_size, dim, generator=gen)
    slots = torch.arange(page_size) + page_size  # page 1
    write_keys(pool, 1, slots, keys)
    page = pool.pages[1]
    layer = page[page.numel() // layers :]  # layer 1 of the page
    scale = keys.abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max
    q = (keys / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(layer[: page_size * dim].view(page_size, dim), q)
    assert torch.equal(layer[page_size * dim :].view(torch.float32), scale)
    assert pool.buffers[1][0].data_ptr() % 16 == 0 and pool.buffers[1][0].stride(1) == dim


def test_fp8_selection_differs_only_between_near_ties():
    gen = torch.Generator().manual_seed(1)
    heads, dim, topk, n = 8, 32, 6, 40
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, dim, generator=gen)
    weights = torch.randn(n, heads, generator=gen)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.arange(n),
        q_lens=[n],
        seq_lens=[n],
        page_table=torch.arange(3)[None],
        out_slots=torch.arange(n),
        logits_rows=torch.tensor([n - 1]),
    )
    chosen = {}
    for fp8 in (False, True):
        backend = TorchBackend(index_pool(fp8, dim, pages=3), index_pool(fp8, dim, pages=3))
        backend.plan(batch)
        chosen[fp8] = backend.forward_indexer(0, q, k, weights, dim**-0.5, topk)
    # the exact scores and how far FP8 keys can move each (ReLU is 1-Lipschitz)
    exact = torch.relu(torch.einsum("qhd,kd->qhk", q, k) * dim**-0.5)
    exact = torch.einsum("qh,qhk->qk", weights, exact)
    exact = exact.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    written = index_pool(True, dim, pages=3)
    write_keys(written, 0, torch.arange(n), k)
    key_error = (read_keys(written, 0, torch.arange(n)) - k).norm(dim=-1).max()
    row_error = dim**-0.5 * (weights.abs()[:, :, None] * q.norm(dim=-1, keepdim=True)).sum((1, 2))
    swaps = 0
    for row in range(n):
        exact_set = set(chosen[False][row].tolist())
        for position in set(chosen[True][row].tolist()) - exact_set:
            kth = exact[row].topk(min(topk, row + 1)).values[-1]
            assert exact[row, position] >= kth - 2 * row_error[row] * key_error, (row, position)
            swaps += 1
    assert swaps < n * topk // 4, "FP8 keys change a few selections, not most"


def test_engine_serves_with_the_fp8_indexer_cache(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("glm_moe_dsa"), indexer_cache_dtype="fp8")
    pool = engine.executor.runner.index_pool
    assert pool.pages.dtype == torch.uint8
    assert pool.layout.bytes_per_token == 2 * (32 + 4)  # two indexer layers, head dim 32
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = random_prompts(2, 512, [12, 30], seed=3)
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert [len(r.output_ids) for r in results] == [6, 6]
