"""The public Engine API: results, streaming, bad input, aborts by the consumer."""

from __future__ import annotations

import time

import pytest

from dserve.runtime import Engine, SamplingParams
from tests.conftest import random_prompts
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


def test_stream_reassembles_into_the_result(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path)
    sent = time.perf_counter()
    chunks = list(engine.generate_stream("Tell me a story about a robot", sampling_params=GREEDY))
    done = time.perf_counter()
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    result = chunks[-1].result
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.output_ids
    ids = engine.tokenizer.encode("Tell me a story about a robot")
    assert result.output_ids == hf_greedy(path, ids, 16)
    assert result.meta["prompt_tokens"] == len(ids) and result.meta["ttft"] > 0
    # its arrival on the host's clock, for a client's own marks (bench.pd_overhead)
    assert sent <= result.meta["arrival_s"] + 1e-6 and result.meta["arrival_s"] <= done


def test_consumer_that_stops_early_aborts_and_frees(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("glm4_moe"))
    stream = engine.generate_stream(
        input_ids=[10, 11, 12, 13], sampling_params=SamplingParams(max_new_tokens=50)
    )
    next(stream)
    next(stream)
    stream.close()
    assert engine.requests == {} and engine.group_of == {} and engine.groups[0].kv.tables == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[""]), "empty"),
        (dict(input_ids=[[]]), "empty"),
        (dict(input_ids=[[1, 2, 100000]]), "unknown token ids"),
        (dict(input_ids=[[1, 2.5]]), "unknown token ids"),
        (dict(input_ids=[list(range(6, 506)) * 3]), "context"),
        (dict(prompts=["hi"], sampling_params=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (dict(prompts=["hi"], sampling_params={"temperature": -0.5}), "temperature"),
        (dict(prompts=["hi"], sampling_params={"top_p": 0}), "top_p"),
        (dict(prompts=["hi"], sampling_params={"bogus": 1}), "bogus"),
    ],
)
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(
    tiny_dir, make_engine, kwargs, message
):
    path = tiny_dir("deepseek_v3")
    engine = make_engine(path)
    prompt = random_prompts(1, engine.model_config.vocab_size, [9], seed=31)[0]
    stream = engine.generate_stream(input_ids=prompt, sampling_params=GREEDY)
    first = next(stream)
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    rest = list(stream)
    output = first.token_ids + [t for c in rest for t in c.token_ids]
    assert output == hf_greedy(path, prompt, 16)


def test_single_and_list_inputs(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v2"))
    single = engine.generate("Hello", sampling_params=GREEDY)
    listed = engine.generate(["Hello", "world"], sampling_params=GREEDY)
    assert (
        isinstance(listed, list) and len(listed) == 2 and listed[0].output_ids == single.output_ids
    )
    by_ids = engine.generate(input_ids=engine.tokenizer.encode("Hello"), sampling_params=GREEDY)
    assert by_ids.output_ids == single.output_ids


def test_context_manager_and_unknown_architecture(tiny_dir, tmp_path):
    with Engine(tiny_dir("deepseek_v3"), device="cpu", load_progress=False) as engine:
        assert engine.generate("Hi", sampling_params=GREEDY).finish_reason == "length"
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(
        ValueError, match="unknown architecture.*LlamaForCausalLM.*DeepseekV3ForCausalLM"
    ):
        Engine(str(tmp_path), device="cpu")


def test_every_engine_keyword_is_a_cli_flag():
    import dataclasses

    from dserve.runtime.cli import build_parser, engine_kwargs
    from dserve.runtime.config import EngineConfig

    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--model",
            "/m",
            "--tp",
            "4",
            "--dp-size",
            "2",
            "--page-size",
            "8",
            "--no-enable-prefix-caching",
            "--dtype",
            "bfloat16",
        ]
    )
    kwargs = engine_kwargs(args)
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model_path"}
    assert kwargs["tp_size"] == 4 and kwargs["dp_size"] == 2 and kwargs["page_size"] == 8
    assert kwargs["enable_prefix_caching"] is False and kwargs["dtype"] == "bfloat16"
