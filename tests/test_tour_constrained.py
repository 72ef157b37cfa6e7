"""Tour chapter 19 ("Constrained decoding") says what the code does.

The command line has no flag for a constraint, so the chapter shows Python
instead of `pagedllm` commands: this test runs its python blocks, in order,
in one namespace (as a reader would paste them), on the default model, and
holds each block that is followed by a `text` block to printing exactly that
text. The blocks that quote the source (first line `# src/...`) must still
be in their files, verbatim (as in chapter 18, tests/test_tour_families.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import textwrap
from pathlib import Path

import pytest

from test_tour_families import found_verbatim

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "docs" / "tour" / "19-constrained-decoding.md"
# A fenced block, at any indent (an exercise's blocks sit inside a list item).
BLOCK = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", flags=re.M | re.S)


def blocks(exercises: bool = True) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the chapter, dedented, in order;
    without `exercises`, only those before the Exercises section."""
    text = CHAPTER.read_text(encoding="utf-8")
    if not exercises:
        text = text.split("\n## Exercises\n")[0]
    return [(lang, textwrap.dedent(body)) for _, lang, body in BLOCK.findall(text)]


def quotes() -> list[tuple[str, list[str]]]:
    """(path, lines) of each python block that quotes a source file."""
    found = []
    for lang, body in blocks():
        lines = body.rstrip("\n").split("\n")
        if lang == "python" and lines[0].startswith("# src/"):
            found.append((lines[0][2:].split(",")[0], lines[1:]))
    return found


def runnable(exercises: bool = True) -> list[tuple[str, str | None]]:
    """(code, the text it must print or None) of each python block that is not a quote."""
    found, bs = [], blocks(exercises)
    for k, (lang, body) in enumerate(bs):
        if lang != "python" or body.startswith("# src/"):
            continue
        shown = bs[k + 1][1] if k + 1 < len(bs) and bs[k + 1][0] == "text" else None
        found.append((body, shown))
    return found


def test_the_chapter_quotes_the_source_verbatim():
    found = quotes()
    assert len(found) >= 5
    files = {path for path, _ in found}
    assert {"src/pagedllm/runner/model_runner.py", "src/pagedllm/engine/llm_engine.py"} <= files
    stale = [
        (path, lines)
        for path, lines in found
        if not found_verbatim(lines, (ROOT / path).read_text().split("\n"))
    ]
    assert not stale, "chapter 19 quotes lines its files no longer have:\n" + "\n\n".join(
        path + ":\n" + "\n".join(lines) for path, lines in stale
    )


def test_the_bitmask_sizes_it_quotes():
    from pagedllm.structured import bitmask_words

    text = CHAPTER.read_text(encoding="utf-8")
    assert bitmask_words(49152) == 1536 and "49,152 ids take\n1,536 words, 6 KiB" in text
    assert bitmask_words(128256) == 4008 and "128,256 take 4,008 words, 16 KB" in text


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_path):
    """`LLM()` as the chapter builds it, on the session's already loaded default model."""
    from pagedllm import LLM
    from pagedllm.tokenizer import Tokenizer

    return LLM(model=smollm2, tokenizer=Tokenizer.from_model_path(smollm2_path))


def run(code: list[tuple[str, str | None]], llm, monkeypatch) -> dict:
    """Run the blocks in order in one namespace, each printing what the chapter shows
    after it (if it shows anything); returns the namespace."""
    import pagedllm

    # The chapter's `LLM()` loads the default model; the test hands it the loaded one.
    monkeypatch.setattr(pagedllm, "LLM", lambda: llm)
    namespace: dict = {}
    for body, shown in code:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(body, str(CHAPTER), "exec"), namespace)
        if shown is not None:
            assert out.getvalue() == shown, (
                "chapter 19 shows another output than its code prints now "
                "(rerun the block and paste what it prints):\n" + out.getvalue()
            )
    return namespace


def test_the_chapter_runs_and_prints_what_it_shows(llm, monkeypatch):
    code = runnable(exercises=False)
    assert len(code) == 2 and code[0][0].count("LLM()") == 1
    assert all(shown is not None for _, shown in code)
    namespace = run(code, llm, monkeypatch)
    # What the text says of those outputs, checked on the objects themselves.
    outs = namespace["outs"]
    free, person, choice, regex = outs
    assert [o.finish_reason for o in outs] == ["length", "stop", "stop", "length"]
    jsonschema.validate(json.loads(person.text), namespace["person"])
    assert not set(person.token_ids) & set(llm.tokenizer.eos_token_ids)  # ended by its matcher
    assert choice.text in ("yes", "no") and re.fullmatch("a+", regex.text)
    assert namespace["matcher"].is_finished
    assert namespace["allowed"](namespace["bitmask"][0]) == sorted(llm.tokenizer.eos_token_ids)


@pytest.mark.slow  # about 4 s on a 2-core CPU: the exercises generate 30 more steps
def test_the_exercises_run(llm, monkeypatch):
    code = runnable()
    assert len(code) > len(runnable(exercises=False))
    namespace = run(code, llm, monkeypatch)
    # Exercise 1's answer: the choice spelled n + o, the second token forced.
    out = namespace["out"]
    assert [llm.tokenizer.decode([t]) for t in out.token_ids] == ["n", "o"]
    assert out.logprobs[1][out.token_ids[1]] == 0.0
    # Exercise 2's: flexible whitespace indents; strict=False lets it add keys.
    flexible, loose = (json.loads(o.text) for o in namespace["both"])
    assert "\n" in namespace["both"][0].text and set(flexible) == {"name", "age"}
    assert set(loose) > {"name", "age"}
