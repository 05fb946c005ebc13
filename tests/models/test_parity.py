"""Token-exact parity with transformers on tiny random checkpoints of every architecture:
DeepSeek-V3 (MLA with q_lora, YaRN), DeepSeek-V2 (MLA without q_lora, softmax group routing),
GLM-4.5 MoE (GQA with bias, QK norm, partial rotary)."""

from __future__ import annotations

import pytest
import torch

from dserve.runtime import SamplingParams
from dserve.scheduler.scheduler import Span
from tests.conftest import forward_spans, random_prompts
from tests.reference import hf_greedy, hf_last_logits, relative_error

GREEDY32 = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
LENGTHS = [5, 23, 40, 17]


def test_config_features_are_exercised(tiny_dir):
    from dserve.models.registry import resolve

    v3, _ = resolve(tiny_dir("deepseek_v3"))
    assert (
        v3.rope.rope_type == "yarn" and v3.q_lora_rank and v3.softmax_scale != v3.qk_head_dim**-0.5
    )
    v2, _ = resolve(tiny_dir("deepseek_v2"))
    assert (
        v2.q_lora_rank is None
        and v2.scoring_func == "softmax"
        and v2.topk_method == "group_limited_greedy"
    )
    glm, _ = resolve(tiny_dir("glm4_moe"))
    assert glm.use_qk_norm and glm.attention_bias and glm.rope.rotary_dim == glm.head_dim // 2
    assert glm.num_key_value_heads < glm.num_attention_heads


@pytest.mark.parametrize("page_size", [1, 16])
def test_last_position_logits_match(tiny_dir, arch, make_engine, page_size):
    """A batch of prompts of different lengths in one forward: each last row within 1e-4 relative."""
    path = tiny_dir(arch)
    engine = make_engine(path, page_size=page_size)
    prompts = random_prompts(4, engine.model_config.vocab_size, LENGTHS, seed=1)
    reqs = [engine.make_request(input_ids=p, sampling_params=GREEDY32) for p in prompts]
    kv = engine.groups[0].kv
    for req in reqs:
        assert kv.allocate_slots(req.rid, req.num_tokens)
    logits = forward_spans(engine, [Span(r, 0, r.num_tokens) for r in reqs])
    for row, prompt in enumerate(prompts):
        err = relative_error(logits[row], hf_last_logits(path, prompt))
        assert err < 1e-4, f"prompt {row}: relative error {err:.2e}"
    for req in reqs:
        kv.free(req.rid)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_match_batched(tiny_dir, arch, make_engine, page_size):
    path = tiny_dir(arch)
    engine = make_engine(path, page_size=page_size)
    prompts = random_prompts(4, engine.model_config.vocab_size, LENGTHS, seed=2)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY32)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 32)
        assert result.finish_reason == "length" and result.meta["completion_tokens"] == 32


def test_greedy_tokens_match_with_chunked_prefill(tiny_dir, arch, make_engine):
    """Prompts cut into 7-token chunks and a 16-token step budget shared by all requests."""
    path = tiny_dir(arch)
    engine = make_engine(path, chunked_prefill_size=7, max_num_batched_tokens=16)
    prompts = random_prompts(3, engine.model_config.vocab_size, [40, 29, 11], seed=3)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY32)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 32)


def test_greedy_tokens_match_on_prefix_cache_hit(tiny_dir, arch, make_engine):
    path = tiny_dir(arch)
    engine = make_engine(path, page_size=4)
    vocab = engine.model_config.vocab_size
    shared = random_prompts(1, vocab, [26], seed=4)[0]
    first = engine.generate(input_ids=shared + [7, 8, 9], sampling_params=GREEDY32)
    assert first.meta["cached_tokens"] == 0
    second_prompt = shared + [10, 11]
    second = engine.generate(input_ids=second_prompt, sampling_params=GREEDY32)
    assert second.meta["cached_tokens"] == 24  # six full 4-token pages of the shared 26 tokens
    assert second.output_ids == hf_greedy(path, second_prompt, 32)
    # the whole first request again: its prompt and generated pages are cached
    again = engine.generate(input_ids=shared + [7, 8, 9], sampling_params=GREEDY32)
    assert again.meta["cached_tokens"] == 28 and again.output_ids == first.output_ids


def test_prefix_cache_can_be_switched_off(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, page_size=4, enable_prefix_caching=False)
    prompt = random_prompts(1, engine.model_config.vocab_size, [30], seed=5)[0]
    a = engine.generate(input_ids=prompt, sampling_params=GREEDY32)
    b = engine.generate(input_ids=prompt, sampling_params=GREEDY32)
    assert b.meta["cached_tokens"] == 0 and a.output_ids == b.output_ids == hf_greedy(
        path, prompt, 32
    )


def test_text_prompt_uses_checkpoint_tokenizer(tiny_dir, make_engine):
    path = tiny_dir("glm4_moe")
    engine = make_engine(path)
    text = "Hello world! Tell me a story."
    ids = engine.tokenizer.encode(text)
    result = engine.generate(
        text, sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    )
    assert result.output_ids == hf_greedy(path, ids, 8)
    assert result.text == engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bfloat16_runs_and_mostly_agrees(tiny_dir, make_engine, dtype):
    """bf16 is not bit-exact with the float32 reference; its logits stay close (loose bound)."""
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, dtype=dtype)
    prompt = random_prompts(1, engine.model_config.vocab_size, [20], seed=6)[0]
    req = engine.make_request(input_ids=prompt, sampling_params=GREEDY32)
    engine.groups[0].kv.allocate_slots(req.rid, req.num_tokens)
    logits = forward_spans(engine, [Span(req, 0, req.num_tokens)])
    engine.groups[0].kv.free(req.rid)
    assert relative_error(logits[0], hf_last_logits(path, prompt)) < 5e-2
    assert torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_tokens_match_on_gpu(tiny_dir, arch, make_engine):
    """float32 on the GPU is still token-exact; bf16 (the GPU default) runs and stays close."""
    path = tiny_dir(arch)
    engine = make_engine(path, device="cuda", dtype="float32", page_size=16, max_total_tokens=4096)
    prompts = random_prompts(4, engine.model_config.vocab_size, LENGTHS, seed=7)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY32)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 32)
    bf16 = make_engine(path, device="cuda", max_total_tokens=4096)  # workers share the GPU
    assert bf16.config.dtype == "bfloat16" and bf16.config.page_size == 64
    req = bf16.make_request(input_ids=prompts[1], sampling_params=GREEDY32)
    bf16.groups[0].kv.allocate_slots(req.rid, req.num_tokens)
    logits = forward_spans(bf16, [Span(req, 0, req.num_tokens)])
    bf16.groups[0].kv.free(req.rid)
    assert relative_error(logits[0], hf_last_logits(path, prompts[1])) < 5e-2
