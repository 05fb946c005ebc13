"""Sampling: filters on crafted logits, penalties against transformers' processors, seeds, stops,
logprobs against the reference distribution."""

from __future__ import annotations

import math

import pytest
import torch

from dserve.runtime import SamplingParams
from dserve.scheduler.request import Request
from dserve.step.rank_state import RankRequest
from dserve.step.sampler import Sampler, _penalise, processed_probs
from tests.conftest import random_prompts
from tests.reference import hf_greedy, hf_last_logits, hf_model


def _req(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params))


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **p: (processed_probs(logits.clone(), [_req(**p)])[0] > 0).tolist()
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(min_p=0.2) == [True, True, True, False]  # 0.15 >= 0.2 * 0.5, 0.05 is not
    probs = processed_probs(logits.clone(), [_req(top_k=2)])[0]
    assert torch.allclose(probs[:2], torch.tensor([0.5, 0.3]) / 0.8)


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = processed_probs(logits.clone(), [_req(temperature=0.5)])[0]
    assert torch.allclose(cold, torch.tensor([0.36, 0.16]) / 0.52)


def test_frequency_and_presence_penalties():
    req = Request(
        "r", [0], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output_ids=[2, 2, 3]
    )
    out = _penalise(torch.zeros(1, 5), [req])[0]
    assert out.tolist() == [0.0, 0.0, -1.25, -0.75, 0.0]


def test_repetition_penalty_matches_transformers(tiny_dir, make_engine):
    from transformers import RepetitionPenaltyLogitsProcessor

    path = tiny_dir("deepseek_v3")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [12], seed=21)[0]
    params = SamplingParams(
        max_new_tokens=20, temperature=0, repetition_penalty=1.5, ignore_eos=True
    )
    result = engine.generate(input_ids=prompt, sampling_params=params)
    assert result.output_ids == hf_greedy(path, prompt, 20, RepetitionPenaltyLogitsProcessor(1.5))
    assert result.output_ids != hf_greedy(path, prompt, 20)  # the penalty changed something


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("glm4_moe"))
    prompts = random_prompts(3, engine.model_config.vocab_size, [9, 14, 6], seed=22)
    seeded = SamplingParams(
        max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True
    )
    alone = engine.generate(input_ids=prompts[0], sampling_params=seeded)
    other = SamplingParams(max_new_tokens=16, temperature=0.7, ignore_eos=True)
    batch = engine.generate(input_ids=prompts, sampling_params=[seeded, other, other])
    assert batch[0].output_ids == alone.output_ids
    different = engine.generate(
        input_ids=prompts[0],
        sampling_params=SamplingParams(
            max_new_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True
        ),
    )
    assert different.output_ids != alone.output_ids


def test_top_k_one_is_greedy(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v2")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [10], seed=23)[0]
    result = engine.generate(
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=12, top_k=1, ignore_eos=True),
    )
    assert result.output_ids == hf_greedy(path, prompt, 12)


def test_stop_token_ids_and_eos(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [10], seed=24)[0]
    full = hf_greedy(path, prompt, 20)
    stop_at = full[6]
    first = full.index(stop_at)
    result = engine.generate(
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop_at]),
    )
    assert result.output_ids == full[: first + 1]
    assert result.finish_reason == "stop" and result.meta["matched_stop"] == stop_at
    engine.eos_token_ids = {full[3]}
    eos = engine.generate(
        input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=20, temperature=0)
    )
    assert eos.output_ids == full[: full.index(full[3]) + 1] and eos.finish_reason == "stop"
    ignored = engine.generate(
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True),
    )
    assert ignored.output_ids == full and ignored.finish_reason == "length"


def test_stop_string_cuts_text(tiny_dir, make_engine):
    path = tiny_dir("glm4_moe")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [10], seed=25)[0]
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    full = engine.generate(input_ids=prompt, sampling_params=greedy)
    text = full.text
    stop = next(
        text[i : i + 2]
        for i in range(4, len(text) - 2)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    cut = engine.generate(
        input_ids=prompt,
        sampling_params=SamplingParams(
            max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop]
        ),
    )
    assert cut.finish_reason == "stop" and cut.meta["matched_stop"] == stop
    assert cut.text == text[: text.index(stop)]
    assert cut.output_ids == full.output_ids[: len(cut.output_ids)]


def test_logprobs_match_reference_distribution(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [15], seed=26)[0]
    result = engine.generate(
        input_ids=prompt,
        sampling_params=SamplingParams(
            max_new_tokens=3,
            temperature=0,
            return_logprob=True,
            top_logprobs_num=5,
            ignore_eos=True,
        ),
    )
    ref = torch.log_softmax(hf_last_logits(path, prompt), dim=-1)
    logprob, token = result.meta["output_token_logprobs"][0]
    assert token == result.output_ids[0] and math.isclose(logprob, float(ref[token]), abs_tol=1e-4)
    top = result.meta["output_top_logprobs"][0]
    assert [t for t, _ in top] == ref.topk(5).indices.tolist()
    assert all(math.isclose(v, float(ref[t]), abs_tol=1e-4) for t, v in top)
    assert len(result.meta["output_token_logprobs"]) == 3


@pytest.mark.parametrize("seed", [None, 5], ids=["device-race", "seeded-on-host"])
def test_sampler_draws_follow_the_filtered_distribution(seed):
    """Unseeded rows race on the device (argmax of p / Exp(1)), seeded ones draw on the host from a
    generator of their seed and position: both follow the filtered distribution (here over the
    positions of one request, as a seeded request's tokens do)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
    reqs = [RankRequest(0, [1, 2, 3], 3, params) for _ in range(4000)]
    ids = Sampler(torch.device("cpu"), seed=0).sample(logits, reqs, list(range(4000))).ids
    counts = torch.bincount(ids, minlength=4).float() / 4000
    assert counts[3] == 0
    assert torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad).validate(vocab_size=512)


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_logit_bias_min_new_tokens_and_no_stop_trim(tiny_dir, make_engine):
    """A +100 bias forces a token (greedy and drawn on the device alike); `min_new_tokens` masks
    the ids that would end the request until it has that many; `no_stop_trim` keeps the stop."""
    engine = make_engine(tiny_dir("deepseek_v3"))
    eos = engine.tokenizer.eos_token_id
    to_eos = {str(eos): 100}
    forced = engine.generate("hello", sampling_params=dict(max_new_tokens=6, logit_bias=to_eos))
    assert forced.output_ids == [eos] and forced.finish_reason == "stop"
    params = dict(temperature=0, max_new_tokens=9, logit_bias=to_eos, min_new_tokens=3)
    later = engine.generate("hello", sampling_params=params)
    assert later.output_ids[3] == eos and eos not in later.output_ids[:3]
    assert later.finish_reason == "stop" and len(later.output_ids) == 4
    plain = engine.generate("hello", sampling_params=dict(temperature=0, max_new_tokens=9))
    assert later.output_ids[:3] == plain.output_ids[:3]  # the mask moved nothing else
    free = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    text = engine.generate("tell me", sampling_params=free).text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = engine.generate("tell me", sampling_params=dict(free, stop=stop))
    kept = engine.generate("tell me", sampling_params=dict(free, stop=stop, no_stop_trim=True))
    assert kept.text == cut.text + stop and kept.text.startswith(text[: len(kept.text)])
    assert not cut.text.endswith(stop)


def test_prompt_logprobs_match_reference(tiny_dir, make_engine):
    """`logprob_start_len`: each prompt token's logprob from the logits before it, exact against
    transformers, over chunked prefill; the prefix cache serves none of those positions, so a
    prompt seen before gives the same ones."""
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path, chunked_prefill_size=5, page_size=4)
    prompt = random_prompts(1, engine.model_config.vocab_size, [14], seed=31)[0]
    params = dict(max_new_tokens=2, temperature=0, return_logprob=True, top_logprobs_num=3)
    engine.generate(input_ids=prompt, sampling_params=params)  # its pages are cached now
    asked = dict(params, logprob_start_len=6)
    result = engine.generate(input_ids=prompt, sampling_params=asked)
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    pairs, tops = result.meta["input_token_logprobs"], result.meta["input_top_logprobs"]
    assert [t for _, t in pairs] == prompt[6:]
    for p, ((logprob, token), top) in enumerate(zip(pairs, tops), start=6):
        assert math.isclose(logprob, float(ref[p - 1, token]), abs_tol=1e-4)
        assert [t for t, _ in top] == ref[p - 1].topk(3).indices.tolist()
    assert result.meta["output_token_logprobs"][0][0] == pytest.approx(
        float(ref[-1].max()), abs=1e-4
    )
    first = engine.generate(input_ids=prompt, sampling_params=dict(asked, logprob_start_len=0))
    assert first.meta["input_token_logprobs"][0][0] is None  # nothing predicts the first token
    again = first.meta["input_token_logprobs"][6:]
    assert [t for _, t in again] == prompt[6:]
    assert [lp for lp, _ in again] == pytest.approx([lp for lp, _ in pairs], abs=1e-4)
