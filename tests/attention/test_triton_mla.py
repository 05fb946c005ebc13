"""The Triton MLA decode kernel against the torch reference backend's arithmetic, over a real paged
pool (a layer's strided view, pages scattered, contexts of many lengths, several splits). On a CPU
host it runs under TRITON_INTERPRET=1 at small shapes; on a GPU host also at DeepSeek-V3's shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.triton_mla import mla_decode  # noqa: E402
from dserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def reference(q_latent, q_rope, cache, page_table, seq_lens, scale):
    """The torch backend's absorbed MLA for one decode token per sequence."""
    rank, page_size = q_latent.shape[-1], cache.shape[1]
    out = torch.empty_like(q_latent)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=cache.device)
        ctx = cache[page_table[b, pos // page_size], pos % page_size].float()
        scores = (
            q_latent[b].float() @ ctx[:, :rank].T + q_rope[b].float() @ ctx[:, rank:].T
        ) * scale
        out[b] = (scores.softmax(-1) @ ctx[:, :rank]).to(out.dtype)
    return out


def case(heads, rank, rope, page_size, seq_lens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    pool = KVPool(
        KVLayout("mla", 2, page_size, dtype, latent_dim=rank + rope, kv_lora_rank=rank),
        num_pages,
        device,
    )
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    # each sequence's pages scattered over the pool
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    q_latent = torch.randn(len(seq_lens), heads, rank, generator=gen).to(dtype)
    q_rope = torch.randn(len(seq_lens), heads, rope, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q_latent), to(q_rope), pool.buffers[1][0], to(table), to(lens)


@pytest.mark.parametrize(
    "num_splits,block_v,tma,both",
    [
        (1, None, False, False),
        (4, None, False, False),
        (4, 16, False, False),
        (4, 16, True, False),
        (32, None, False, False),
        (4, 16, False, True),
        (4, 16, True, True),
    ],
)
def test_small_shapes_match_the_reference(num_splits, block_v, tma, both):
    """Also with both halves of the value columns in one program (`both_halves`)."""
    device = DEVICE
    # TMA blocks lie within a page; a GPU's dot takes blocks of 16 or more
    page_size = (16 if device == "cuda" else 4) if tma else 4
    q_latent, q_rope, cache, table, lens = case(
        heads=20,
        rank=32,
        rope=16,
        page_size=page_size,
        seq_lens=[1, 5, 16, 37, 3],
        dtype=torch.float32,
        device=device,
    )
    scale = 0.3
    ours = mla_decode(
        q_latent,
        q_rope,
        cache,
        table,
        lens,
        scale,
        num_splits=num_splits,
        block_n=page_size if tma else 16,
        min_split=1,
        block_v=block_v,
        tma=tma,
        both_halves=both,
    )
    ref = reference(q_latent, q_rope, cache, table, lens, scale)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_rows_of_shared_sequences_and_short_contexts():
    """Several query rows read one sequence's page-table row (`row_seqs`: a chain verify's tokens),
    each up to its own context length; with a minimum split longer than most contexts, rows use
    fewer splits than the launch has and the empty ones weigh nothing."""
    device = DEVICE
    q_latent, q_rope, cache, table, _ = case(
        heads=8,
        rank=32,
        rope=16,
        page_size=4,
        seq_lens=[9, 40, 2, 1],
        dtype=torch.float32,
        device=device,
    )
    row_seqs = torch.tensor([1, 1, 1, 0, 3, 2], device=device)
    lens = torch.tensor([38, 39, 40, 9, 1, 2], dtype=torch.int32, device=device)
    ours = mla_decode(
        q_latent[row_seqs],
        q_rope[row_seqs],
        cache,
        table,
        lens,
        0.3,
        num_splits=8,
        block_n=16,
        row_seqs=row_seqs,
        min_split=32,
    )
    ref = reference(q_latent[row_seqs], q_rope[row_seqs], cache, table[row_seqs], lens, 0.3)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_a_sparse_row_selecting_nothing_is_zeros_at_any_split_count():
    """A row whose selection is all -1 has no position in any split: the
    merge of its splits gives zeros (not the NaN of 0/0), as one split
    writes them; the other rows are unchanged by the split count."""
    device = DEVICE
    q_latent, q_rope, cache, table, _ = case(
        heads=4,
        rank=32,
        rope=16,
        page_size=4,
        seq_lens=[12, 9],
        dtype=torch.float32,
        device=device,
    )
    selected = torch.tensor([[0, 5, 11, -1, 7, 3, -1, 2], [-1] * 8], device=device)
    outs = [
        mla_decode(q_latent, q_rope, cache, table, None, 0.3, num_splits=n, selected=selected)
        for n in (1, 4)
    ]
    for out in outs:
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSeek-V3 shapes run on a GPU")
@pytest.mark.parametrize(
    "heads,tune",
    [
        (128, {}),
        (128, {"rows": 12}),
        (16, {}),
        (128, {"block_v": 256, "block_h": 64, "num_warps": 4}),
        (128, {"tma": True, "block_h": 64, "num_warps": 4}),
        (128, {"tma": True, "block_h": 64, "num_warps": 8, "both_halves": True}),
        (128, {"tma": False, "block_h": 64, "num_warps": 8, "both_halves": True}),
    ],
)
def test_deepseek_v3_shapes_match_the_reference(heads, tune):
    """128 heads (16 at attention TP 8), kv_lora_rank 512, rope 64, page size 64, bf16: within bf16
    tolerance; the default launch for each head count and other settings."""
    tune = dict(tune)
    rows = tune.pop("rows", 4)  # 12: the default launch of 8 rows and more
    lens = [1, 700, 4096, 1025, 64, 65, 3000, 2, 8191, 129, 500, 4000][:rows]
    q_latent, q_rope, cache, table, lens = case(
        heads=heads,
        rank=512,
        rope=64,
        page_size=64,
        seq_lens=lens,
        dtype=torch.bfloat16,
        device="cuda",
    )
    scale = 192**-0.5
    # the engine's page table is int64: TMA offsets are narrowed in the kernel
    ours = mla_decode(
        q_latent, q_rope, cache, table.long(), lens, scale, num_splits=8, **tune
    ).float()
    ref = reference(q_latent, q_rope, cache, table, lens, scale).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_with_the_triton_backend_matches_the_reference(tp, tiny_dir, make_engine):
    """`attention_backend="triton"`: decode steps of an MLA model go through the kernel (prompts
    still through the reference), and greedy tokens equal the torch backend's, over ranks too."""
    path = tiny_dir("deepseek_v3")
    prompts = [[5, 17, 99, 3], list(range(40, 77)), [7] * 20]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    device = DEVICE  # the interpreter runs it on a CPU host
    if device == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs")
    # float32: exact parity
    kwargs = dict(page_size=4, dtype="float32", device=device, max_total_tokens=4096)
    expected = make_engine(path, **kwargs).generate(input_ids=prompts, sampling_params=params)
    got = make_engine(path, tp_size=tp, attention_backend="triton", **kwargs).generate(
        input_ids=prompts, sampling_params=params
    )
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]


@pytest.mark.parametrize("topk", [1, 4])
def test_verify_spans_through_the_kernel(topk, tiny_dir, make_engine):
    """With MTP drafts the verify spans (a token and its chain of drafts) run as kernel rows, one per
    token; trees fall back to the reference. Greedy tokens equal the plain torch engine's."""
    path = tiny_dir("deepseek_v3", mtp=True)
    prompts = [[5, 17, 99, 3], list(range(40, 77))]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    device = DEVICE
    kwargs = dict(page_size=4, dtype="float32", device=device, max_total_tokens=4096)
    expected = make_engine(path, **kwargs).generate(input_ids=prompts, sampling_params=params)
    got = make_engine(
        path,
        attention_backend="triton",
        speculative_algorithm="mtp",
        speculative_num_steps=2,
        speculative_eagle_topk=topk,
        **kwargs,
    ).generate(input_ids=prompts, sampling_params=params)
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    assert all(g.meta["spec_verify_ct"] >= 1 for g in got)
