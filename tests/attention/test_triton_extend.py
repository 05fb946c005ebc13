"""The Triton extend kernels (prompt chunks, extends over a prefix in pages, draft trees) through the
Triton backend, against the torch reference backend on the same pool and batch: MLA and MHA/GQA,
spans of many lengths in one batch, pages scattered, a draft tree's mask. On a CPU host under
TRITON_INTERPRET=1 at small shapes; on a GPU host also at DeepSeek-V3's and GLM-4.5's shapes in bf16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.triton_backend import TritonBackend  # noqa: E402
from tests import kernel_cases  # noqa: E402  (the random pools and batches, shared with the GPU check)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`
# (new tokens, context after the step, tree tail or None): a prompt, an extend over a prefix in
# pages, a decode token, a draft tree of 4 tokens over the last 5 positions, a prompt of one token
SPANS = [(37, 37, None), (20, 70, None), (1, 9, None), (4, 12, 5), (1, 1, None)]


def mla_case(heads, rank, rope, page_size, dtype, spans=SPANS):
    return kernel_cases.mla_case(
        heads, rank, rope, page_size, dtype, spans, TritonBackend, DEVICE, expect_extend=True
    )


def mha_case(heads, kv_heads, head_dim, page_size, dtype, spans=SPANS, block_g=None):
    def backend(pool, index_pool=None):
        made = TritonBackend(pool, index_pool)
        made.extend_tune["mha"]["block_g"] = block_g
        return made

    return kernel_cases.mha_case(
        heads,
        kv_heads,
        head_dim,
        page_size,
        dtype,
        spans,
        backend,
        DEVICE,
        expect_extend=True,
    )


def test_mla_spans_and_tree_match_the_reference():
    ref, ours = mla_case(heads=20, rank=32, rope=16, page_size=4, dtype=torch.float32)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 24), (4, 4, 16), (8, 1, 16)])
@pytest.mark.parametrize("block_g", [None, 1, 2], ids=["group", "head", "two-heads"])
def test_mha_gqa_spans_and_tree_match_the_reference(heads, kv_heads, head_dim, block_g):
    """A program takes every query head of its KV head, one, or two (a group of 3 then splits
    into a block of two and one of one)."""
    ref, ours = mha_case(
        heads, kv_heads, head_dim, page_size=4, dtype=torch.float32, block_g=block_g
    )
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_mha_blocks_within_pages_match_the_reference():
    """Pages of 32 tokens, blocks of 32 keys: each block reads one page id."""
    spans = [(37, 37, None), (20, 90, None), (4, 40, 5)]
    ref, ours = mha_case(6, 2, 16, page_size=32, dtype=torch.float32, spans=spans)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_empty_step_returns_no_rows():
    ref, ours = mla_case(
        heads=4, rank=32, rope=16, page_size=4, dtype=torch.float32, spans=[(0, 5, None)]
    )
    assert ours.shape == ref.shape == (0, 4, 32)


GPU_SPANS = [(700, 700, None), (300, 1500, None), (1, 90, None), (8, 200, 9)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
def test_deepseek_v3_shapes_match_the_reference():
    """128 heads, kv_lora_rank 512, rope 64, page size 64, bf16: within bf16 tolerance."""
    ref, ours = mla_case(
        heads=128, rank=512, rope=64, page_size=64, dtype=torch.bfloat16, spans=GPU_SPANS
    )
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
def test_glm45_shapes_match_the_reference():
    """GLM-4.5: 96 query heads over 8 KV heads of 128, page size 64, bf16."""
    for block_g in (None, 1):
        ref, ours = mha_case(
            96, 8, 128, page_size=64, dtype=torch.bfloat16, spans=GPU_SPANS, block_g=block_g
        )
        assert (ours - ref).abs().max() / ref.abs().max() < 2e-2
