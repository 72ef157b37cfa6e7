"""`StructuredOutput`: what a request's output must match, as a value.

Owns: the constraint's fields and their validation, and its translation into
llguidance's grammar (`grammar`, a JSON string that is also the key the
compile cache uses). Does not own: compiling against a tokenizer or matching
tokens (`matcher.py`). Stdlib only at import: llguidance is imported on the
first constraint built, so that `SamplingParams` (layer 0) can hold one and a
process that never constrains never loads it.

Validation happens at construction, before the request reaches the engine: a
malformed JSON schema, a keyword llguidance does not implement, a bad regex,
an empty choice list or a grammar syntax error is a one-line `ValueError` that
says what is wrong and what to do, so that the server can answer 400 and the
offline API raises at `SamplingParams(...)`. Construction costs about a
millisecond (llguidance builds and checks the grammar without a tokenizer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

WHITESPACE = ("flexible", "compact")
# Keywords whose values are JSON data, not subschemas: `_strict` leaves them alone.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
# Keywords whose values map names to subschemas (a property may be called "properties").
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutput:
    """Exactly one of:

    json: a JSON schema (a dict, its JSON text, or a Pydantic model class);
    json_object: True for any JSON object (OpenAI's `{"type": "json_object"}`);
    regex: a regular expression the whole output must match (the Rust `regex`
        crate's syntax: no look-around, no backreferences);
    choice: a list of strings, the output being exactly one of them;
    grammar: a context-free grammar, in llguidance's Lark dialect
        (`start: ...`, `/regex/` terminals, `%json {...}` for an embedded
        schema) or in llama.cpp's GBNF (`root ::= ...`), converted to Lark.

    Options (JSON only; ignored by the other kinds):
    whitespace: "flexible" (the default, vLLM's: any whitespace between
        tokens, so that a model can indent) or "compact" (none: `{"a":1}`).
    strict: True (the default, as xgrammar's strict mode and OpenAI's strict
        schemas): an object schema that lists `properties` and does not say
        `additionalProperties` gets `additionalProperties: false`, so the
        model writes the listed keys only. False keeps JSON Schema's rule
        (unlisted keys allowed), which lets a model invent keys forever.

    Equal constraints compare and hash equal (by `grammar`), so they share one
    compiled entry in the cache.
    """

    __slots__ = ("kind", "value", "whitespace", "strict", "grammar")

    def __init__(
        self,
        *,
        json: Mapping[str, Any] | str | type | None = None,
        json_object: bool | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        whitespace: str = "flexible",
        strict: bool = True,
    ) -> None:
        given = {
            k: v
            for k, v in (
                ("json", json),
                ("json_object", json_object or None),
                ("regex", regex),
                ("choice", choice),
                ("grammar", grammar),
            )
            if v is not None
        }
        if len(given) != 1:
            named = ", ".join(given) or "none"
            raise ValueError(
                f"a structured output needs exactly one of {', '.join(_KINDS)} (got {named})"
            )
        if whitespace not in WHITESPACE:
            raise ValueError(
                f"whitespace must be one of {', '.join(map(repr, WHITESPACE))}, got {whitespace!r}"
            )
        if not isinstance(strict, bool):
            raise ValueError(f"strict must be true or false, got {strict!r}")
        ((kind, value),) = given.items()
        self.kind: str = kind
        self.whitespace: str = whitespace
        self.strict: bool = strict
        self.value: Any = _normalize(kind, value)
        self.grammar: str = _to_grammar(kind, self.value, whitespace, strict)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and self.grammar == other.grammar

    def __hash__(self) -> int:
        return hash(self.grammar)

    def __repr__(self) -> str:
        value = self.value if len(str(self.value)) <= 80 else f"{str(self.value)[:77]}..."
        opts = (
            f", whitespace={self.whitespace!r}, strict={self.strict}" if self.kind == "json" else ""
        )
        return f"StructuredOutput({self.kind}={value!r}{opts})"

    def as_kwargs(self) -> dict[str, Any]:
        """Plain JSON-able values that rebuild it: `StructuredOutput(**c.as_kwargs()) == c`
        (for messages between processes, msgspec's included)."""
        value = list(self.value) if self.kind == "choice" else self.value
        return {self.kind: value, "whitespace": self.whitespace, "strict": self.strict}

    def __reduce__(self):  # pickled to the engine-core and tokenizer processes
        return (_rebuild, (self.as_kwargs(),))


def _rebuild(kwargs: dict) -> StructuredOutput:
    return StructuredOutput(**kwargs)


def _normalize(kind: str, value: Any) -> Any:
    """The value in its canonical form: a parsed schema, a tuple of choices, the text."""
    if kind == "json":
        if isinstance(value, type) and hasattr(value, "model_json_schema"):
            value = value.model_json_schema()  # a Pydantic model class
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(
                    f"the JSON schema is not valid JSON ({e}): send a JSON object"
                ) from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"a JSON schema must be an object (a dict), got {type(value).__name__}"
            )
        # Round-trip through JSON: a schema that holds a non-JSON value (a set, NaN)
        # is refused here, and the copy cannot change under the caller's edits.
        try:
            return json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"the JSON schema holds a value JSON cannot carry: {e}") from None
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"json_object must be true, got {value!r}")
        return True
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError(f"regex must be a string, got {type(value).__name__}")
        if not value:
            raise ValueError("the regex is empty: give a pattern the output must match")
        return value
    if kind == "choice":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"choice must be a list of strings, got {type(value).__name__}")
        if not value:
            raise ValueError("choice is an empty list: give at least one string")
        if not all(isinstance(c, str) for c in value):
            bad = next(c for c in value if not isinstance(c, str))
            raise ValueError(f"choice must hold strings only, got {bad!r}")
        if not any(value):
            raise ValueError(
                "choice holds only the empty string: give at least one non-empty string"
            )
        return tuple(value)
    # grammar
    if not isinstance(value, str):
        raise ValueError(f"grammar must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(
            "the grammar is empty: give a Lark (start: ...) or GBNF (root ::= ...) grammar"
        )
    return value


def _strict(node: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists
    `properties` and says nothing of extra keys (`enum`/`const`/`default`/
    `examples` are data, not schemas, and are copied as they are).

    An `allOf` is closed as a whole: each of its objects lists only its own
    properties, so closing each alone would forbid the keys of the others
    (and make the schema unsatisfiable). Each is closed over the union of the
    names the parent and the members list, the names it lacks allowed as `{}`.
    """
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema: not a schema itself
            out[k] = {name: _strict(sub) for name, sub in v.items()}
        else:
            out[k] = _strict(v)
    members = node.get("allOf")
    if isinstance(members, list) and all(isinstance(m, dict) for m in members):
        parts = [node, *members]
        if any("$ref" in p for p in parts):  # names behind a reference: leave it as written
            return out
        names: dict[str, None] = {}
        for p in parts:
            if isinstance(p.get("properties"), dict):
                names.update(dict.fromkeys(p["properties"]))
        opened = [out, *out["allOf"]]
        for original, p in zip(parts, opened):
            # Undo what the recursion closed, then close over every name.
            if "properties" in p and "additionalProperties" not in original:
                p["properties"] = {**{n: {} for n in names}, **p["properties"]}
                p["additionalProperties"] = False
        return out
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _to_grammar(kind: str, value: Any, whitespace: str, strict: bool) -> str:
    """llguidance's grammar for the constraint, checked without a tokenizer."""
    import llguidance

    Matcher = llguidance.LLMatcher
    what = {"json": "JSON schema", "json_object": "JSON object", "choice": "choice"}.get(kind, kind)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        if strict:
            schema = _strict(schema)
        options = {"whitespace_flexible": whitespace == "flexible"}
        # OpenAI's strict schemas and Pydantic's both write {"type": ..., "title": ...}:
        # llguidance ignores annotations and refuses only keywords it cannot honour.
        grammar = Matcher.grammar_from_json_schema(schema, overrides=options)
    elif kind == "regex":
        grammar = Matcher.grammar_from_regex(value)
    elif kind == "choice":
        # A Lark alternation of string literals (JSON escapes are Lark's too).
        lark = "start: " + " | ".join(json.dumps(c) for c in value)
        grammar = Matcher.grammar_from_lark(lark)
    else:
        text = value
        if "::=" in value:  # GBNF: llguidance converts it to its Lark
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                text = any_to_lark(value)
            except Exception as e:  # the converter raises plain Exceptions too
                raise ValueError(
                    f"invalid GBNF grammar: {one_line(str(e))}; fix the grammar and resend"
                ) from None
        grammar = Matcher.grammar_from_lark(text)
    error = Matcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        why = one_line(error)
        if why.startswith(f"invalid {kind} "):  # llguidance's own "invalid regex ..."
            why = why[len("invalid ") :]
        raise ValueError(f"invalid {what}: {why}; fix the {what} and resend")
    return grammar


def one_line(message: str) -> str:
    """llguidance's message on one line, without its source excerpts and carets."""
    lines: list[str] = []
    echo = False
    for line in message.splitlines():
        s = line.strip()
        if echo:  # the line after "regex parse error:" echoes the pattern
            echo = False
            if not lines or "invalid regex" not in lines[-1]:
                lines.append(f'in regex "{s}":')
            continue
        if not s or set(s) <= {"^", " "} or re.match(r"^\d+ \|", s) or s == "<non-verbose/>":
            continue
        if s.endswith("regex parse error:"):
            echo = True
            s = s[: -len("regex parse error:")].strip()
            if not s:
                continue
            s = s.rstrip(":") + ":"
        lines.append(s)
    text = " ".join(lines).replace(" (in regex)", "").replace("error: ", "")
    text = re.sub(r"^at \d+\(\d+\): ", "", text)  # a place in the grammar llguidance wrote
    return re.sub(r"^(\d+)\((\d+)\): ", r"line \1, column \2: ", text)
