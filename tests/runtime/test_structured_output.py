"""Structured output on the engine: JSON-schema outputs that parse and validate, regex outputs
that match, an EBNF grammar, sampled and greedy, with overlapped scheduling on and off, under
speculative decoding (such requests decode without drafts) and across TP ranks; bad grammars and
conflicting fields are refused."""

from __future__ import annotations

import json
import re

import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{2,3} [a-z]{1,6}\."


def validate(value, schema: dict) -> None:
    """The checks of SCHEMA's keywords (types, bounds, enum, pattern, required, extra keys)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            validate(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"]
        for item in value:
            validate(item, schema["items"])
    elif kind == "integer":
        assert isinstance(value, int) and schema["minimum"] <= value <= schema["maximum"]
    elif kind == "string":
        assert isinstance(value, str) and re.fullmatch(schema["pattern"], value)
    if "enum" in schema:
        assert value in schema["enum"]


def check_json(text: str) -> dict:
    value = json.loads(text)
    validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_json_schema_and_regex(tiny_dir, make_engine, overlap):
    engine = make_engine(tiny_dir("deepseek_v3"), disable_overlap_schedule=not overlap)
    sampled = [dict(temperature=1.0, seed=s, max_new_tokens=60) for s in range(4)]
    params = [dict(p, json_schema=json.dumps(SCHEMA)) for p in sampled]
    params.append(dict(temperature=0, max_new_tokens=60, json_schema=json.dumps(SCHEMA)))
    plain = ["hello"] * len(params)
    results = engine.generate(plain, sampling_params=params)
    for r in results:
        assert r.finish_reason == "stop", r.text  # the grammar ended it (EOS)
        check_json(r.text)
    assert len({r.text for r in results}) > 1
    matched = engine.generate(
        ["a", "b", "c"], sampling_params=[dict(p, regex=REGEX) for p in sampled[:3]]
    )
    for r in matched:
        assert re.fullmatch(REGEX, r.text) and r.finish_reason == "stop"
    ebnf = 'root ::= "(" num (" + " num)? ")"\nnum ::= [0-9] [0-9]?'
    r = engine.generate("x", sampling_params=dict(sampled[0], ebnf=ebnf, max_new_tokens=30))
    assert re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2})?\)", r.text), r.text


def test_bad_grammars_are_refused(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"))
    cases = [
        (dict(regex="(unclosed"), "regex does not compile"),
        (dict(json_schema="{not json"), "json_schema does not compile"),
        (dict(regex="a", json_schema="{}"), "one grammar"),
        (dict(regex="a", ignore_eos=True), "ignore_eos"),
        (dict(regex="a", min_new_tokens=2), "min_new_tokens"),
        (dict(regex=5), "regex must be a string"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate("x", sampling_params=params)
    assert engine.generate("x", sampling_params=dict(regex="ok", max_new_tokens=4)).text == "ok"


def test_with_speculative_decoding(tiny_dir, make_engine):
    """A constrained request decodes without drafts beside drafting ones: valid output, and
    the greedy unconstrained one keeps the target's tokens."""
    path = tiny_dir("deepseek_v3", mtp=True)
    engine = make_engine(path, speculative_algorithm="mtp", speculative_num_steps=2)
    free = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    want = make_engine(path).generate("hello", sampling_params=free).output_ids
    params = [
        free,
        dict(temperature=0.8, seed=3, max_new_tokens=60, json_schema=json.dumps(SCHEMA)),
    ]
    plain, constrained = engine.generate(["hello", "hi"], sampling_params=params)
    assert plain.output_ids == want and plain.meta["spec_verify_ct"] >= 1
    check_json(constrained.text)
    assert "spec_verify_ct" not in constrained.meta


@pytest.mark.slow
def test_tp2_matches_one_rank(tiny_dir, make_engine):
    """Every rank of the attention group masks alike: TP 2 draws what one rank draws."""
    path = tiny_dir("glm4_moe")
    params = [
        dict(temperature=1.0, seed=s, max_new_tokens=50, json_schema=json.dumps(SCHEMA))
        for s in range(2)
    ]
    params.append(dict(temperature=1.0, seed=9, max_new_tokens=30, regex=REGEX))
    prompts = ["one", "two", "three"]
    one = make_engine(path).generate(prompts, sampling_params=params)
    two = make_engine(path, tp_size=2).generate(prompts, sampling_params=params)
    assert [r.output_ids for r in two] == [r.output_ids for r in one]
    for r in two[:2]:
        check_json(r.text)


def test_grammar_after_a_text(tiny_dir, make_engine):
    """`grammar_after`: the text up to it is drawn freely (the greedy tokens), the grammar
    holds after it (a reasoning model's answer after `</think>`)."""
    engine = make_engine(tiny_dir("deepseek_v3"))
    free = engine.generate("hello", sampling_params=dict(temperature=0, max_new_tokens=2))
    marker = engine.tokenizer.decode(free.output_ids)
    params = dict(temperature=0, max_new_tokens=40, regex=REGEX, grammar_after=marker)
    result = engine.generate("hello", sampling_params=params)
    assert result.output_ids[:2] == free.output_ids
    assert re.fullmatch(REGEX, result.text[len(marker) :]), result.text
