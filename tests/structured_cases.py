"""Constraints for the structured-output tests (tests/test_structured.py): the
JSON schemas a random model must satisfy, and malformed constraints each of
which must be a one-line ValueError.

A random model picks uniformly among the allowed tokens, so every free-form
part of a schema is bounded here (strings by maxLength, a pattern, an enum or
a format, and the time format, whose fraction of a second has no bound, by a
maxLength too; arrays by maxItems; numbers by their digits' own odds of ending):
an unbounded string over SmolLM2's 49,152 tokens would need one of the few
tokens that close it, and a random model almost never picks those. A real
model ends its strings; the bounds only keep the test to a few hundred tokens.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 8}

# (label, schema): at least 30, covering nested objects, arrays with
# minItems/maxItems, enums, required fields, string patterns, numbers with
# bounds, booleans, nulls, anyOf/oneOf, $defs/$ref and formats.
SCHEMAS: list[tuple[str, dict]] = [
    (
        "flat object",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
            "required": ["name", "age"],
        },
    ),
    (
        "nested object",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": NAME,
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["id", "address"],
                }
            },
            "required": ["user"],
        },
    ),
    (
        "array min/max items",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": -50, "maximum": 50},
            "minItems": 2,
            "maxItems": 4,
        },
    ),
    (
        "array exact length",
        {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    ),
    ("string enum", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("mixed enum", {"enum": ["a", 1, None, True, 2.5]}),
    ("const", {"const": {"kind": "fixed", "n": 3}}),
    ("string pattern", {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}),
    ("string length", {"type": "string", "minLength": 2, "maxLength": 5}),
    ("integer bounds", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("negative integer bounds", {"type": "integer", "minimum": -1000, "maximum": -1}),
    (
        "number exclusive bounds",
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    ),
    ("number any", {"type": "number"}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("anyOf scalar", {"anyOf": [NAME, {"type": "integer", "minimum": 0, "maximum": 9}]}),
    (
        "anyOf objects",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"cat": {"const": "meow"}},
                    "required": ["cat"],
                },
                {
                    "type": "object",
                    "properties": {"dog": {"type": "integer", "minimum": 0, "maximum": 3}},
                    "required": ["dog"],
                },
            ]
        },
    ),
    ("oneOf", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}),
    (
        "$defs and $ref",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                }
            },
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"],
        },
    ),
    (
        "array of $ref objects",
        {
            "$defs": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"tag": {"$ref": "#/$defs/tag"}, "on": {"type": "boolean"}},
                "required": ["tag", "on"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "optional fields",
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": NAME},
            "required": ["a"],
        },
    ),
    (
        "nullable field",
        {
            "type": "object",
            "properties": {"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}},
            "required": ["v"],
        },
    ),
    (
        "nested arrays",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "maxItems": 3,
            },
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    ("date format", {"type": "string", "format": "date"}),
    ("time format", {"type": "string", "format": "time", "maxLength": 20}),
    ("uuid format", {"type": "string", "format": "uuid"}),
    ("email format", {"type": "string", "format": "email", "maxLength": 20}),
    ("multipleOf", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    (
        "tuple prefixItems",
        {
            "type": "array",
            "prefixItems": [
                NAME,
                {"type": "integer", "minimum": 0, "maximum": 9},
                {"type": "boolean"},
            ],
            "items": False,
        },
    ),
    (
        "string pattern alternation",
        {"type": "string", "pattern": "^(yes|no|maybe)(!|\\?)?$"},
    ),
    (
        "typical: a person",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                "role": {"enum": ["admin", "user", "guest"]},
                "active": {"type": "boolean"},
                "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
                "manager": {"type": ["string", "null"], "maxLength": 8},
            },
            "required": ["name", "age", "email", "role", "active", "tags", "manager"],
        },
    ),
    (
        "tool call",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": NAME,
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city", "unit"],
                },
            },
            "required": ["name", "arguments"],
        },
    ),
    (
        "additionalProperties false, minProperties",
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
            "additionalProperties": False,
            "minProperties": 1,
        },
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                {"properties": {"b": {"type": "null"}}, "required": ["b"]},
            ]
        },
    ),
]

# Malformed or unsupported constraints: (label, StructuredOutput keyword arguments,
# a fragment the one-line error must hold).
MALFORMED: list[tuple[str, dict, str]] = [
    ("schema not JSON", {"json": "{not json"}, "not valid JSON"),
    ("schema a list", {"json": [1, 2]}, "JSON schema must be an object"),
    ("unknown type", {"json": {"type": "foo"}}, "Invalid type"),
    ("unsupported keyword", {"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ("not", {"json": {"not": {"type": "string"}}}, "not"),
    ("if/then", {"json": {"if": {"type": "string"}, "then": {"minLength": 1}}}, "if"),
    ("bad pattern", {"json": {"type": "string", "pattern": "a(b"}}, "unclosed group"),
    ("missing $ref", {"json": {"$ref": "#/$defs/missing"}}, "missing"),
    ("minItems > maxItems", {"json": {"type": "array", "minItems": 5, "maxItems": 2}}, "minItems"),
    ("empty enum", {"json": {"enum": []}}, "Unsatisfiable"),
    ("minimum not a number", {"json": {"type": "integer", "minimum": "x"}}, "minimum"),
    ("negative minLength", {"json": {"type": "string", "minLength": -1}}, "minLength"),
    ("unknown format", {"json": {"type": "string", "format": "foo"}}, "format"),
    ("regex unclosed group", {"regex": "a(b"}, "unclosed group"),
    ("regex bad repetition", {"regex": "a{3,1}"}, "regex"),
    ("regex bad class", {"regex": "[z-a]"}, "regex"),
    ("regex empty", {"regex": ""}, "empty"),
    ("choice empty", {"choice": []}, "at least one"),
    ("choice not strings", {"choice": ["a", 3]}, "strings"),
    ("grammar unknown rule", {"grammar": "start: foo"}, "foo"),
    ("grammar syntax", {"grammar": 'start: ("a"'}, "grammar"),
    ("gbnf unknown rule", {"grammar": 'root ::= "a" b'}, "b"),
    ("grammar empty", {"grammar": "  "}, "empty"),
    ("two constraints", {"json": {"type": "string"}, "regex": "a"}, "exactly one"),
    ("no constraint", {}, "exactly one"),
    ("bad whitespace", {"json_object": True, "whitespace": "lots"}, "whitespace"),
]
