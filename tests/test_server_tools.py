"""Tools over HTTP (issue 37 item 3), with the official `openai` client on SmolLM2.

SmolLM2's GGUF template ignores `tools`, so the server teaches them in a system
prompt in the `<tool_call>` format; a forced call ("required", a named
function) is constrained to that format, its arguments to the tool's
parameters (oracle: `jsonschema`). "auto" parsing on fixed outputs of each
format is tests/test_tool_calls.py; here "auto" parses the model's own output,
steered to a call by a regex where a call is wanted.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from server_helpers import MODEL, Server  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(smollm2, kv_cache_mib=64, max_num_seqs=16)
    yield s
    s.stop()


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def plain_and_streamed(client, request: dict):
    """The same request sent plainly and streamed (the openai client assembling the
    stream), batched together: (plain completion, final streamed one, the stream's
    (event type, delta) pairs)."""

    def streamed():
        with client.beta.chat.completions.stream(**request) as stream:
            events = [(e.type, getattr(e, "delta", None)) for e in stream]
            return stream.get_final_completion(), events

    with ThreadPoolExecutor(2) as pool:  # batched together: one run's time
        plain = pool.submit(client.chat.completions.create, **request)
        final, events = streamed()
    return plain.result(), final, events


def test_a_named_tool_choice_gives_a_valid_call(server):
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=1.0,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    _valid(call)


def test_required_with_two_tools_calls_one_of_them(server):
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=80,
        temperature=1.0,
        seed=0,
        n=4,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        _valid(call)


def test_a_streamed_named_call_is_assembled_by_the_openai_client(server):
    client = server.client()
    request = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    plain, final, events = plain_and_streamed(client, request)
    # The arguments came in fragments as the model wrote them, after the name.
    kinds = [kind for kind, _ in events]
    assert kinds.count("tool_calls.function.arguments.delta") >= 2, events
    assert not [d for kind, d in events if kind == "content.delta" and d], events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _valid(call)
    # The same call without streaming: the same arguments (greedy).
    assert plain.choices[0].message.tool_calls[0].function.arguments == (call.function.arguments)


def test_a_tool_message_is_accepted_in_the_next_turn(server):
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=12
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # The call and the tool's answer are in the prompt the model saw (the
    # rendering itself: tests/test_tool_calls.py).
    alone = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + first.usage.completion_tokens


def test_none_gives_plain_text(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16
    )
    choice = r.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        {"messages": [*ASK, {"role": "tool", "content": "21"}]},
        "messages.1",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tools_are_400_naming_the_field(server, extra, param):
    body = {"messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, **body)
    error = e.value.body
    assert "\n" not in error["message"]
    assert error["param"] == param, error


def test_auto_streamed_and_not_give_the_same_message(server):
    """ "auto" parses whatever the model writes (the parser on fixed outputs:
    tests/test_tool_calls.py); a stream, which holds back what may be a call,
    assembles to the same message as the plain reply (greedy, batched together)."""
    client = server.client()
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=24, temperature=0)

    def streamed():  # the deltas accumulated by hand (the helper refuses "length")
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **request):
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
        return content, [calls[k] for k in sorted(calls)], finish

    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(client.chat.completions.create, **request)
        s = streamed()
    p = plain.result().choices[0]
    content, calls, finish = s
    assert p.finish_reason == finish
    assert (p.message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in p.message.tool_calls or []] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert content or calls
    assert all(c["id"].startswith("call_") and c["name"] in SCHEMAS for c in calls)


def _literal(text: str) -> str:
    r"""`text` as a regex that matches only it (llguidance's syntax: its metacharacters
    escaped, a newline as \n)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text).replace("\n", r"\n")


@pytest.mark.parametrize("before", ["", "Let me check.\n"])
def test_auto_turns_a_call_the_model_writes_into_tool_calls(server, before):
    """ "auto" with the model writing a call in the template's format (SmolLM2's
    template ignores tools: our prompt teaches the `<tool_call>` tags). The
    model's output is steered there by a regex (vLLM's structured_outputs, which
    "auto" takes since it forces nothing itself), whose city and unit the model
    picks; the server parses the call out of what it wrote, plain and streamed
    (the openai client assembling the deltas), text before the call staying
    content as the model wrote it."""
    regex = (
        _literal(before + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
        + '[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)'
        + _literal('"}}\n</tool_call>')
    )
    client = server.client()
    request = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    plain, final, events = plain_and_streamed(client, request)
    for choice in (plain.choices[0], final.choices[0]):
        assert choice.finish_reason == "tool_calls", choice
        assert (choice.message.content or "") == before, choice  # as written, vLLM's way
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _valid(call)
        args = json.loads(call.function.arguments)
        assert re.fullmatch("[A-Z][a-z]{2,8}", args["city"]), args
    # A reply that is only a call has no content (null, not ""), as OpenAI's.
    assert plain.choices[0].message.content == (before or None)
    # The same call both ways (greedy), each with its own id.
    a, b = plain.choices[0].message.tool_calls[0], final.choices[0].message.tool_calls[0]
    assert a.function.arguments == b.function.arguments and a.id != b.id
    # The stream sent the text before the call as content, and never the call's text.
    sent = "".join(d for kind, d in events if kind == "content.delta" and d)
    assert sent == before and "tool_call" not in sent
    assert ("tool_calls.function.arguments.done", None) in events


def _tokenize(server, body) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + "/tokenize",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_renders_the_tools_as_chat_completions_does(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1
    )
    status, tokenized = _tokenize(server, {"messages": ASK, "tools": [WEATHER]})
    assert status == 200 and tokenized["count"] == r.usage.prompt_tokens
    assert _tokenize(server, {"messages": ASK})[1]["count"] < tokenized["count"]
    status, error = _tokenize(
        server, {"messages": ASK, "tools": [{"type": "function", "function": {}}]}
    )
    assert status == 400 and error["error"]["param"] == "tools.0.function.name"
