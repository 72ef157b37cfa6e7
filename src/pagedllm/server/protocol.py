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

from typing import Annotated, Literal

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
        )

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
