"""The Triton KV store against `KVPool.write`: the same pages after writing scattered slots, for
MLA's latent and MHA's K and V in one launch, from strided views, with a cast to the pool's dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.triton_store import store_tokens  # noqa: E402
from dserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def pools(layout: KVLayout):
    gen = torch.Generator().manual_seed(0)
    a, b = KVPool(layout, 6, DEVICE), KVPool(layout, 6, DEVICE)
    start = torch.randn(a.pages.shape, generator=gen).to(layout.dtype)
    a.pages.copy_(start)
    b.pages.copy_(start)
    slots = torch.randperm(6 * layout.page_size, generator=gen)[:9].to(DEVICE)
    return a, b, slots, gen


def test_mla_latent_matches_pool_write():
    layout = KVLayout("mla", 2, 4, torch.float32, latent_dim=48, kv_lora_rank=32)
    ours, ref, slots, gen = pools(layout)
    latent = torch.randn(9, 64, generator=gen).to(DEVICE)[:, 8:56]  # a strided view of 48 features
    ref.write(1, 0, slots, latent)
    store_tokens(slots, [(ours.buffers[1][0], latent)])
    assert torch.equal(ours.pages, ref.pages)


def test_mha_keys_and_values_in_one_launch_match_pool_write():
    layout = KVLayout("mha", 2, 4, torch.float32, num_kv_heads=2, head_dim=24, v_head_dim=16)
    ours, ref, slots, gen = pools(layout)
    k = torch.randn(9, 2, 24, generator=gen).to(DEVICE)
    v = torch.randn(9, 4, 16, generator=gen).to(DEVICE)[:, ::2]  # not contiguous over heads
    ref.write(0, 0, slots, k)
    ref.write(0, 1, slots, v)
    store_tokens(slots, [(ours.buffers[0][0], k), (ours.buffers[0][1], v)])
    assert torch.equal(ours.pages, ref.pages)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cast to bf16 is checked on a GPU")
def test_cast_to_bf16_pool_matches_pool_write():
    layout = KVLayout("mla", 1, 64, torch.bfloat16, latent_dim=576, kv_lora_rank=512)
    ours, ref, slots, gen = pools(layout)
    latent = torch.randn(9, 576, generator=gen).to(DEVICE)  # float32 rows into a bf16 pool
    ref.write(0, 0, slots, latent)
    store_tokens(slots, [(ours.buffers[0][0], latent)])
    assert torch.equal(ours.pages, ref.pages)
