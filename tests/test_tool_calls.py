"""server/tool_calls.py alone (issue 37 item 3): the "auto" parser on fixed model
outputs of each format, the streaming hold-back, the call format a template
teaches, and the conversation as a template renders it (Qwen 2.5's template,
which reads `tools` and `tool_calls`; SmolLM2's GGUF template, which reads
neither). The server's side, with a model, is tests/test_server_tools.py."""

from __future__ import annotations

import json

import pytest

from pagedllm.server.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ForcedCallStream,
    ToolPlan,
    ToolStream,
    call_format,
    call_grammar,
    parse_tool_calls,
)
from pagedllm.tokenizer.chat_template import render_chat_template
from test_tokenizer_qwen import QWEN25_TEMPLATE

# SmolLM2-135M-Instruct's GGUF template, as the file ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The lines of Llama 3.1's template that say how it calls (the whole is 5 KB).
LLAMA31_EXCERPT = (
    '{%- if tools is not none %}{{- \'Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.\' }}{%- endif %}'
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}"
)
SPECIAL = {"bos_token": "", "eos_token": "<|im_end|>"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _calls(text, names=None):
    content, calls = parse_tool_calls(text, names)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_tags_several_calls_and_the_text_around_them():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert _calls(text) == (
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    )


def test_hermes_call_only_has_no_content_and_the_last_tag_may_be_unclosed():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}'
    assert _calls(text) == (None, [("f", {"a": [1, 2]})])


def test_arguments_written_as_a_json_string_are_read_as_data():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _calls(text) == (None, [("f", {"a": 1})])


def test_a_tag_that_holds_no_call_stays_content():
    text = "Use <tool_call>like this</tool_call> to call."
    assert _calls(text) == (text, [])


def test_llama31_json_call_with_and_without_the_python_tag():
    for text in (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '  {"name": "get_weather", "parameters": {"city": "Oslo"}}\n',
    ):
        assert _calls(text) == (None, [("get_weather", {"city": "Oslo"})]), text


def test_llama31_several_calls_separated_by_semicolons():
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert _calls(text) == (None, [("f", {"a": 1}), ("g", {})])


def test_json_that_is_not_a_call_stays_content():
    for text in ('{"city": "Paris"}', '{"name": "f", "parameters": 3}', "{not json", "[1, 2]"):
        assert _calls(text) == (text, []), text
    # A call to a function the request did not offer is text too.
    text = '{"name": "rm_rf", "parameters": {}}'
    assert _calls(text, {"get_weather"}) == (text, [])


def test_plain_text_is_content():
    assert _calls("It is sunny in Paris.") == ("It is sunny in Paris.", [])


def test_call_ids_are_openai_shaped_and_distinct():
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    ids = [c.as_openai()["id"] for c in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert calls[0].as_openai()["function"] == {"name": "f", "arguments": "{}"}


def _stream(pieces, names=None):
    s = ToolStream(names)
    fed = [s.feed(p) for p in pieces]
    assert all(deltas == [] for _, deltas in fed)  # calls come out at the end
    content, deltas = s.finish()
    calls = [(c.name, json.loads(c.arguments)) for c in s.calls]
    assert deltas == [d for k, c in enumerate(s.calls) for d in _deltas(k, c, [c.arguments])]
    return [text for text, _ in fed], content, calls


def _deltas(k, call, fragments):
    """OpenAI's stream of one call: index, id, type and name, then the arguments."""
    head = {"index": k, "id": call.id, "type": "function"}
    head["function"] = {"name": call.name, "arguments": ""}
    return [{"tool_calls": [head]}] + [
        {"tool_calls": [{"index": k, "function": {"arguments": f}}]} for f in fragments
    ]


def test_stream_sends_plain_text_as_it_comes():
    sent, content, calls = _stream(["It is ", "sunny."])
    assert sent == ["It is ", "sunny."] and content == "" and calls == []


def test_stream_holds_back_from_a_tag_or_a_prefix_of_one():
    pieces = ["Sure <to", "ol_call>\n", '{"name": "f", ', '"arguments": {}}', "\n</tool_call>"]
    sent, content, calls = _stream(pieces)
    assert "".join(sent) == "Sure " and sent[0] == "Sure "
    assert content == "" and calls == [("f", {})]
    # A "<" that turns out not to start a tag is sent once it cannot.
    sent, content, _ = _stream(["a <", "b"])
    assert sent == ["a ", "<b"] and content == ""


def test_stream_holds_back_an_output_that_may_be_a_json_call():
    sent, content, calls = _stream(["<|python", '_tag|>{"name": "f", "parameters": {"x": 1}}'])
    assert sent == ["", ""] and content == "" and calls == [("f", {"x": 1})]
    # JSON that is no call comes out whole at the end.
    sent, content, calls = _stream(["{", '"a": 1}'])
    assert sent == ["", ""] and content == '{"a": 1}' and calls == []


def test_call_format_follows_the_template():
    assert call_format(QWEN25_TEMPLATE) == HERMES
    assert call_format(SMOLLM2_TEMPLATE) == HERMES  # ignores tools: our prompt teaches tags
    assert call_format(LLAMA31_EXCERPT) == LLAMA3_JSON
    assert call_format(None) == HERMES


def _render(template, messages, tools, choice="auto"):
    plan = ToolPlan.build(tools, choice, [], template)
    return render_chat_template(
        template,
        plan.messages(messages),
        add_generation_prompt=True,
        special_tokens=SPECIAL,
        **plan.template_kwargs,
    )


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_qwen_template_gets_tools_and_tool_calls_as_transformers_passes_them():
    text = _render(QWEN25_TEMPLATE, CONVERSATION, [WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    # The arguments as data (tojson of a dict), not a JSON string quoted again.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>' in text


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt():
    text = _render(SMOLLM2_TEMPLATE, CONVERSATION, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response>' in text
    # tool_choice "none": the model is not told of the tools.
    assert "# Tools" not in _render(SMOLLM2_TEMPLATE, CONVERSATION, [WEATHER], "none")


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_call_grammar_compiles_for_each_format(fmt):
    pytest.importorskip("llguidance")
    from pagedllm.structured import StructuredOutput

    tools = [
        {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
        {"name": "no_args", "parameters": None},
    ]
    grammar = call_grammar(tools, fmt)
    assert grammar.startswith("start: call_0 | call_1\n")
    key = "arguments" if fmt == HERMES else "parameters"
    assert f'\\"name\\": \\"get_weather\\", \\"{key}\\": ' in grammar
    assert '"additionalProperties": false' in grammar  # closed, as a strict schema
    StructuredOutput(grammar=grammar)  # llguidance accepts it


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_a_forced_call_streams_its_name_then_its_arguments_as_they_come(fmt):
    prefix, suffix = {
        HERMES: ('<tool_call>\n{"name": "get_time", "arguments": ', "}\n</tool_call>"),
        LLAMA3_JSON: ('{"name": "get_time", "parameters": ', "}"),
    }[fmt]
    text = prefix + '{"zone":"UTC"}' + suffix
    cuts = [3, len(prefix) - 1, len(prefix) + 4, len(prefix) + 9, len(text) - 2, len(text)]
    s = ForcedCallStream(["get", "get_time"], fmt)
    fed = [s.feed(text[a:b]) for a, b in zip([0, *cuts], cuts)]
    end = s.finish()
    assert all(content == "" for content, _ in [*fed, end])
    (call,) = s.calls
    assert call.name == "get_time" and call.arguments == '{"zone":"UTC"}'
    deltas = [d for _, ds in [*fed, end] for d in ds]
    # No delta before the name is whole; the suffix never reaches the arguments.
    assert fed[0][1] == [] and fed[1][1] == []
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert deltas == _deltas(0, call, fragments) and len(fragments) >= 2
    assert "".join(fragments) == '{"zone":"UTC"}'


def test_a_forced_call_cut_before_its_name_is_text():
    s = ForcedCallStream(["f"], HERMES)
    assert s.feed("<tool_ca") == ("", [])
    assert s.finish() == ("<tool_ca", []) and s.calls == []
