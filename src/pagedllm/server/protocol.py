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

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

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


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart] | None = None

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


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

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
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
