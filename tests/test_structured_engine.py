"""Constrained decoding through the engine (issue 37): the offline `LLM` with
`SamplingParams(structured=...)` on SmolLM2.

Oracles: `jsonschema` for the outputs; the same greedy requests run alone for
isolation (unconstrained rows are never touched by the masks).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pagedllm import LLM, SamplingParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_path):
    from pagedllm.tokenizer import Tokenizer

    return LLM(model=smollm2, tokenizer=Tokenizer.from_model_path(smollm2_path), kv_cache_mib=32)


def constrained(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0, **kw)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    params = [
        constrained(structured={"json": PERSON, "whitespace": "compact"}),
        SamplingParams(
            max_tokens=80,
            temperature=1.0,
            seed=5,
            structured={"json": PERSON, "whitespace": "compact"},
        ),
    ]
    for out in llm.chat([ASK, ASK], params):
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.chat([HI, ASK], plain)
    mixed = llm.chat(
        [HI, ASK, ASK],
        [plain, plain, constrained(structured={"json": PERSON, "whitespace": "compact"})],
    )
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].text), PERSON)


def test_regex_and_choice(llm):
    date, pick = llm.chat(
        [ASK, ASK],
        [
            constrained(structured={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
            constrained(structured={"choice": ["yes", "no", "maybe"]}),
        ],
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    assert pick.text in ("yes", "no", "maybe") and pick.finish_reason == "stop"


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    (out,) = llm.chat(
        [ASK], [SamplingParams(max_tokens=5, temperature=0, structured={"regex": "a{50}"})]
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert set(out.text) == {"a"} and len(out.text) < 50  # a prefix of what it must write


def test_bad_constraints_are_one_line_value_errors():
    for bad in ({"regex": "("}, {"json": {"type": "nope"}}, {"choice": []}, {"json": 3}):
        with pytest.raises(ValueError) as e:
            SamplingParams(structured=bad)
        assert "\n" not in str(e.value)
