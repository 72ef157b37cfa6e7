"""Structured output over HTTP (issue 37), with the official `openai` client.

The model is SmolLM2-135M (the default model), sampling at temperature 1 with
a seed per request, so that what it writes is far from what the schema wants
and the constraint alone makes it valid (tests/test_structured.py does the
same with random logits, no model at all). The schemas
(tests/structured_cases.py) bound their free-form parts. Oracle: `jsonschema`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

from server_helpers import MODEL, Server  # noqa: E402
from structured_cases import SCHEMAS  # noqa: E402

# A free-form float has no bound on its digits, and a real model, once writing
# them, may not stop: those two schemas run in tests/test_structured.py only.
HTTP_SCHEMAS = [(label, s) for label, s in SCHEMAS if not label.startswith("number ")]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
CHAT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(smollm2, kv_cache_mib=64, max_num_seqs=64)
    yield s
    s.stop()


def test_every_schema_gives_valid_json_through_the_openai_client(server):
    client = server.client()

    def ask(numbered):
        seed, (label, schema) = numbered
        # Sampled, not greedy: a random model's argmax can repeat one allowed
        # digit forever; a draw ends a free-form number as the schema allows.
        r = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=160,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "case", "schema": schema, "strict": True},
            },
            extra_body=COMPACT,
        )
        return label, schema, r.choices[0]

    with ThreadPoolExecutor(len(HTTP_SCHEMAS)) as pool:
        results = list(pool.map(ask, enumerate(HTTP_SCHEMAS)))
    assert len(results) >= 30
    for label, schema, choice in results:
        assert choice.finish_reason == "stop", (label, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_parse_with_a_pydantic_model_returns_the_object(server):
    class Colour(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        rgb: list[int] = pydantic.Field(min_length=3, max_length=3)

    schema = Colour.model_json_schema()
    for p in (schema["properties"]["rgb"],):
        p["items"] = {"type": "integer", "minimum": 0, "maximum": 255}
    r = server.client().chat.completions.parse(
        model=MODEL,
        messages=CHAT,
        max_tokens=200,
        temperature=0,
        response_format=Colour,
        extra_body=COMPACT,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Colour) and len(parsed.rgb) == 3


def test_json_object_regex_choice_and_grammar_on_completions(server):
    client = server.client()
    cases = [
        ({"response_format": {"type": "json_object"}, **COMPACT}, None),
        ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}, r"[a-c]{3}-[0-9]{2}"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"structured_outputs": {"grammar": 'root ::= "ab" [0-9] "!"'}}, r"ab[0-9]!"),
    ]
    import re

    for extra, pattern in cases:
        r = client.completions.create(
            model=MODEL, prompt="x", max_tokens=300, temperature=0, extra_body=extra
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", (extra, text)
        if pattern is None:
            assert isinstance(json.loads(text), dict)
        else:
            assert re.fullmatch(pattern, text), (extra, text)


BAD = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nope"}},
        }
    },
    {"response_format": {"type": "yaml"}},
    {"structured_outputs": {"regex": "("}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"structured_outputs": {"grammar": 'root ::= "a'}},
    {"guided_choice": []},
    {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
    {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"response_format": {"type": "json_object"}, "guided_regex": "a"},
]


@pytest.mark.parametrize("extra", BAD)
def test_bad_constraints_are_400_naming_the_field(server, extra):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    body = e.value.body
    assert "\n" not in body["message"]
    assert body["param"].split(".")[0] in extra, body  # the field at fault
