"""The Triton extend kernels (prompt chunks, extends over a prefix in pages, draft trees) through the
Triton backend, against the torch reference backend on the same pool and batch: MLA and MHA/GQA,
spans of many lengths in one batch, pages scattered, a draft tree's mask. On a CPU host under
TRITON_INTERPRET=1 at small shapes; on a GPU host also at DeepSeek-V3's and GLM-4.5's shapes in bf16."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.backend import ForwardBatch  # noqa: E402
from dserve.attention.torch_backend import TorchBackend  # noqa: E402
from dserve.attention.triton_backend import TritonBackend  # noqa: E402
from dserve.scheduler.kv_pool import KVLayout, KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (new tokens, context after the step, tree tail or None): a prompt, an extend over a prefix in
# pages, a decode token, a draft tree of 4 tokens over the last 5 positions, a prompt of one token
SPANS = [(37, 37, None), (20, 70, None), (1, 9, None), (4, 12, 5), (1, 1, None)]


def tree_mask(q_len: int, tail: int, gen) -> torch.Tensor:
    """Every token sees the tail's first position (the last accepted token) and itself; others at random."""
    mask = torch.rand(q_len, tail, generator=gen) < 0.5
    mask[:, 0] = True
    mask[torch.arange(q_len), tail - q_len + torch.arange(q_len)] = True
    return mask


def batch_over(pool: KVPool, spans, gen) -> ForwardBatch:
    ps = pool.layout.page_size
    pages = [(seq_len + ps - 1) // ps for _, seq_len, _ in spans]
    order = torch.randperm(pool.num_pages, generator=gen)[:sum(pages)]
    table = torch.zeros(len(spans), max(pages), dtype=torch.int64)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used:used + n]
        used += n
    slots, positions = [], []
    for i, (q_len, seq_len, _) in enumerate(spans):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[i, pos // ps] * ps + pos % ps)
        positions.append(pos)
    tokens = sum(q for q, _, _ in spans)
    masks = [None if tail is None else tree_mask(q_len, tail, gen) for q_len, _, tail in spans]
    batch = ForwardBatch(torch.zeros(tokens, dtype=torch.int64), torch.cat(positions), [q for q, _, _ in spans],
                         [s for _, s, _ in spans], table, torch.cat(slots), torch.arange(tokens),
                         tree_masks=masks)
    return batch.to(torch.device(DEVICE))


def run_both(pool, batch, forward, backend_class=TritonBackend):
    """The reference's output and `backend_class`'s, on the same pool and batch."""
    outs = []
    for backend in (TorchBackend(pool), backend_class(pool)):
        backend.plan(batch)
        assert not getattr(backend, "decode", False), "the batch must take the extend path"
        outs.append(forward(backend).float())
    return outs


def pages_for(spans, page_size: int) -> int:
    """A pool with room for the spans' pages to be scattered over (at least 64 pages)."""
    return max(64, 2 * sum(-(-seq_len // page_size) for _, seq_len, _ in spans))


def mla_case(heads, rank, rope, page_size, dtype, spans=SPANS, backend_class=TritonBackend):
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout("mla", 1, page_size, dtype, latent_dim=rank + rope, kv_lora_rank=rank)
    pool = KVPool(layout, pages_for(spans, page_size), DEVICE)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batch = batch_over(pool, spans, gen)
    tokens = batch.num_tokens
    q_latent, q_rope, latent = (torch.randn(*shape, generator=gen).to(DEVICE, dtype)
                                for shape in ((tokens, heads, rank), (tokens, heads, rope), (tokens, rank + rope)))
    return run_both(pool, batch, lambda b: b.forward_mla(0, q_latent, q_rope, latent, (rank + rope) ** -0.5),
                    backend_class)


def mha_case(heads, kv_heads, head_dim, page_size, dtype, spans=SPANS, backend_class=TritonBackend):
    gen = torch.Generator().manual_seed(1)
    layout = KVLayout("mha", 1, page_size, dtype, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim)
    pool = KVPool(layout, pages_for(spans, page_size), DEVICE)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batch = batch_over(pool, spans, gen)
    tokens = batch.num_tokens
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(DEVICE, dtype)
               for h in (heads, kv_heads, kv_heads))
    return run_both(pool, batch, lambda b: b.forward_mha(0, q, k, v, head_dim ** -0.5), backend_class)


def test_mla_spans_and_tree_match_the_reference():
    ref, ours = mla_case(heads=20, rank=32, rope=16, page_size=4, dtype=torch.float32)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 24), (4, 4, 16), (8, 1, 16)])
def test_mha_gqa_spans_and_tree_match_the_reference(heads, kv_heads, head_dim):
    ref, ours = mha_case(heads, kv_heads, head_dim, page_size=4, dtype=torch.float32)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_empty_step_returns_no_rows():
    ref, ours = mla_case(heads=4, rank=32, rope=16, page_size=4, dtype=torch.float32, spans=[(0, 5, None)])
    assert ours.shape == ref.shape == (0, 4, 32)


GPU_SPANS = [(700, 700, None), (300, 1500, None), (1, 90, None), (8, 200, 9)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
def test_deepseek_v3_shapes_match_the_reference():
    """128 heads, kv_lora_rank 512, rope 64, page size 64, bf16: within bf16 tolerance."""
    ref, ours = mla_case(heads=128, rank=512, rope=64, page_size=64, dtype=torch.bfloat16, spans=GPU_SPANS)
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
def test_glm45_shapes_match_the_reference():
    """GLM-4.5: 96 query heads over 8 KV heads of 128, page size 64, bf16."""
    ref, ours = mha_case(heads=96, kv_heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16, spans=GPU_SPANS)
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2
