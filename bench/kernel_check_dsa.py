"""`bench.kernel_check`'s rows of GLM-5's sparse attention (DSA): 64 heads of latent 512 + rope 64,
indexer 32 heads x 128, top-k 2048, with the indexer keys in bf16 and in FP8 (the production
layout). The indexer's selection is held against the float32 reference scores of the same keys
and queries (how far below the reference's top-k cut its worst pick scores; with FP8 keys on
Hopper the backend rounds the queries to e4m3 too, and so does the reference), and its
overlap with the torch backend's picks (16-bit queries) is shown; the sparse MLA is held
against the torch backend on the reference's selection:

    python -m bench.kernel_check --only dsa
"""

from __future__ import annotations

import torch

from bench.kernel_check import ATTENTION_TOL, BF16, relative_error
from dserve.attention.torch_backend import TorchBackend
from dserve.memory.kv_pool import KVLayout, KVPool
from tests.kernel_cases import pages_for, random_batch

# GLM-5's sparse attention: 64 heads of latent 512 + rope 64, indexer 32 heads x 128, top-k 2048
GLM5 = (64, 512, 64, 64, 32, 128, 2048)  # heads, rank, rope, page, indexer heads and dim, top-k
DSA_SPANS = {
    "decode": [(1, 8192, None), (1, 32768, None), (1, 1500, None)],
    "extend": [(200, 4200, None)],
}


def dsa_case(
    spans, backend_class, gen, device="cuda", shape=GLM5, fp8_keys=False
) -> tuple[float, float, float]:
    """(selection deficit, selection overlap, sparse-MLA relative error) of `backend_class`
    against the torch reference on one GLM-5-shaped layer over `spans`. The deficit is how far
    the worst position the backend selected scores below the reference's top-k cut, relative to
    the largest score (0: it selected a true top-k); the sparse MLA runs both on the
    reference's selection. `fp8_keys`: the indexer pool in the production layout (both read
    the same FP8 keys)."""
    from dserve.attention.index_cache import read_keys, write_keys

    heads, rank, rope, page, idx_heads, idx_dim, topk = shape
    latent = KVLayout("mla", 1, page, BF16, latent_dim=rank + rope, kv_lora_rank=rank)
    key_dtype = torch.uint8 if fp8_keys else BF16
    index = KVLayout("index", 1, page, key_dtype, latent_dim=idx_dim)
    pages = pages_for(spans, page)
    pools = [KVPool(layout, pages, device) for layout in (latent, index)]
    latents, index_keys = pools
    latents.pages.copy_(torch.randn(latents.pages.shape, generator=gen).to(BF16))
    keys = torch.randn(pages * page, idx_dim, generator=gen).to(BF16)  # one layer
    every = torch.arange(pages * page, device=device)
    write_keys(index_keys, 0, every, keys.to(device))
    batch = random_batch(pools[0], spans, gen, device)
    t = batch.num_tokens
    q, k = (
        torch.randn(*s, generator=gen).to(device, BF16)
        for s in ((t, idx_heads, idx_dim), (t, idx_dim))
    )
    w = (torch.rand(t, idx_heads, generator=gen) * idx_heads**-0.5).to(device)
    scale = idx_dim**-0.5
    chosen = []
    for backend in (TorchBackend(*pools), backend_class(*pools)):
        backend.plan(batch)
        chosen.append(backend.forward_indexer(0, q, k, w, scale, topk))
    ref_q, ref_w = reference_queries(backend_class, pools[1], q, w)
    deficit, overlap = selection_quality(pools[1], batch, ref_q, ref_w, scale, *chosen, read_keys)
    mla = []
    q_latent, q_rope, new = (
        torch.randn(*s, generator=gen).to(device, BF16)
        for s in ((t, heads, rank), (t, heads, rope), (t, rank + rope))
    )
    for backend in (TorchBackend(*pools), backend_class(*pools)):
        backend.plan(batch)
        out = backend.forward_mla(0, q_latent, q_rope, new, (rank + rope) ** -0.5, chosen[0])
        mla.append(out.float())
    return deficit, overlap, relative_error(*mla)


def reference_queries(backend_class, pool, q, w) -> tuple:
    """The queries and weights the reference scores take: the backend's
    own arithmetic, so that the deficit measures its kernels. Where it
    rounds them to e4m3 (FP8 keys on Hopper), the same e4m3 queries; the
    overlap still compares its picks with the torch backend's, from
    16-bit queries."""
    from dserve.attention import gluon_indexer
    from dserve.attention.index_cache import key_scales
    from dserve.attention.triton_backend import TritonBackend, rounds_queries

    if backend_class is not TritonBackend or not pool.layout.scaled:
        return q, w
    keys, scales = pool.buffers[0][0], key_scales(pool.buffers[0][1])
    if rounds_queries(q, keys, scales):
        return gluon_indexer.fp8_queries(q, w)
    return q, w


def selection_quality(pool, batch, q, w, scale, ref, got, read_keys) -> tuple[float, float]:
    """(worst deficit of `got`'s positions under the reference top-k cut relative to the largest
    score, mean share of `ref`'s positions `got` also has), from float32 reference scores."""
    deficits, overlaps = [], []
    row = 0
    for span, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        pos = torch.arange(seq_len, device=q.device)
        table = batch.page_table[span]
        slots = table[pos // pool.layout.page_size] * pool.layout.page_size
        keys = read_keys(pool, 0, slots + pos % pool.layout.page_size)
        for i in range(q_len):
            tok = row + i
            visible = seq_len - q_len + i + 1
            s = torch.relu(q[tok].float() @ keys[:visible].T * scale)  # [H, visible]
            scores = w[tok] @ s
            kept = min(ref.shape[1], visible)
            cut = scores.topk(kept).values[-1]
            mine = got[tok][got[tok] >= 0]
            top = scores.abs().max().clamp(min=1e-30)
            deficits.append(float((cut - scores[mine].min()).clamp(min=0) / top))
            theirs = set(ref[tok][ref[tok] >= 0].tolist())
            overlaps.append(len(theirs & set(mine.tolist())) / max(len(theirs), 1))
        row += q_len
    return max(deficits), sum(overlaps) / len(overlaps)


def dsa_cases() -> list[tuple[str, tuple, bool]]:
    """(kind, span, FP8 indexer keys) of the DSA rows: every span with the keys in bf16, the
    32k decode and the extend with them in FP8 too."""
    cases = [(kind, span, False) for kind, spans in DSA_SPANS.items() for span in spans]
    fp8 = [DSA_SPANS["decode"][1], DSA_SPANS["extend"][0]]
    return cases + [(kind, span, True) for kind, span, _ in cases if span in fp8]


def dsa_rows(backends: list[str]) -> list[dict]:
    from dserve.attention.triton_backend import TritonBackend

    rows = []
    classes = {"triton": TritonBackend}
    for backend in [b for b in backends if b in classes]:
        for kind, span, fp8 in dsa_cases():
            gen = torch.Generator().manual_seed(3)
            deficit, overlap, error = dsa_case([span], classes[backend], gen, fp8_keys=fp8)
            shape = f"ctx {span[1]}, {span[0]} new, top-k 2048"
            keys = ", FP8 keys" if fp8 else ""
            rows.append(
                {
                    "kernel": f"DSA indexer {kind}{keys} ({backend})",
                    "shape": shape + f", overlap {overlap:.3f}",
                    "tolerance": ATTENTION_TOL,
                    "error": deficit,
                }
            )
            rows.append(
                {
                    "kernel": f"DSA sparse MLA {kind}{keys} ({backend})",
                    "shape": shape + ", 64 heads",
                    "tolerance": ATTENTION_TOL,
                    "error": error,
                }
            )
    return rows
