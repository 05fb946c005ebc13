"""The Gluon indexer scores over FP8 keys (`attention/gluon_indexer.py`) against torch over the
widened keys and against the Triton kernel: ragged and empty contexts, contexts shorter than the
scores' width (-inf, unread), scattered pages of 64 and 128, programs of a few blocks, the
engine's int64 tables and lengths, rows sharing a sequence. On a Hopper GPU; on a CPU host, the
rule that picks it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dserve.attention import gluon_indexer  # noqa: E402
from dserve.attention.index_cache import key_scales, read_keys, write_keys  # noqa: E402
from dserve.attention.triton_dsa import indexer_scores  # noqa: E402
from dserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_served_shapes():
    """Only FP8 keys (bf16 ones take the Triton kernel, exact), head dim 128, whole blocks of
    64 in a page, on Hopper."""
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    keys = torch.zeros(4, 64, 128, dtype=torch.uint8)
    scales = torch.zeros(4, 64)
    assert not gluon_indexer.supported(q, keys, scales)  # a CPU tensor
    if HOPPER:
        q, keys, scales = q.cuda(), keys.cuda(), scales.cuda()
        assert gluon_indexer.supported(q, keys, scales)
        assert not gluon_indexer.supported(q, keys, None)
        assert not gluon_indexer.supported(q, keys.view(4, 32, 256)[:, :, :128], scales)
        assert not gluon_indexer.supported(q.float(), keys, scales)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="Gluon's kernel is Hopper's")
@pytest.mark.parametrize("q_fp8", [False, True])
@pytest.mark.parametrize(
    "heads,page_size,per_program", [(32, 64, 128), (64, 128, None), (16, 64, 64)]
)
def test_scores_match_torch_and_triton(heads, page_size, per_program, q_fp8):
    """16-bit queries: equal to torch's and the Triton kernel's within float32 rounding. FP8
    queries (`q_fp8`): equal to torch's over the same e4m3 queries (`fp8_queries`), and near
    the 16-bit ones."""
    gen = torch.Generator().manual_seed(heads + page_size)
    pages, width = 64, 1000
    pool = KVPool(KVLayout("index", 1, page_size, torch.uint8, latent_dim=128), pages, "cuda")
    every = torch.arange(pages * page_size, device="cuda")
    write_keys(pool, 0, every, torch.randn(pages * page_size, 128, generator=gen).cuda())
    keys = read_keys(pool, 0, every).view(pages, page_size, 128)  # widened, exactly
    buffers = pool.buffers[0]
    scales = key_scales(buffers[1])
    per_row = pages // 4
    table = torch.randperm(pages, generator=gen).view(4, per_row).cuda()  # int64, as the engine's
    lens = torch.tensor([1000, 0, 65, 700, 999], device="cuda")
    rows = torch.tensor([0, 1, 2, 3, 0], device="cuda")  # the last token: the first's sequence
    q = torch.randn(5, heads, 128, generator=gen).cuda().to(torch.bfloat16)
    w = torch.randn(5, heads, generator=gen).cuda()
    args = (q, w, buffers[0], table, rows, lens, 0.2, width)
    got = gluon_indexer.indexer_scores(
        *args, key_scales=scales, per_program=per_program, q_fp8=q_fp8
    )
    triton_scores = indexer_scores(*args, key_scales=scales)
    q8, w8 = gluon_indexer.fp8_queries(q, w)
    # FP8 x FP8 MMAs on Hopper add in about 14 bits (the DeepSeek-V3 report, 3.3.2), not 24:
    # 3-5e-4 of the largest score here (GPU-checked); e4m3 queries are 2^-4 apart, so their
    # scores move a few percent of the largest from the 16-bit queries
    exact, near = (2**-8, 2**-4) if q_fp8 else (0, 0)
    for t, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device="cuda")
        k = keys[table[rows[t], pos // page_size], pos % page_size]
        q_t, w_t = (q8[t], w8[t]) if q_fp8 else (q[t].float(), w[t])
        want = (w_t[:, None] * torch.relu(q_t @ k.T * 0.2)).sum(0)
        top = want.abs().max() if n else 0
        torch.testing.assert_close(got[t, :n], want, rtol=1e-4, atol=1e-4 + exact * top)
        torch.testing.assert_close(
            got[t, :n], triton_scores[t, :n], rtol=1e-4, atol=1e-4 + near * top
        )
        assert torch.isinf(got[t, n:]).all() and (got[t, n:] < 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="Gluon's kernel is Hopper's")
@pytest.mark.parametrize("spans", [[(1, 8192, None), (1, 1500, None)], [(200, 4200, None)]])
def test_the_backend_selects_within_tolerance_at_glm5_shapes(spans):
    """The triton backend's indexer over FP8 keys at GLM-5's shapes (32 heads x 128, pages of
    64, top-k 2048) runs this kernel with FP8 queries: its selection against the torch
    backend's (bf16 queries, the same FP8 keys), decode and a prompt chunk, as
    `bench.kernel_check --only dsa` holds it: the worst pick at most `ATTENTION_TOL` of the
    largest score under the true top-k's cut, and nine in ten of the picks the same."""
    from functools import partial

    from bench.kernel_check import ATTENTION_TOL, BF16
    from bench.kernel_check_dsa import dsa_case
    from dserve.attention.triton_backend import TritonBackend, indexer_kernel

    q = torch.zeros(1, 32, 128, dtype=BF16, device="cuda")
    keys = torch.zeros(1, 64, 128, dtype=torch.uint8, device="cuda")
    kernel = indexer_kernel(q, keys, torch.zeros(1, 64, device="cuda"))
    assert isinstance(kernel, partial) and kernel.keywords == {"q_fp8": True}
    gen = torch.Generator().manual_seed(5)
    deficit, overlap, _ = dsa_case(spans, TritonBackend, gen, fp8_keys=True)
    assert deficit <= ATTENTION_TOL and overlap >= 0.9, (deficit, overlap)
