"""Expanded MLA through the Triton kernel (`attention/triton_expanded.py`, the triton backend's
`forward_mla_expanded`) against PyTorch's attention over the same decompressed keys (the torch
backend's) and against the absorbed form: spans with prefixes in pages, several in a batch, a
single token, pages of one token and of several, a pass whose short spans stay absorbed. Under
TRITON_INTERPRET=1 on a CPU host at small shapes; on a GPU also at DeepSeek-V3's, in bf16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention import mla_expanded  # noqa: E402
from dserve.attention.torch_backend import TorchBackend  # noqa: E402
from dserve.attention.triton_backend import TritonBackend  # noqa: E402
from tests.kernel_cases import mla_expanded_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`
# (new tokens, context after the step, no tree): a prompt, an extend over a prefix, a decode
# token, a prompt of one token, a few tokens over a context past a block of keys
SPANS = [(37, 37, None), (20, 70, None), (1, 9, None), (1, 1, None), (5, 133, None)]
DIMS = (
    24,
    16,
    24,
    64,
)  # nope, rope, values (24: no power of two), rank; 16 columns at least (a GPU's tensor-core products)
LAUNCHES = [
    {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"rows": 8, "block_n": 16, "num_warps": 4, "num_stages": None},
]


class Recorded(TritonBackend):
    """The triton backend, keeping the expanded plans it made."""

    plans: list = []

    def expanded_plan(self):
        plan = super().expanded_plan()
        self.plans.append(plan)
        return plan


def launched(launch: dict):
    """A `Recorded` backend class whose expanded kernel takes `launch`."""

    class Launched(Recorded):
        def __init__(self, pool, index_pool=None):
            super().__init__(pool, index_pool)
            self.extend_tune["expanded"] = dict(launch)

    Launched.plans = []
    return Launched


def expanded(backend_class, spans=SPANS, page_size=4, min_tokens=0, dims=DIMS):
    """(absorbed by the torch backend, expanded by `backend_class`), float32."""
    return mla_expanded_case(
        4, dims, page_size, torch.float32, spans, backend_class, device=DEVICE,
        min_tokens=min_tokens,
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("launch", LAUNCHES, ids=["128x64", "8x16"])
def test_kernel_equals_pytorch_attention_and_the_absorbed_form(page_size, launch):
    backend = launched(launch)
    absorbed, ours = expanded(backend, page_size=page_size)
    reference = expanded(TorchBackend, page_size=page_size)[1]
    assert backend.plans and all(p.work is not None for p in backend.plans)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, absorbed, atol=1e-5, rtol=1e-5)


def test_power_of_two_dims():
    """DeepSeek's proportions (nope 2x rope, values as wide as nope): no padded columns."""
    absorbed, ours = expanded(launched(LAUNCHES[1]), dims=(32, 16, 32, 64))
    torch.testing.assert_close(ours, absorbed, atol=1e-5, rtol=1e-5)


def test_half_precision():
    """float16 queries, keys and values (products in float32, probabilities rounded to
    float16), against the absorbed form in float16 (under this Triton interpreter bfloat16
    comes out wrong, for the absorbed kernels too)."""
    absorbed, ours = mla_expanded_case(
        4, DIMS, 4, torch.float16, SPANS, launched(LAUNCHES[1]), device=DEVICE
    )
    assert (ours - absorbed).abs().max() / absorbed.abs().max() < 1e-2


def test_short_spans_stay_absorbed_in_the_same_pass():
    """At 10 new tokens a span: the prompt and the extend expand, the decode tokens and the
    5-token span absorb (a batch of their own: the decode kernel), and the rows add up."""
    backend = launched(LAUNCHES[0])
    absorbed, ours = expanded(backend, min_tokens=10)
    plan = backend.plans[-1]
    assert plan.spans == [0, 1] and plan.rest.q_lens == [1, 1, 5]
    torch.testing.assert_close(ours, absorbed, atol=1e-5, rtol=1e-5)
    reference = expanded(TorchBackend, min_tokens=10)[1]  # the same split, PyTorch's attention
    torch.testing.assert_close(reference, absorbed, atol=1e-5, rtol=1e-5)


def test_contexts_past_the_limit_stay_absorbed(monkeypatch):
    """Spans expand in order while their contexts together fit `MAX_CONTEXT` (here 100)."""
    monkeypatch.setattr(mla_expanded, "MAX_CONTEXT", 100)
    backend = launched(LAUNCHES[0])
    absorbed, ours = expanded(backend)
    assert backend.plans[-1].spans == [0, 2, 3]  # 37 + 9 + 1; the 70 and 133 would not fit
    torch.testing.assert_close(ours, absorbed, atol=1e-5, rtol=1e-5)


def test_kv_weight_is_a_view_of_kv_b_proj():
    kv_b = torch.randn(4, 16 + 24, 32)
    w_uk, w_uv = kv_b.split([16, 24], 1)
    joined = mla_expanded.kv_weight(w_uk, w_uv)
    assert joined.data_ptr() == kv_b.data_ptr() and torch.equal(joined, kv_b.view(-1, 32))
    copied = mla_expanded.kv_weight(w_uk.clone(), w_uv.clone())
    assert torch.equal(copied, joined)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
@pytest.mark.parametrize(
    "spans",
    [[(2048, 2048, None)], [(1024, 1800, None), (700, 700, None), (1, 90, None)]],
    ids=["prompt", "prefix-and-mixed"],
)
def test_deepseek_v3_shapes_equal_the_absorbed_kernel(spans):
    """128 heads, nope 128, rope 64, values 128, latent 512, pages of 64, bf16: the expanded
    kernel against the absorbed Triton kernel, within bf16 tolerance (min 64 new tokens: the
    decode token of the second batch stays absorbed)."""
    absorbed, ours = mla_expanded_case(
        128, (128, 64, 128, 512), 64, torch.bfloat16, spans, TritonBackend,
        absorbed_class=TritonBackend, min_tokens=64,
    )  # fmt: skip
    assert (ours - absorbed).abs().max() / absorbed.abs().max() < 2e-2
