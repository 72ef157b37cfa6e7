"""Malformed tokenizer files and model paths give one line naming the file (issue 33, item 9).

Each damaged tokenizer.json is written to tmp_path; loading it must raise one
ValueError whose message starts with that file's path and says what is wrong,
never a TypeError, KeyError, regex error or traceback, and never an allocation
sized by an unchecked id (an added token of id 10**9 took 16 GB and 71 s). The
same through the command line: `pagedllm tokenize --tokenizer PATH` exits 1
with one `error:` line. A FIFO or /dev/zero given as a model is named for what
it is, not "not found".
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from pagedllm import cli
from pagedllm.resolve import resolve_model_path
from pagedllm.tokenizer import Tokenizer
from pagedllm.tokenizer.bytelevel import BYTE_TO_CHAR


def tokenizer_json() -> dict[str, Any]:
    """A valid byte-level tokenizer.json: every byte a token, one merge, one special."""
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR)}
    vocab["ab"] = 256
    return {
        "version": "1.0",
        "added_tokens": [{"id": 257, "content": "<s>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated"},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A"}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [257], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]},
    }


def edited(path: tuple[Any, ...], value: Any) -> Any:
    """The valid file with the value at `path` replaced (() replaces the whole file)."""
    if not path:
        return value
    data = tokenizer_json()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def without(key: str) -> dict[str, Any]:
    data = tokenizer_json()
    del data[key]
    return data


# (name, file contents, what the message must say)
BAD: list[tuple[str, Any, str]] = [
    ("a JSON list", edited((), [1, 2]), "holds a JSON array, expected an object"),
    ("a JSON string", '"tokenizer"', "holds a JSON string"),
    ("no model", without("model"), "no 'model'"),
    ("model a list", edited(("model",), []), "model is \\[\\], expected an object"),
    ("no vocab", edited(("model", "vocab"), None), "model has no 'vocab'"),
    ("vocab a list", edited(("model", "vocab"), ["a"]), "model.vocab is \\['a'\\]"),
    ("merges [123, null]", edited(("model", "merges"), [123, None]), "malformed merge 123"),
    ("merges a string", edited(("model", "merges"), "a b"), "model.merges is 'a b'"),
    ("merge of 3 symbols", edited(("model", "merges"), [["a", "b", "c"]]), "malformed merge"),
    ("merge of ints", edited(("model", "merges"), [[1, 2]]), "malformed merge \\[1, 2\\]"),
    (
        "bad regex",
        edited(("pre_tokenizer", "pretokenizers", 0, "pattern"), {"Regex": "(?P<"}),
        "pre_tokenizer regex '\\(\\?P<' does not compile",
    ),
    (
        "regex not a string",
        edited(("pre_tokenizer", "pretokenizers", 0, "pattern"), {"Regex": 5}),
        "a Split pattern is \\{'Regex': 5\\}",
    ),
    ("pre_tokenizer a list", edited(("pre_tokenizer",), [1]), "a pre_tokenizer is \\[1\\]"),
    (
        "unknown Split behavior",
        edited(("pre_tokenizer", "pretokenizers", 0, "behavior"), "Sideways"),
        "unknown behavior 'Sideways'",
    ),
    (
        "vocab id a string",
        edited(("model", "vocab", "a"), "97"),
        "the id of vocab token 'a' is '97'",
    ),
    ("vocab id a float", edited(("model", "vocab", "a"), 97.5), "is 97.5, expected an integer"),
    ("vocab id negative", edited(("model", "vocab", "a"), -1), "is -1, expected an integer in"),
    ("vocab id 10**9", edited(("model", "vocab", "a"), 10**9), "is 1000000000, expected"),
    ("vocab id true", edited(("model", "vocab", "a"), True), "is True, expected an integer"),
    (
        "added token id 10**9",
        edited(("added_tokens", 0, "id"), 10**9),
        "the id of added token '<s>' is 1000000000, expected an integer in \\[0, 4,194,304\\)",
    ),
    ("added token id null", edited(("added_tokens", 0, "id"), None), "added token '<s>' is None"),
    ("added token content", edited(("added_tokens", 0, "content"), 5), "content of added token"),
    ("added token flag", edited(("added_tokens", 0, "special"), "yes"), "special of added token"),
    ("added tokens a dict", edited(("added_tokens",), {"id": 1}), "added_tokens is \\{'id': 1\\}"),
    ("added token a list", edited(("added_tokens", 0), [257]), "an added token is \\[257\\]"),
    ("normalizer a string", edited(("normalizer",), "NFC"), "normalizer 'NFC' is not supported"),
    ("decoder a list", edited(("decoder",), []), "decoder \\[\\] is not supported"),
    ("post_processor a list", edited(("post_processor",), [1]), "post_processor is \\[1\\]"),
    (
        "template names no token",
        edited(("post_processor", "single", 0, "SpecialToken", "id"), "<t>"),
        "names '<t>', which is no token",
    ),
    (
        "template ids out of range",
        edited(("post_processor", "special_tokens", "<s>", "ids"), [10**9]),
        "the ids of post-processor token '<s>' is \\[1000000000\\], expected ids below 258",
    ),
    (
        "template item a string",
        edited(("post_processor", "single", 0), "<s>"),
        "a TemplateProcessing item is '<s>'",
    ),
    ("ignore_merges a string", edited(("model", "ignore_merges"), "no"), "ignore_merges is 'no'"),
]


def write(directory: Path, contents: Any, name: str = "tokenizer.json") -> Path:
    path = directory / name
    path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
    return path


def assert_one_line_naming(error: BaseException, path: Path, says: str) -> None:
    import re

    message = str(error)
    assert message.startswith(f"{path}: ") or message.startswith(f"{path} "), message
    assert "\n" not in message and re.search(says, message), message


def test_the_valid_file_loads(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(write(tmp_path, tokenizer_json()))
    assert tok.encode("ab1", add_special_tokens=True) == [257, 256, ord("1")]


@pytest.mark.parametrize(("contents", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_malformed_tokenizer_json_is_one_line_naming_the_file(
    tmp_path: Path, contents: Any, says: str
) -> None:
    path = write(tmp_path, contents)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        Tokenizer.from_file(path)
    assert_one_line_naming(e.value, path, says)
    # Refused before any table is sized by an id (10**9 ids took 16 GB and 71 s).
    assert time.perf_counter() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not valid JSON"),
        ('{"model": ', "not valid JSON"),
        ("\udcff", "not valid JSON"),  # not UTF-8
        ("[" * 100_000, "not valid JSON"),  # nested past the recursion limit
    ],
    ids=["truncated", "cut short", "not utf-8", "nested too deep"],
)
def test_a_tokenizer_json_that_is_not_json_names_the_file(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    with pytest.raises(ValueError) as e:
        Tokenizer.from_file(path)
    assert_one_line_naming(e.value, path, says)


@pytest.mark.parametrize(
    ("name", "contents", "says"),
    [
        ("tokenizer_config.json", "{", "not valid JSON"),
        ("tokenizer_config.json", [1], "holds a JSON array"),
        ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token is 'yes'"),
        ("tokenizer_config.json", {"chat_template": 5}, "chat_template is 5"),
        ("tokenizer_config.json", {"chat_template": [{"name": 1}]}, "chat_template is"),
        ("generation_config.json", "nope", "not valid JSON"),
        ("generation_config.json", {"eos_token_id": 10**12}, "eos_token_id is 1000000000000"),
        ("generation_config.json", {"eos_token_id": [1, "x"]}, "expected token ids below 258"),
    ],
)
def test_a_malformed_file_beside_it_is_named(
    tmp_path: Path, name: str, contents: Any, says: str
) -> None:
    write(tmp_path, tokenizer_json())
    beside = write(tmp_path, contents, name)
    with pytest.raises(ValueError) as e:
        Tokenizer.from_model_path(tmp_path)
    assert_one_line_naming(e.value, beside, says)


def test_a_spec_built_in_code_is_checked_before_its_tables(tmp_path: Path) -> None:
    from pagedllm.tokenizer.loaders import load_tokenizer_json

    spec = load_tokenizer_json(write(tmp_path, tokenizer_json()))
    spec.vocab["zz"] = 10**9
    start = time.perf_counter()
    with pytest.raises(ValueError, match="token id 1000000000 is outside \\[0, 4,194,304\\)"):
        Tokenizer(spec)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("command", [["tokenize", "hi"], ["detokenize", "1"]])
def test_the_cli_prints_one_line_for_a_malformed_tokenizer(tmp_path, capsys, command) -> None:
    path = write(tmp_path, edited(("model", "merges"), [123, None]))
    assert cli.main([command[0], "--tokenizer", str(path), *command[1:]]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagedllm {command[0]}: error: {path}: malformed merge 123")


# ------------------------------------------------------------------ special files as models
@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    return path


def test_a_fifo_or_a_device_as_a_model_is_named_not_not_found(fifo: Path) -> None:
    for path, kind in [(fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device")]:
        with pytest.raises(ValueError) as e:
            resolve_model_path(path)
        message = str(e.value)
        assert message.startswith(f"{path} is {kind}, not a model") and "not found" not in message
        with pytest.raises(ValueError) as e:
            Tokenizer.from_model_path(path)  # returns at once: nothing is opened
        assert str(e.value).startswith(f"{path} is {kind}, not a tokenizer")


def test_a_fifo_or_a_device_as_a_tokenizer_file_is_not_read(tmp_path: Path) -> None:
    fifo_json = tmp_path / "tokenizer.json"
    os.mkfifo(fifo_json)
    for path, kind in [
        (fifo_json, "a FIFO (named pipe)"),
        (Path("/dev/zero"), "a character device"),
    ]:
        with pytest.raises(ValueError) as e:
            Tokenizer.from_file(path)  # a read would block (FIFO) or never end
        assert str(e.value) == f"{path} is {kind}, not a JSON file"
    with pytest.raises(ValueError, match="is a FIFO .*, not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("command", [[], ["tokenize"], ["inspect"]])
def test_the_cli_names_a_special_file_given_as_the_model(fifo, capsys, command) -> None:
    for path, kind in [(fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device")]:
        prompt = [] if command == ["inspect"] else ["hi"]
        assert cli.main([*command, "--model", str(path), *prompt]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path} is {kind}" in err and "not found" not in err
