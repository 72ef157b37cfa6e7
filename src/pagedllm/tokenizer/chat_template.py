"""Chat templates: a model's Jinja template rendered the way transformers renders it.

Owns: the sandboxed Jinja environment (the same options, globals and filters
as transformers' `apply_chat_template`), the built-in Llama 3 Instruct template,
and turning any template failure into a `ValueError` that names the cause.
Does not own: tokenizing the result (`Tokenizer.encode`) or where a template
comes from (`loaders.py`).

Templates come from model files, so they are untrusted code: they run in
jinja2's `ImmutableSandboxedEnvironment`, which refuses attribute tricks and
mutation of the inputs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Meta-Llama-3-8B-Instruct's template, used when a Llama 3 model ships none
# (the tokenizer.json of the Llama 3.0 release carries no template).
LLAMA3_INSTRUCT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes "<" and "&".
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text
    with it (for training masks). We only need the body rendered."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text; a syntax error is a ValueError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    **kwargs: Any,
) -> str:
    """Render `source` for `messages`, as transformers' `apply_chat_template(tokenize=False)`.

    The template sees `messages` (keys whose value is None dropped, as
    transformers does), `add_generation_prompt`, `tools`/`documents` (None
    unless given), the special token strings (`bos_token`, `eos_token`, ...),
    and any extra keyword arguments, which win over the special tokens.
    """
    if not messages:
        raise ValueError("chat template: the conversation is empty; give at least one message")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat template: a message must be a mapping, got {message!r}")
        chat.append({k: v for k, v in message.items() if v is not None})
    template = compile_template(source)
    context = {
        "tools": None,
        "documents": None,
        **special_tokens,
        **kwargs,
        "messages": chat,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return template.render(**context)
    except _TemplateRaised as e:
        raise ValueError(f"chat template refused the conversation: {e}") from e
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # a template is code: TypeError, KeyError, ... all land here
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
