"""The Gluon MLA decode (Hopper, warp-specialized) against the torch
reference over a real paged pool: a layer's strided view, pages scattered,
contexts that end mid-block, splits with no token, rows that share a
sequence. It runs on an H100/H200 only; on other hosts its dispatch rule is
checked."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dserve.attention import gluon_mla  # noqa: E402
from dserve.attention.triton_mla import mla_decode as triton_decode  # noqa: E402
from tests.attention.test_triton_mla import case, reference  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_it_serves_hopper_shapes_only():
    """CPU tensors, float32 or pages of 32 go to the Triton kernel."""
    q = torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert not gluon_mla.supported(q, cache)
    if HOPPER:
        on = dict(device="cuda")
        q, cache = q.to(**on), cache.to(**on)
        assert gluon_mla.supported(q, cache)
        assert gluon_mla.supported(q[:, :16], cache)
        assert not gluon_mla.supported(q.float(), cache.float())
        assert not gluon_mla.supported(q, cache[:, :32])


def test_no_rows_launch_nothing():
    """A batch of no rows returns an empty output before any launch (the
    queries' TMA descriptor cannot describe an empty tensor)."""
    q = torch.zeros(0, 16, 512, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    table, lens = torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    out = gluon_mla.mla_decode(q, q[..., :64], cache, table, lens, 0.1)
    assert out.shape == (0, 16, 512) and out.dtype == torch.bfloat16


LENS = [1, 700, 4096, 1025, 64, 65, 3000, 2, 8191, 129, 500, 63]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
@pytest.mark.parametrize(
    "heads,page_size,splits,dtype",
    [
        (128, 64, None, torch.bfloat16),
        (128, 64, 8, torch.bfloat16),
        (64, 128, 2, torch.bfloat16),
        (128, 64, 64, torch.float16),
        (128, 64, 1, torch.bfloat16),
        (16, 64, None, torch.bfloat16),
        (8, 128, 4, torch.bfloat16),
        (96, 64, 1, torch.bfloat16),
    ],
)
def test_matches_the_reference(heads, page_size, splits, dtype):
    """Within bf16 tolerance of the reference and no further from it than
    the Triton kernel; 64 splits leave the short contexts' later splits
    empty; one split writes the output itself; heads that do not fill a
    program's 64 (16, 8, 96) are padded and only theirs stored."""
    q_latent, q_rope, cache, table, lens = latent_case(
        heads, LENS, page_size=page_size, dtype=dtype
    )
    scale = 192**-0.5
    # the engine's page tables and lengths are int64
    ours = gluon_mla.mla_decode(
        q_latent, q_rope, cache, table.long(), lens.long(), scale, num_splits=splits
    ).float()
    theirs = triton_decode(q_latent, q_rope, cache, table, lens, scale).float()
    ref = reference(q_latent, q_rope, cache, table, lens, scale).float()
    error = (ours - ref).abs().max() / ref.abs().max()
    assert error < 2e-2
    assert error <= 1.5 * (theirs - ref).abs().max() / ref.abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
@pytest.mark.parametrize(
    "rows,length,uniform",
    [(64, 1024, True), (40, 8192, True), (32, 2048, True), (100, 700, False), (3, 8000, False)],
)
def test_the_launch_cut_matches_the_reference(rows, length, uniform):
    """The default launch (`mla_runs.launch_cut`, H100): a program a row
    (64 rows of 1k), every row in halves (32 of 2k), the even cut across
    rows (40 of 8k; 100 rows of many lengths), a few long rows in 16
    parts."""
    # mixed rows: from half the length up to all of it
    seq_lens = [length - (i * 977) % (length // 2) * (not uniform) for i in range(rows)]
    q_latent, q_rope, cache, table, lens, ours = _decoded(128, seq_lens)
    ref = reference(q_latent, q_rope, cache, table, lens, 0.07).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
def test_rows_that_share_a_sequence():
    """Speculative verification's rows: several query rows read one
    sequence's pages up to their own lengths."""
    q_latent, q_rope, cache, table, lens = latent_case(128, [300, 1000])
    row_seqs = torch.tensor([0, 0, 1, 1, 1], device="cuda")
    row_lens = torch.tensor([299, 300, 998, 999, 1000], device="cuda", dtype=torch.int32)
    q_l, q_r = q_latent[row_seqs].contiguous(), q_rope[row_seqs].contiguous()
    ours = gluon_mla.mla_decode(q_l, q_r, cache, table, row_lens, 0.07, row_seqs=row_seqs).float()
    ref = reference(q_l, q_r, cache, table[row_seqs], row_lens, 0.07).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
def test_the_triton_backend_decodes_with_it():
    """128 and 16 heads go to this kernel, and 64 over sparse selections;
    a backend told otherwise to the Triton one."""
    from dserve.attention import triton_mla
    from dserve.attention.backend import create_backend
    from dserve.memory.kv_pool import KVLayout, KVPool

    layout = KVLayout("mla", 1, 64, torch.bfloat16, latent_dim=576, kv_lora_rank=512)
    pool = KVPool(layout, 4, "cuda")
    backend = create_backend("triton", pool)
    q = torch.zeros(1, 128, 512, dtype=torch.bfloat16, device="cuda")
    cache = pool.buffers[0][0]
    selection = torch.zeros(1, 8, dtype=torch.int32, device="cuda")
    assert backend._decode_kernel(q, cache, None) is gluon_mla.mla_decode
    assert backend._decode_kernel(q[:, :16], cache, None) is gluon_mla.mla_decode
    assert backend._decode_kernel(q[:, :64], cache, selection) is gluon_mla.mla_decode
    backend.gluon_mla = False
    assert backend._decode_kernel(q, cache, None) is triton_mla.mla_decode


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
@pytest.mark.parametrize("sparse", [False, True])
def test_a_dependent_launch_reads_what_the_launch_before_wrote(sparse, monkeypatch):
    """On Hopper the decode and the merge of its splits are dependent
    launches (they may start while the launch before runs): in a CUDA
    graph where a copy writes the queries, a new cache row and the
    selection just before the decode, each replay's output is the one an
    ordinary launch gives after the same writes, bit for bit."""
    from dserve.attention import triton_mla
    from dserve.attention.dependent_launch import dependent_launch

    assert dependent_launch(torch.device("cuda"))["PDL"]
    q_latent, q_rope, cache, table, lens = latent_case(64 if sparse else 128, LENS)
    table, lens = table.long(), lens.long()
    last = lens - 1  # each sequence's newest row
    slots = (table.gather(1, (last // 64)[:, None])[:, 0], last % 64)
    gen = torch.Generator(device="cuda").manual_seed(1)
    picks = torch.randint(0, 8191, (len(LENS), 512), device="cuda", generator=gen)
    chosen = torch.where(picks < lens[:, None], picks, -1)
    fresh = [q_latent.clone(), cache[slots].clone(), chosen.clone()]

    def step():
        q_latent.copy_(fresh[0])
        cache[slots] = fresh[1]
        if sparse:
            chosen.copy_(fresh[2])
        picked = {"selected": chosen} if sparse else {}
        return gluon_mla.mla_decode(
            q_latent, q_rope, cache, table, None if sparse else lens, 0.07, num_splits=4, **picked
        )

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    off = lambda device: {"PDL": False}  # noqa: E731
    for _ in range(3):
        fresh[0].normal_(generator=gen)
        fresh[1].normal_(generator=gen)
        fresh[2].copy_(fresh[2].roll(1, dims=0))
        graph.replay()
        with monkeypatch.context() as m:
            m.setattr(gluon_mla, "dependent_launch", off)
            m.setattr(triton_mla, "dependent_launch", off)
            ordinary = step()
        assert torch.equal(out, ordinary)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
def test_selected_positions_cut_evenly_match_the_reference():
    """80 sparse rows (GLM-5's 64 heads) take the even cut of their blocks
    (`mla_runs.launch_cut`): a run holds parts of several rows."""
    from dserve.attention import mla_runs

    rows, context, top = 80, 4096, 2048
    assert mla_runs.launch_cut(rows, 64, top, torch.device("cuda"), True)[1] == 0
    q_latent, q_rope, cache, table, _ = latent_case(64, [context] * rows)
    gen = torch.Generator().manual_seed(2)
    picks = torch.stack([torch.randperm(context, generator=gen)[:top] for _ in range(rows)])
    picks[::3, top // 2 :] = -1  # some rows select fewer
    selected = picks.cuda()
    ours = gluon_mla.mla_decode(q_latent, q_rope, cache, table, None, 0.07, selected=selected)
    ref = selected_reference(q_latent, q_rope, cache, table, selected, 0.07)
    assert (ours.float() - ref).abs().max() / ref.abs().max() < 2e-2


def selected_reference(q_latent, q_rope, cache, table, selected, scale):
    """Absorbed MLA over each row's selected positions (-1: none)."""
    out, page_size = [], cache.shape[1]
    for b in range(q_latent.shape[0]):
        pos = selected[b][selected[b] >= 0].long()
        ctx = cache[table[b, pos // page_size].long(), pos % page_size].float()
        scores = q_latent[b].float() @ ctx[:, :512].T + q_rope[b].float() @ ctx[:, 512:].T
        out.append((scores * scale).softmax(-1) @ ctx[:, :512])
    return torch.stack(out)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
@pytest.mark.parametrize("top,splits", [(2048, None), (256, 8), (2048, 8)])
def test_selected_positions_match_the_reference(top, splits):
    """GLM-5's sparse attention: 64 heads over each row's selected
    positions, scattered over an 8k context, with -1 holes anywhere and
    at the end (fewer positions than the top-k), whole splits of them."""
    gen = torch.Generator().manual_seed(3)
    rows, context, page_size = 5, 8192, 64
    q_latent, q_rope, cache, table, _ = latent_case(64, [context] * rows, page_size=page_size)
    picks = [torch.randperm(context, generator=gen)[:top] for _ in range(rows)]
    selected = torch.stack(picks).cuda()
    selected[0, :7] = -1
    selected[1, -100:] = -1
    # a context shorter than the top-k: whole splits of -1 (they must
    # merge as nothing, not NaN)
    selected[2, top * 3 // 4 :] = -1
    scale = 192**-0.5
    ours = gluon_mla.mla_decode(
        q_latent, q_rope, cache, table.long(), None, scale, num_splits=splits, selected=selected
    ).float()
    theirs = triton_decode(
        q_latent, q_rope, cache, table, None, scale, max_len=top, selected=selected
    ).float()
    ref = selected_reference(q_latent, q_rope, cache, table, selected, scale)
    error = (ours - ref).abs().max() / ref.abs().max()
    assert error < 2e-2
    assert error <= 1.5 * (theirs - ref).abs().max() / ref.abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
@pytest.mark.parametrize(
    "heads,seq_lens",
    [(128, LENS), (64, LENS), (16, LENS), (128, [8192] * 40)],
)
def test_as_close_to_the_reference_as_flashmla(heads, seq_lens):
    """DeepSeek's own Hopper kernel (FlashMLA's dense decode, as SGLang's
    `sgl-flash-mla` wheel keeps it) on the same pages: ours within bf16
    rounding of its output and no further from the reference (rows of
    many lengths in parts, 40 rows of 8k cut evenly)."""
    pytest.importorskip("flash_mla")
    from bench.flashmla import dense_decode

    q_latent, q_rope, cache, table, lens, ours = _decoded(heads, seq_lens)
    theirs = dense_decode(q_latent, q_rope, cache, table, lens.int(), 0.07)().float()
    ref = reference(q_latent, q_rope, cache, table, lens, 0.07).float()
    assert_as_close_as_flashmla(ours, theirs, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="a Hopper GPU")
def test_selected_as_close_to_the_reference_as_flashmla():
    """FlashMLA's bf16 sparse kernel (SGLang's `flashmla_sparse`, the
    peer in `bench.sparse_decode --flashmla`) over the same selected
    positions of GLM-5's 64 heads: ours within bf16 rounding of its output
    and no further from the reference (one row with -1 holes)."""
    pytest.importorskip("flash_mla")
    from bench.flashmla import pool_slots, sparse_bf16

    gen = torch.Generator().manual_seed(5)
    rows, context = 6, 8192
    q_latent, q_rope, cache, table, _ = latent_case(64, [context] * rows)
    picks = [torch.randperm(context, generator=gen)[:2048] for _ in range(rows)]
    selected = torch.stack(picks).cuda()
    selected[1, -100:] = -1
    ours = gluon_mla.mla_decode(
        q_latent, q_rope, cache, table.long(), None, 0.07, selected=selected
    ).float()
    slots = pool_slots(table, torch.arange(rows, device="cuda"), selected, 64)
    q = torch.cat([q_latent, q_rope], -1)
    theirs = sparse_bf16(q, cache.contiguous(), slots, 0.07).float()
    ref = selected_reference(q_latent, q_rope, cache, table, selected, 0.07)
    assert_as_close_as_flashmla(ours, theirs, ref)


def assert_as_close_as_flashmla(ours, theirs, ref):
    """Ours within bf16 rounding of FlashMLA's output (`theirs`) and no
    further from the float32 reference than it is."""
    top = ref.abs().max()
    assert (ours - theirs).abs().max() / top < 1e-2
    error = (ours - ref).abs().max() / top
    assert error <= 1.5 * (theirs - ref).abs().max() / top + 1e-3


def latent_case(heads, seq_lens, page_size=64, dtype=torch.bfloat16):
    """`case` at the MLA latent's shapes (512 + 64) on the GPU: queries,
    rope queries, the paged cache, its page table and the lengths."""
    return case(
        heads=heads,
        rank=512,
        rope=64,
        page_size=page_size,
        seq_lens=seq_lens,
        dtype=dtype,
        device="cuda",
    )


def _decoded(heads: int, seq_lens: list[int]):
    """A bf16 case of pages of 64 (`latent_case`) and its Gluon decode at the
    default launch (scale 0.07), as float32: the case's five tensors and
    the output."""
    q_latent, q_rope, cache, table, lens = latent_case(heads, seq_lens)
    ours = gluon_mla.mla_decode(
        q_latent, q_rope, cache, table.long(), lens.long(), 0.07, max_len=max(seq_lens)
    ).float()
    return q_latent, q_rope, cache, table, lens, ours
