"""Random pools and batches for attention backends, each against the torch reference on the same
pool and batch (`mla_case`, `mha_case`), and a pass of decoding requests over a KV manager
(`step_batch`). Shared by the attention tests and bench/kernel_check.py, bench/spec_verify.py."""

from __future__ import annotations

import torch

from dserve.attention.backend import ForwardBatch
from dserve.attention.torch_backend import TorchBackend
from dserve.memory.kv_pool import KVLayout, KVPool


def tree_mask(q_len: int, tail: int, gen) -> torch.Tensor:
    """Every token sees the tail's first position (the last accepted token) and itself; others at random."""
    mask = torch.rand(q_len, tail, generator=gen) < 0.5
    mask[:, 0] = True
    mask[torch.arange(q_len), tail - q_len + torch.arange(q_len)] = True
    return mask


def random_batch(pool: KVPool, spans, gen, device: str) -> ForwardBatch:
    """One batch of `spans` over pages scattered through `pool`, each span's new tokens in its last slots."""
    ps = pool.layout.page_size
    pages = [(seq_len + ps - 1) // ps for _, seq_len, _ in spans]
    order = torch.randperm(pool.num_pages, generator=gen)[: sum(pages)]
    table = torch.zeros(len(spans), max(pages), dtype=torch.int64)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used : used + n]
        used += n
    slots, positions = [], []
    for i, (q_len, seq_len, _) in enumerate(spans):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[i, pos // ps] * ps + pos % ps)
        positions.append(pos)
    tokens = sum(q for q, _, _ in spans)
    masks = [None if tail is None else tree_mask(q_len, tail, gen) for q_len, _, tail in spans]
    batch = ForwardBatch(
        torch.zeros(tokens, dtype=torch.int64),
        torch.cat(positions),
        [q for q, _, _ in spans],
        [s for _, s, _ in spans],
        table,
        torch.cat(slots),
        torch.arange(tokens),
        tree_masks=masks,
    )
    return batch.to(torch.device(device))


def pages_for(spans, page_size: int) -> int:
    """A pool with room for the spans' pages to be scattered over (at least 64 pages)."""
    return max(64, 2 * sum(-(-seq_len // page_size) for _, seq_len, _ in spans))


def run_both(
    pool, batch, forward, backend_class, expect_extend: bool = False
) -> list[torch.Tensor]:
    """The torch reference's output and `backend_class(pool)`'s (float32), on the same pool and batch."""
    outs = []
    for backend in (TorchBackend(pool), backend_class(pool)):
        backend.plan(batch)
        if expect_extend:
            assert not getattr(backend, "decode", False), "the batch must take the extend path"
        outs.append(forward(backend).float())
    return outs


def mla_case(
    heads, rank, rope, page_size, dtype, spans, backend_class, device="cuda", expect_extend=False
):
    """(reference, backend) outputs of one absorbed-MLA layer over a random pool and batch of `spans`."""
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout("mla", 1, page_size, dtype, latent_dim=rank + rope, kv_lora_rank=rank)
    pool = KVPool(layout, pages_for(spans, page_size), device)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batch = random_batch(pool, spans, gen, device)
    tokens = batch.num_tokens
    q_latent, q_rope, latent = (
        torch.randn(*shape, generator=gen).to(device, dtype)
        for shape in ((tokens, heads, rank), (tokens, heads, rope), (tokens, rank + rope))
    )
    return run_both(
        pool,
        batch,
        lambda b: b.forward_mla(0, q_latent, q_rope, latent, (rank + rope) ** -0.5),
        backend_class,
        expect_extend,
    )


def mla_expanded_case(
    heads, dims, page_size, dtype, spans, backend_class, absorbed_class=TorchBackend,
    device="cuda", min_tokens=0,
):  # fmt: skip
    """(absorbed, expanded) outputs [T, H, V] of one MLA layer over a random pool and batch of
    `spans`, dims (nope, rope, values, rank): the absorbed form by `absorbed_class` (its latents
    out through W_UV), the expanded by `backend_class` (spans of at least `min_tokens` new
    tokens; it absorbs the others). W_UK and W_UV are halves of one kv_b_proj weight."""
    nope, rope, v_dim, rank = dims
    gen = torch.Generator().manual_seed(2)
    layout = KVLayout("mla", 1, page_size, dtype, latent_dim=rank + rope, kv_lora_rank=rank)
    pool = KVPool(layout, pages_for(spans, page_size), device)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batch = random_batch(pool, spans, gen, device)
    shapes = ((heads, nope), (heads, rope), (rank + rope,))
    q_nope, q_rope, latent = (
        torch.randn(batch.num_tokens, *s, generator=gen).to(device, dtype) for s in shapes
    )
    kv_b = torch.randn(heads, nope + v_dim, rank, generator=gen) / rank**0.5
    w_uk, w_uv = kv_b.to(device, dtype).split([nope, v_dim], 1)
    scale = (nope + rope) ** -0.5
    absorbed = absorbed_class(pool)
    absorbed.plan(batch)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    o_latent = absorbed.forward_mla(0, q_latent, q_rope, latent, scale)
    expanded = backend_class(pool)
    expanded.expand_min_tokens = min_tokens
    expanded.plan(batch)
    out = expanded.forward_mla_expanded(0, q_nope, q_rope, latent, w_uk, w_uv, scale)
    return torch.einsum("thr,hvr->thv", o_latent, w_uv).float(), out.float()


def mha_case(
    heads,
    kv_heads,
    head_dim,
    page_size,
    dtype,
    spans,
    backend_class,
    device="cuda",
    expect_extend=False,
):
    """(reference, backend) outputs of one MHA/GQA layer over a random pool and batch of `spans`."""
    gen = torch.Generator().manual_seed(1)
    layout = KVLayout(
        "mha", 1, page_size, dtype, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim
    )
    pool = KVPool(layout, pages_for(spans, page_size), device)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batch = random_batch(pool, spans, gen, device)
    tokens = batch.num_tokens
    q, k, v = (
        torch.randn(tokens, h, head_dim, generator=gen).to(device, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    return run_both(
        pool,
        batch,
        lambda b: b.forward_mha(0, q, k, v, head_dim**-0.5),
        backend_class,
        expect_extend,
    )


def step_batch(kv, batch_size: int, context: int, q_len: int):
    """`batch_size` requests with `context` tokens in KV, each adding `q_len` tokens with logits at all."""
    from dserve.step.batch import Seq, assemble, table_rows

    entries = []
    for i in range(batch_size):
        rid = f"r{i}"
        if rid not in kv.tables:
            assert kv.allocate_slots(rid, context + 8), "pool too small"
        entries.append(
            Seq(rid, context, [100 + 7 * i + j for j in range(q_len)], list(range(q_len)))
        )
    rows = table_rows(kv.tables, [seq.holder for seq in entries])
    return assemble(entries, rows, kv.page_size)
