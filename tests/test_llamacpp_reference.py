"""The recorded llama.cpp oracle files and the corpus format of scripts/llamacpp_reference.py.

Owns: checks that tests/data/llamacpp/ is self-consistent (the token file's
texts are the corpus as the script decodes it; each greedy step's chosen id
is its top logit; the prompts are Gemma's chat format with BOS) and that the
corpus escapes decode as documented. It does not run llama.cpp (not one of
our dependencies): the script's docstring says how the files were made.
Comparing our tokenizer and model with these files belongs to their tests.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "llamacpp"
GEMMA_VOCAB = 262_144
BOS = 2


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "llamacpp_reference", ROOT / "scripts" / "llamacpp_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at the top
    return module


ref = _script()


def test_corpus_escapes_decode_as_documented() -> None:
    assert ref.decode_line(r"a\nb\tc\rd\\e", "x") == "a\nb\tc\rd\\e"
    assert ref.decode_line("literal\ttab", "x") == "literal\ttab"
    assert ref.decode_line(r"C:\\Users", "x") == "C:\\Users"
    assert ref.decode_line(r"\\n", "x") == "\\n"  # an escaped backslash, then a plain n


@pytest.mark.parametrize("line", [r"bad \x41", "ends in \\", r"\u00e9"])
def test_unknown_escape_is_a_one_line_error(line: str) -> None:
    with pytest.raises(SystemExit) as err:
        ref.decode_line(line, "corpus.txt:7")
    message = str(err.value)
    assert message.startswith("corpus.txt:7: unknown escape") and "\n" not in message
    assert r"use \n, \t, \r or \\" in message


def test_token_file_is_the_corpus_tokenized() -> None:
    data = json.loads((DATA / "gemma3_270m_tokens.json").read_text(encoding="utf-8"))
    texts = ref.read_corpus(DATA / "corpus.txt")
    assert data["texts"] == texts
    assert len(data["ids_plain"]) == len(data["ids_special"]) == len(texts) >= 50
    for text, plain, special in zip(texts, data["ids_plain"], data["ids_special"], strict=True):
        assert all(0 <= i < GEMMA_VOCAB for i in plain + special)
        assert bool(plain) == bool(text)  # no BOS: an empty text is no ids
        if "<" not in text and "[" not in text:  # no control token to match: both agree
            assert plain == special, text
    # the control tokens count only with special tokens on
    i = texts.index("text before<end_of_turn>text after")
    assert 106 in data["ids_special"][i] and 106 not in data["ids_plain"][i]


def test_greedy_file_steps_are_argmaxes_of_their_top5() -> None:
    data = json.loads((DATA / "gemma3_270m_greedy.json").read_text(encoding="utf-8"))
    assert data["steps"] == 16 and 8 <= len(data["runs"]) <= 10
    assert data["template"] == ref.TEMPLATE
    assert [run["prompt"] for run in data["runs"]] == ref.PROMPTS
    for run in data["runs"]:
        ids = run["prompt_ids"]
        assert ids[0] == BOS and ids.count(BOS) == 1
        assert 106 in ids  # <end_of_turn> closes the user's turn
        assert len(run["ids"]) == len(run["top5"]) == 16
        for chosen, top in zip(run["ids"], run["top5"], strict=True):
            assert len(top) == 5 and len({i for i, _ in top}) == 5
            logits = [logit for _, logit in top]
            assert logits == sorted(logits, reverse=True)
            assert chosen == top[0][0]
