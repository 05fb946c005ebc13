"""The Triton MHA/GQA decode kernel against the torch reference backend's arithmetic, over a real
paged pool (pages scattered, contexts of many lengths, rows sharing a sequence, several splits). On a
CPU host it runs under TRITON_INTERPRET=1 at small shapes; on a GPU host also at GLM-4.5's shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.triton_mha import mha_decode  # noqa: E402
from dserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def reference(q, keys, values, page_table, row_seqs, seq_lens, scale):
    """The torch backend's attention for one query row each (GQA: heads share KV heads in groups)."""
    page_size, group = keys.shape[1], q.shape[1] // keys.shape[2]
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
    for b, (seq, n) in enumerate(zip(row_seqs.tolist(), seq_lens.tolist())):
        pos = torch.arange(n, device=keys.device)
        pages, offsets = page_table[seq, pos // page_size], pos % page_size
        k = keys[pages, offsets].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = values[pages, offsets].float().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(out.dtype)
    return out


def case(heads, kv_heads, head_dim, page_size, seq_lens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    layout = KVLayout(
        "mha", 2, page_size, dtype, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim
    )
    pool = KVPool(layout, num_pages, DEVICE)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int64)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    keys, values = pool.buffers[1]
    return keys, values, table.to(DEVICE), gen


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 24), (4, 4, 16), (8, 1, 32)])
def test_small_shapes_match_the_reference(heads, kv_heads, head_dim):
    """GQA groups of 3, plain MHA and MQA; a head size that is no power of two; rows of one sequence
    each seeing its own prefix (a chain verify); splits short enough that most rows use several."""
    keys, values, table, gen = case(
        heads, kv_heads, head_dim, page_size=4, seq_lens=[9, 40, 2, 1], dtype=torch.float32
    )
    row_seqs = torch.tensor([1, 1, 1, 0, 3, 2], device=DEVICE)
    lens = torch.tensor([38, 39, 40, 9, 1, 2], device=DEVICE)
    q = torch.randn(len(row_seqs), heads, head_dim, generator=gen).to(DEVICE)
    ours = mha_decode(
        q, keys, values, table, lens, 0.3, row_seqs=row_seqs, num_splits=4, block_n=16, min_split=4
    )
    ref = reference(q, keys, values, table, row_seqs, lens, 0.3)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GLM-4.5 shapes run on a GPU")
def test_glm45_shapes_match_the_reference():
    """96 query heads over 8 KV heads of 128, page size 64, bf16: within bf16 tolerance."""
    keys, values, table, gen = case(
        96, 8, 128, page_size=64, seq_lens=[1, 700, 4096, 1025], dtype=torch.bfloat16
    )
    row_seqs = torch.arange(4, device=DEVICE)
    lens = torch.tensor([1, 700, 4096, 1025], device=DEVICE)
    q = torch.randn(4, 96, 128, generator=gen).to(DEVICE, torch.bfloat16)
    ours = mha_decode(q, keys, values, table, lens, 128**-0.5, max_len=4096).float()
    ref = reference(q, keys, values, table, row_seqs, lens, 128**-0.5).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.parametrize("tp", [1, 2])
def test_glm_engine_with_the_triton_backend_matches_the_reference(tp, tiny_dir, make_engine):
    """An MHA model's decode steps go through the kernel (static steps on one rank), and greedy
    tokens equal the torch backend's."""
    if DEVICE == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs")
    path = tiny_dir("glm4_moe")
    prompts = [[5, 17, 99, 3], list(range(40, 77)), [7] * 20]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    kwargs = dict(page_size=4, dtype="float32", device=DEVICE, max_total_tokens=4096)
    expected = make_engine(path, **kwargs).generate(input_ids=prompts, sampling_params=params)
    got = make_engine(path, tp_size=tp, attention_backend="triton", **kwargs).generate(
        input_ids=prompts, sampling_params=params
    )
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
