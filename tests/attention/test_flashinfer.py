"""The FlashInfer backend against the torch reference backend on the same pool and batch, at DeepSeek-V3's
and GLM-4.5's attention shapes in bf16 (GPU host with flashinfer installed): prompt chunks, an extend
over a prefix in pages, decode tokens and a draft tree (which goes to the Triton extend kernel) in one
batch, then a batch of decode tokens alone. On any host: without FlashInfer the backend says how to
install it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dserve.attention.backend import create_backend
from dserve.memory.kv_pool import KVLayout, KVPool

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_FLASHINFER, reason="needs a GPU and flashinfer"
)
MIXED = [(700, 700, None), (300, 1500, None), (1, 90, None), (8, 200, None), (1, 4000, None)]
TREE = MIXED + [(8, 200, 9)]
DECODE = [(1, n, None) for n in (1, 63, 64, 65, 1000, 8191)]


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_missing_flashinfer_says_how_to_install():
    from dserve.attention.flashinfer_backend import import_flashinfer

    with pytest.raises(ValueError, match="pip install flashinfer-python"):
        import_flashinfer()


def test_flashinfer_refuses_the_cpu():
    pool = KVPool(KVLayout("mla", 1, 4, torch.bfloat16, latent_dim=48, kv_lora_rank=32), 4, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend("flashinfer", pool)


def test_flashinfer_mla_shapes_are_checked_at_start():
    """FlashInfer's SM90 MLA kernels take DeepSeek's latent (512 + 64), not a tiny model's (32 + 16)."""
    from dserve.attention.flashinfer_backend import check_shapes

    with pytest.raises(ValueError, match="kv_lora_rank a multiple of 128.*has 32 and 16"):
        check_shapes(KVLayout("mla", 1, 4, torch.bfloat16, latent_dim=48, kv_lora_rank=32))
    check_shapes(KVLayout("mla", 1, 64, torch.bfloat16, latent_dim=576, kv_lora_rank=512))
    check_shapes(KVLayout("mha", 1, 64, torch.bfloat16, num_kv_heads=2, head_dim=32, v_head_dim=32))


def relative_error(ref, ours) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("spans", [MIXED, TREE, DECODE], ids=["mixed", "tree", "decode"])
@pytest.mark.parametrize("heads", [128, 16])
def test_deepseek_v3_mla_matches_the_reference(spans, heads):
    """128 heads (one GPU) and 16 (attention TP 8)."""
    from dserve.attention.flashinfer_backend import FlashInferBackend
    from tests.kernel_cases import mla_case

    ref, ours = mla_case(heads, 512, 64, 64, torch.bfloat16, spans, FlashInferBackend)
    assert relative_error(ref, ours) < 2e-2


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("spans", [MIXED, TREE, DECODE], ids=["mixed", "tree", "decode"])
def test_glm45_mha_matches_the_reference(spans):
    """96 query heads over 8 KV heads of 128."""
    from dserve.attention.flashinfer_backend import FlashInferBackend
    from tests.kernel_cases import mha_case

    ref, ours = mha_case(96, 8, 128, 64, torch.bfloat16, spans, FlashInferBackend)
    assert relative_error(ref, ours) < 2e-2


GRAPH_ROUNDS = [
    [(1, 1, None), (1, 63, None), (4, 68, None), (1, 1000, None), (4, 8191, None)],
    [(1, 8000, None), (1, 64, None), (4, 4, None), (1, 2, None), (4, 700, None)],
    [(1, 8001, None), (1, 65, None), (4, 5, None), (1, 3, None), (4, 701, None)],
]


def static_copy(static: dict, batch) -> None:
    """A batch's tensors into a captured pass's fixed buffers (the page
    table into the first columns of the static one)."""
    table = static["page_table"]
    table.zero_()
    table[: batch.page_table.shape[0], : batch.page_table.shape[1]] = batch.page_table
    for name in ("out_slots", "token_seqs", "token_ctx_lens"):
        static[name].copy_(getattr(batch, name))


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_graph_replays_match_the_reference_at_long_contexts(arch):
    """A static pass captured once, then replayed over new pages, new
    queries and contexts of 1 to 8191 tokens that grow between replays
    (decode tokens and chains of 4), each against the torch reference on
    the same pool: the graph's page gather and the host plan before each
    replay follow the batch, not the capture."""
    from dataclasses import replace

    from dserve.attention.flashinfer_backend import FlashInferBackend
    from dserve.attention.torch_backend import TorchBackend
    from tests.kernel_cases import pages_for, random_batch

    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(3)
    if arch == "mla":
        heads, rank, rope = 128, 512, 64
        layout = KVLayout("mla", 1, 64, dtype, latent_dim=rank + rope, kv_lora_rank=rank)
        shapes = ((heads, rank), (heads, rope), (rank + rope,))
        forward = lambda b, x: b.forward_mla(0, *x, (rank + rope) ** -0.5)
    else:
        layout = KVLayout("mha", 1, 64, dtype, num_kv_heads=8, head_dim=128, v_head_dim=128)
        shapes = ((96, 128), (8, 128), (8, 128))
        forward = lambda b, x: b.forward_mha(0, *x, 128**-0.5)
    pool = KVPool(layout, 3 * max(pages_for(r, 64) for r in GRAPH_ROUNDS), "cuda")
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(dtype))
    batches = [random_batch(pool, spans, gen, "cuda") for spans in GRAPH_ROUNDS]
    tokens = batches[0].num_tokens
    inputs = [
        [torch.randn(tokens, *s, generator=gen).to("cuda", dtype) for s in shapes] for _ in batches
    ]
    first = batches[0]
    static = {
        "page_table": torch.zeros(len(first.q_lens), 200, dtype=torch.int64, device="cuda"),
        "out_slots": first.out_slots.clone(),
        "token_seqs": first.token_seqs.clone(),
        "token_ctx_lens": first.token_ctx_lens.clone(),
        "inputs": [x.clone() for x in inputs[0]],
    }
    real = torch.ones(tokens, dtype=torch.int64, device="cuda")
    static_batch = replace(
        first,
        page_table=static["page_table"],
        out_slots=static["out_slots"],
        token_seqs=static["token_seqs"],
        token_ctx_lens=static["token_ctx_lens"],
        real_tokens=real,
    )
    ours = FlashInferBackend(pool)

    def prepare(batch, x) -> None:
        static_copy(static, batch)
        for dst, src in zip(static["inputs"], x):
            dst.copy_(src)
        ours.prepare_static(tokens, batch.token_ctx_lens.cpu().numpy())

    prepare(first, inputs[0])
    ours.plan(static_batch)  # the eager run before a capture: the first plan
    forward(ours, static["inputs"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours.plan(static_batch)
        out = forward(ours, static["inputs"])
    assert ours.graphs[tokens].wrapper is not None
    for batch, x in zip(batches, inputs):
        reference = TorchBackend(pool)
        reference.plan(batch)
        expected = forward(reference, x).float()
        prepare(batch, x)
        graph.replay()
        assert relative_error(expected, out.float()) < 2e-2
