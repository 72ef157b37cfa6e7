"""The OpenAI API's request bodies, as pydantic models (vLLM's accepted fields).

Owns: field names, types and ranges of what clients send, and the translation
of a body into `SamplingParams`. Unknown fields are ignored, as OpenAI does;
a wrong type or an out-of-range value becomes a 400 naming the field
(app.py turns pydantic's errors into OpenAI's error shape). Every text a
tokenizer will read is `Text`: valid Unicode, so a lone surrogate (JSON's
"\\ud800" escape decodes to one, and UTF-8 cannot encode it) is a 400 naming
the field, not a tokenizer's UnicodeEncodeError.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    model_validator,
)

from pagedllm.sampling_params import SamplingParams

MAX_N = 8  # choices per request
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def _unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            code = ord(text[e.start])
            raise ValueError(
                f"has a lone surrogate (U+{code:04X}) at character {e.start}: "
                f"not valid Unicode text"
            ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
StopText = Annotated[str, StringConstraints(max_length=MAX_STOP_LENGTH), AfterValidator(_unicode)]
StopItem = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_unicode)
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: Text


class CalledFunction(_Body):
    name: Text
    arguments: Text  # a JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    """A call in an earlier assistant turn (what the server answered)."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns: the call this answers
    name: Text | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r}")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (developer is the system role)."""
        out: dict[str, Any] = {
            "role": self.role if self.role != "developer" else "system",
            "content": self.text(),
        }
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            if self.content is None:
                out["content"] = None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


Stop = StopText | Annotated[list[StopItem], Field(max_length=MAX_STOP_STRINGS)]


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # "schema" is a pydantic BaseModel attribute: read under an alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extension (extra_body), one of json, regex,
    choice, grammar or json_object, and its option for compact JSON."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None


class _Sampling(_Body):
    """The fields chat and completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: Stop | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # Constrained decoding (issue 37): OpenAI's field, vLLM's extension, and vLLM's
    # older guided_* fields, so that clients written for either work.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + index  # n choices differ
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=seed,
            stop=stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured=self.structured(),
        )

    def structured(self) -> Any:
        """The request's constraint (a `structured.StructuredOutput`), or None.
        ValueError naming the field: two constraints at once, or one that does
        not compile (a malformed schema, regex or grammar)."""
        given: dict[str, tuple[str, Any]] = {}  # field -> (kind, value)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given["response_format"] = ("json_object", True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            given["response_format"] = ("json", rf.json_schema.json_schema)
        so = self.structured_outputs
        if so is not None:
            kinds = [
                (k, v)
                for k, v in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                    ("json_object", so.json_object or None),
                )
                if v is not None
            ]
            if len(kinds) > 1:
                raise ValueError(
                    "structured_outputs: give one of json, regex, choice, grammar, json_object"
                )
            if kinds:
                given["structured_outputs"] = kinds[0]
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                given[name] = (kind, getattr(self, name))
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: give one constraint, not {len(given)}")
        ((field, (kind, value)),) = given.items()
        options: dict[str, Any] = {}
        if so is not None and so.disable_any_whitespace:
            options["whitespace"] = "compact"
        strict = rf.json_schema.strict if rf is not None and rf.json_schema is not None else None
        if so is not None and so.disable_additional_properties is not None:
            strict = so.disable_additional_properties
        if strict is not None:
            options["strict"] = strict
        from pagedllm.structured import StructuredOutput

        try:
            if kind not in ("json", "json_object"):
                options.pop("whitespace", None)
                options.pop("strict", None)
            return StructuredOutput(**{kind: value}, **options)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Body):
    name: str | None = None  # checked in ChatCompletionRequest.tool_plan, for its message
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FieldError(ValueError):
    """A bad value with the field it is in (`param` of the 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tools(
    tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None, template: str | None
) -> Any:
    """`tools` and `tool_choice` checked (FieldError naming the field), as a
    `tool_calls.ToolPlan` for the model's chat template. Without tools, a plan
    that parses nothing (tool_choice "none")."""
    from pagedllm.server import tool_calls
    from pagedllm.structured import StructuredOutput

    tools = tools or []
    choice = tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools and choice != "none":
        raise FieldError("tool_choice", "needs tools: give the functions the model may call")
    seen: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        where = f"tools.{i}.function"
        if not f.name:
            raise FieldError(f"{where}.name", "a function tool needs a name")
        if not _FUNCTION_NAME.fullmatch(f.name):
            raise FieldError(
                f"{where}.name",
                f"{f.name[:70]!r} is not a function name: use 1 to 64 letters, digits, '_' or '-'",
            )
        if f.name in seen:
            raise FieldError(f"{where}.name", f"two tools are named {f.name!r}")
        if f.parameters is not None:
            try:
                StructuredOutput(json=f.parameters)
            except ValueError as e:
                raise FieldError(f"{where}.parameters", str(e)) from None
        seen[f.name] = {"name": f.name, "parameters": f.parameters}
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise FieldError(
                "tool_choice.function.name",
                f"no tool is named {choice.function.name[:70]!r}; name one of {', '.join(seen)}",
            )
        forced = [seen[choice.function.name]]
    else:
        forced = list(seen.values()) if choice == "required" else []
    plan = tool_calls.ToolPlan.build(
        [t.model_dump(exclude_none=True) for t in tools],
        choice if isinstance(choice, str) else choice.function.name,
        forced,
        template,
    )
    return plan


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; "auto" parses every call anyway
    _tool_plan: Any = PrivateAttr(default=None)

    def tool_plan(self, template: str | None) -> Any:
        """The request's tools checked (`check_tools`), kept for `structured()`."""
        self._tool_plan = check_tools(self.tools, self.tool_choice, template)
        return self._tool_plan

    def structured(self) -> Any:
        """A forced tool call's constraint, or the response_format's (not both)."""
        plan = self._tool_plan
        if plan is None or plan.constraint is None:
            return super().structured()
        if super().structured() is not None:
            raise FieldError(
                "tool_choice",
                "a forced tool call cannot also follow response_format or another "
                "constraint: give one",
            )
        return plan.constraint

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's limit for completions

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens or 16  # OpenAI's default for completions

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: Text | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # rendered with the messages, as chat completions does
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
