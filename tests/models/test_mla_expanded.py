"""MLA in its expanded form (prompt-sized spans: per-head keys and values decompressed from the
latents, `attention/mla_expanded.py`): the same attention output as the absorbed form over the
same pool and batch, and the reference tokens through the engine (forced on every pass with
`mla_expand_min_tokens=1`, or on long spans only, beside absorbed ones in the same pass), with
PyTorch's attention (torch backend) and the Triton kernel (triton backend), chunked prompts over
a cached prefix and TP 2 included."""

from __future__ import annotations

import pytest
import torch

from dserve.attention import mla_expanded
from dserve.attention.torch_backend import TorchBackend
from tests.conftest import random_prompts
from tests.kernel_cases import mla_expanded_case
from tests.reference import hf_greedy

PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs Triton on a CPU
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def test_expanded_equals_absorbed_attention():
    """Two spans, a chunk over a prefix already in the pages and a whole prompt: the expanded
    output (PyTorch's attention) equals the absorbed latents taken out through W_UV."""
    spans = [(5, 21, None), (9, 9, None)]
    absorbed, expanded = mla_expanded_case(
        4, (16, 8, 12, 32), 4, torch.float32, spans, TorchBackend, device="cpu"
    )
    torch.testing.assert_close(expanded, absorbed)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_engine_tokens_with_every_pass_expanded(arch, tiny_dir, make_engine):
    path = tiny_dir(arch)
    engine = make_engine(path, mla_expand_min_tokens=1, chunked_prefill_size=16)
    prompts = random_prompts(3, 512, [9, 40, 71], seed=11)
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 6)
    again = engine.generate(input_ids=prompts[1], sampling_params=PARAMS)  # a prefix hit
    assert again.output_ids == results[1].output_ids
    assert again.meta["cached_tokens"] > 0


@pytest.mark.slow
def test_expanded_under_tensor_parallelism(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, mla_expand_min_tokens=1, tp_size=2)
    prompt = random_prompts(1, 512, [33], seed=12)[0]
    result = engine.generate(input_ids=prompt, sampling_params=PARAMS)
    assert result.output_ids == hf_greedy(path, prompt, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_expanded_on_a_gpu_gives_the_reference_tokens(tiny_dir, make_engine):
    """The Triton kernel on the GPU (float32, the triton backend), every pass expanded."""
    path = tiny_dir("deepseek_v3")
    engine = make_engine(
        path, device="cuda", dtype="float32", mla_expand_min_tokens=1, max_total_tokens=4096
    )
    prompts = random_prompts(2, 512, [40, 90], seed=13)
    for prompt, result in zip(prompts, engine.generate(input_ids=prompts, sampling_params=PARAMS)):
        assert result.output_ids == hf_greedy(path, prompt, 6)


@pytest.mark.parametrize("min_tokens", [1, 20], ids=["every-span", "long-spans"])
def test_engine_tokens_through_the_triton_kernel(min_tokens, tiny_dir, make_engine, monkeypatch):
    """The triton backend's kernel (float32; the interpreter on a CPU host). At 20 tokens, the
    passes mix expanded prompt chunks of 32 with absorbed spans (a 9-token prompt, a chunk's
    tail, decode tokens)."""
    plans = []
    plan_expanded = mla_expanded.plan_expanded
    monkeypatch.setattr(
        mla_expanded, "plan_expanded", lambda *a: plans.append(plan_expanded(*a)) or plans[-1]
    )
    path = tiny_dir("deepseek_v3")
    engine = make_engine(
        path, device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
        mla_expand_min_tokens=min_tokens, chunked_prefill_size=32, max_total_tokens=4096,
    )  # fmt: skip
    prompts = random_prompts(3, 512, [9, 40, 71], seed=11)
    results = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 6)
    assert plans and all(p.work is not None for p in plans if p.spans)
    assert any(p.rest is not None for p in plans) == (min_tokens > 1)
