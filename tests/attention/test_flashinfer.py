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
