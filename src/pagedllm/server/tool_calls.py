"""Tool calls (OpenAI's `tools`/`tool_choice`): the model's call format, the
constraint that forces a call, and the parser that finds calls in its output.

Owns: which call format a chat template teaches ("hermes": Hermes, Qwen and
SmolLM2's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, several
allowed; "llama3_json": Llama 3.1's bare `{"name": ..., "parameters": ...}`,
possibly after `<|python_tag|>`), the system prompt that teaches the tools to
a model whose template ignores them, the rewriting of `tool_calls`/`tool`
messages for such a template, the StructuredOutput for "required" and a named
function, the parser for "auto", and reading an output as it streams (text
that may be the start of a call is not sent as content; a call becomes
OpenAI's tool-call deltas, a forced call's arguments in fragments as they
come). Does not own: the request's fields and their checks (protocol.py) or
the HTTP shapes (app.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_TOOLS_WORD = re.compile(r"\btools\b")
_TOOL_CALLS_WORD = re.compile(r"\btool_calls\b")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolPlan:
    """What a chat request's tools mean for this model: the tools as the template
    reads them (`template_tools`: None when the template ignores tools and they go
    in the system prompt, or when tool_choice is "none"), the call format, the
    constraint that forces a call ("required", a named function), and the names
    "auto" parses for (None: no parsing, tool_choice "none")."""

    tools: list[dict[str, Any]]
    choice: str  # "none", "auto", "required" or the forced function's name
    fmt: str
    template: str | None
    constraint: Any = None  # a StructuredOutput
    names: set[str] | None = None
    forced: list[str] = field(default_factory=list)  # the names a forced call may take

    @classmethod
    def build(
        cls,
        tools: list[dict[str, Any]],
        choice: str,
        forced: list[dict[str, Any]],
        template: str | None,
    ) -> ToolPlan:
        plan = cls(tools, choice, call_format(template), template)
        if choice != "none":
            plan.names = {t["function"]["name"] for t in tools}
        if forced:
            from pagedllm.structured import StructuredOutput

            plan.forced = [t["name"] for t in forced]
            plan.constraint = StructuredOutput(grammar=call_grammar(forced, plan.fmt))
        return plan

    @property
    def parses(self) -> bool:
        return self.names is not None

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation for the template (`template_messages`). With tool_choice
        "none" the model is not told of the tools (vLLM can do the same), so that
        it writes plain text."""
        return template_messages(messages, self.template_tools_or_prompt(), self.template)

    def template_tools_or_prompt(self) -> list[dict[str, Any]] | None:
        return self.tools if self.choice != "none" and self.tools else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """`tools=` for a template that renders them."""
        tools = self.template_tools_or_prompt()
        if tools and template_reads_tools(self.template):
            return {"tools": tools}
        return {}


# ------------------------------------------------------------ the template's side


def template_reads_tools(template: str | None) -> bool:
    """The template renders `tools` itself (Llama 3.1, Qwen, Hermes); SmolLM2's GGUF
    template and Llama 3.0's do not, and then the tools go in a system prompt."""
    return template is not None and bool(_TOOLS_WORD.search(template))


def template_reads_tool_calls(template: str | None) -> bool:
    return template is not None and bool(_TOOL_CALLS_WORD.search(template))


def call_format(template: str | None) -> str:
    """The call format the template teaches: Llama 3.1's JSON when it speaks of
    `<|python_tag|>` or of "parameters" without `<tool_call>` tags; else the
    tags (also for a template that ignores tools: our system prompt teaches them)."""
    if template is None or TOOL_CALL_OPEN in template or not template_reads_tools(template):
        return HERMES
    if PYTHON_TAG in template or "parameters" in template:
        return LLAMA3_JSON
    return HERMES


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """Hermes's tool prompt (what Qwen 2.5's template writes), for a template that
    does not render `tools`: the model learns the tools and the tag format."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, template: str | None
) -> list[dict[str, Any]]:
    """The conversation as the template expects it. A template that reads
    `tool_calls` gets them as transformers passes them (`arguments` parsed
    into a dict, as vLLM does: Llama 3.1's template writes `arguments | tojson`).
    One that does not gets them as text in the call format, `tool` messages
    wrapped in `<tool_response>` tags, and the tools in the system prompt."""
    out = []
    reads_calls = template_reads_tool_calls(template)
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls and reads_calls:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])},
                }
                for c in calls
            ]
        elif calls:
            text = "\n".join(
                f"{TOOL_CALL_OPEN}\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _loads(c["function"]["arguments"]),
                    },
                    ensure_ascii=False,
                )
                + f"\n{TOOL_CALL_CLOSE}"
                for c in calls
            )
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
            del m["tool_calls"]
        elif m.get("role") == "tool" and not reads_calls:
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if not reads_calls:
            m.pop("tool_call_id", None)
        out.append(m)
    if tools and not template_reads_tools(template):
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads(arguments: Any) -> Any:
    """A call's arguments as data (they come as a JSON string); text that is not
    JSON stays text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# ------------------------------------------------------------ forcing a call


def call_affixes(name: str, fmt: str) -> tuple[str, str]:
    """The fixed text before and after a forced call's arguments."""
    if fmt == LLAMA3_JSON:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"
    head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    return f"{TOOL_CALL_OPEN}\n{head}", f"}}\n{TOOL_CALL_CLOSE}"


def call_grammar(tools: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """A Lark grammar (llguidance's dialect) for exactly one call to one of `tools`
    (each `{"name", "parameters"}`), written as the format writes it: the name
    a fixed string, the arguments `%json` of the parameters' schema, closed to
    the listed properties (`additionalProperties: false` where unsaid, as a
    strict schema is) and compact, so that a small model cannot wander."""
    from pagedllm.structured.constraint import _strict

    rules, names = [], []
    for i, tool in enumerate(tools):
        # No parameters: a function of none, `{}` (an open object would let the model
        # invent keys forever).
        schema = dict(_strict(tool.get("parameters") or {"type": "object", "properties": {}}))
        schema["x-guidance"] = {"whitespace_flexible": False}
        prefix, suffix = call_affixes(tool["name"], fmt)
        rules += [
            f"call_{i}: {json.dumps(prefix)} args_{i} {json.dumps(suffix)}",
            f"args_{i}: %json {json.dumps(schema)}",
        ]
        names.append(f"call_{i}")
    return "start: " + " | ".join(names) + "\n" + "\n".join(rules)


# ------------------------------------------------------------ finding calls


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's output: every `<tool_call>{...}</tool_call>`
    (the last may lack its closing tag: the model stopped after the JSON), or
    else the whole output as Llama 3.1's JSON call(s) (after an optional
    `<|python_tag|>`, several separated by ";"). A call is a JSON object with a
    string "name" (one of `names`, when given) and an object "arguments" or
    "parameters"; anything else stays content. Content is None when the
    output is only calls."""
    calls: list[ToolCall] = []
    if TOOL_CALL_OPEN in text:
        content_parts, rest = [], text
        while True:
            start = rest.find(TOOL_CALL_OPEN)
            if start < 0:
                content_parts.append(rest)
                break
            end = rest.find(TOOL_CALL_CLOSE, start)
            body = rest[start + len(TOOL_CALL_OPEN) : end if end >= 0 else len(rest)]
            call = _call(body, names)
            if call is None:  # not a call after all: the text stays as written
                stop = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(rest)
                content_parts.append(rest[:stop])
                rest = rest[stop:]
                continue
            content_parts.append(rest[:start])
            calls.append(call)
            if end < 0:
                break
            rest = rest[end + len(TOOL_CALL_CLOSE) :]
        if calls:
            content = "".join(content_parts).strip()
            return content or None, calls
        return text, []
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if body.startswith("{"):
        for piece in _split_calls(body):
            call = _call(piece, names)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls
    return text, []


def _split_calls(body: str) -> list[str]:
    """JSON objects one after another, separated by ";" or whitespace."""
    decoder = json.JSONDecoder()
    pieces, pos = [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            return [body]  # not JSON objects: _call refuses it whole
        pieces.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return pieces


def _call(body: str, names: set[str] | None) -> ToolCall | None:
    try:
        data = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict) or (names is not None and data["name"] not in names):
        return None
    return ToolCall(data["name"], json.dumps(args, ensure_ascii=False))


def head_delta(k: int, call: ToolCall) -> dict[str, Any]:
    """A streamed call's first delta: its index, id and name, no arguments yet."""
    return {
        "tool_calls": [
            {
                "index": k,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
        ]
    }


def args_delta(k: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": k, "function": {"arguments": fragment}}]}


class ToolStream:
    """The streaming side of "auto": `feed` each new text, get back (content to
    send now, tool-call deltas); text from the first place a call may begin (a
    `<tool_call>` tag or a prefix of one at the end, or an output that so far
    is only whitespace, `<|python_tag|>` or JSON's opening brace) is held back
    until `finish`, which parses it and returns the rest of the content and each
    call's deltas (head, then its arguments). After `finish`: `calls`."""

    def __init__(self, names: set[str] | None) -> None:
        self.names = names
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.calls: list[ToolCall] = []

    def feed(self, new: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += new
        safe = self._safe_end()
        if safe <= self.sent:
            return "", []
        out, self.sent = self.text[self.sent : safe], safe
        return out, []

    def _safe_end(self) -> int:
        text = self.text
        head = text.lstrip()
        if self.sent == 0 and (
            not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
        ):
            return 0  # may be a JSON call: hold it all
        tag = text.find(TOOL_CALL_OPEN, self.sent)
        if tag >= 0:
            return tag
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held = self.text[self.sent :]
        content, self.calls = parse_tool_calls(held, self.names)
        if not self.calls:
            return held, []
        deltas = []
        for k, call in enumerate(self.calls):
            deltas += [head_delta(k, call), args_delta(k, call.arguments)]
        return content or "", deltas


class ForcedCallStream:
    """The streaming side of a forced call ("required", a named function): the
    grammar fixes the text around the arguments, so the call's name is known
    once its prefix is written, and the arguments stream as they come (all but
    the last characters, which may be the fixed suffix). Same interface as
    ToolStream; `calls` holds the call once its prefix is in, its arguments
    as the model wrote them (compact JSON)."""

    def __init__(self, names: Sequence[str], fmt: str) -> None:
        self.prefixes = {call_affixes(n, fmt)[0]: n for n in names}
        self.suffix = call_affixes("", fmt)[1]  # the same for every name
        self.text = ""
        self.sent = 0  # where the arguments sent so far end
        self.calls: list[ToolCall] = []

    def feed(self, new: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += new
        deltas = []
        if not self.calls:
            found = next(
                ((p, n) for p, n in self.prefixes.items() if self.text.startswith(p)), None
            )
            if found is None:
                return "", []
            self.calls.append(ToolCall(found[1], ""))
            self.sent = len(found[0])  # the arguments begin after the prefix
            deltas.append(head_delta(0, self.calls[0]))
        return "", deltas + self._args(max(len(self.text) - len(self.suffix), self.sent))

    def _args(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        fragment, self.sent = self.text[self.sent : end], end
        self.calls[0].arguments += fragment
        return [args_delta(0, fragment)]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if not self.calls:  # cut short before the name was written: the text as it is
            return self.text, []
        end = len(self.text) - len(self.suffix) if self.text.endswith(self.suffix) else None
        return "", self._args(len(self.text) if end is None else end)


def output_stream(plan: ToolPlan) -> ToolStream | ForcedCallStream:
    """The stream that reads one choice's output under `plan`."""
    if plan.forced:
        return ForcedCallStream(plan.forced, plan.fmt)
    return ToolStream(plan.names)
